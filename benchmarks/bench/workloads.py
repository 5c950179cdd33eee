"""`--workload`: the work a run measures, and the flags that shape each.

- `chat` (the default): closed-loop multi-turn chat at each `--concurrency`, then the replay of a
  Mooncake-format trace (a synthesized one, or `--trace FILE`).
- `agents`: agent loops whose contexts grow by tool results (`bench/agents.py`). Unless given, the
  device pool holds one long context and the host budget as much KV again (`fit_host`), so the
  agents' contexts leave both between their turns.
- `mooncake-trace`: the subset of Mooncake's FAST'25 synthetic trace kept in `benchmarks/traces/`
  (whole conversations; its NOTICE says how it was cut), replayed open-loop twice on each server:
  `mooncake_arrival`, arrivals as in the trace times `--time-scale`, and `mooncake_saturated`,
  arrivals `SATURATE` times closer, so requests queue and the server is always busy. A turn is sent at
  its time even while its conversation's previous turn is still queued or running; the figures
  `early_*` and `late_*` split the resumed turns by that (`summary.early_sources`). Unless given,
  the device pool holds its longest request.

Every size of `agents` and `mooncake-trace` is nominal (what the work is on a GPU) times a token
scale that this CPU can prefill; the final line says the scale.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path

from benchmarks.bench import agents as agent_loops
from benchmarks.bench import trace
from benchmarks.bench.agents import Agents
from benchmarks.bench.spec import BenchSpec, Cut, MultiTurn, Shape, SpecError, Trace

WORKLOADS = ("chat", "agents", "mooncake-trace")
MOONCAKE_FAST25 = Path(__file__).resolve().parent.parent / "traces" / "mooncake_fast25_synthetic.jsonl"
# The public trace's replay: 18.6K-token prompts on average become 580 (16-token blocks, one page);
# its 1,022 s of arrivals become 51 s (--quick: 40 requests over 20 s)
MOONCAKE = Trace(path=MOONCAKE_FAST25, requests=200, time_scale=0.05, token_scale=1 / 32, name="mooncake_arrival",
                 salt=1, cut=Cut.CONVERSATIONS)  # fmt: skip
MOONCAKE_QUICK = replace(MOONCAKE, requests=40, time_scale=0.02)
SATURATE = 50  # the saturated replay's arrivals are this many times closer than the arrival-bound one's
AGENTS_QUICK = Agents(count=10, think_s=0.5, token_scale=1 / 32)
AGENT_FLAGS = ("agents", "think_s", "tool_tokens", "max_context")
CHAT_FLAGS = (
    "concurrency",
    "rounds",
    "first_tokens",
    "question_tokens",
    "output_tokens",
    "trace",
    "no_trace",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`--workload` and the agents' flags (their defaults: `Agents`; --quick: `AGENTS_QUICK`)."""
    a, q = Agents(), AGENTS_QUICK
    p.add_argument("--workload", choices=WORKLOADS, default="chat",
                   help="chat (default): multi-turn chat and a trace replay; agents: agent loops; "
                   "mooncake-trace: Mooncake's FAST'25 synthetic trace, arrival-bound and saturated")  # fmt: skip
    p.add_argument(
        "--agents", type=int, help=f"agents: how many loops (default {a.count}; --quick: {q.count})"
    )
    p.add_argument("--think-s", type=float, help=f"agents: a tool's run between an answer and the next turn, "
                   f"seconds (default {a.think_s:g}; --quick: {q.think_s:g})")  # fmt: skip
    p.add_argument("--tool-tokens", metavar="MIN,MAX", help="agents: a tool result's size, nominal tokens "
                   f"(default {a.tool_tokens[0]},{a.tool_tokens[1]})")  # fmt: skip
    p.add_argument("--max-context", type=int, help=f"agents: an agent stops before its context passes this, "
                   f"nominal tokens (default {a.max_context})")  # fmt: skip


def given(args: argparse.Namespace, p: argparse.ArgumentParser, names: tuple[str, ...]) -> list[str]:
    """Of the options `names`, the flags (as typed) that `args` sets to other than their default."""
    return [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) != p.get_default(n)]


def refuse_foreign_flags(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """SpecError, in one line, for a flag that shapes a workload other than the one chosen."""
    foreign = given(args, p, AGENT_FLAGS) if args.workload != "agents" else []
    if args.workload != "chat":
        foreign += given(args, p, CHAT_FLAGS)
    if args.workload == "agents":
        foreign += given(args, p, ("trace_requests", "time_scale"))
    if foreign:
        raise SpecError(f"not with --workload {args.workload}: {', '.join(foreign)}")


def agents_from(args: argparse.Namespace) -> Agents:
    base = AGENTS_QUICK if args.quick else Agents()
    settings = {"count": args.agents, "think_s": args.think_s, "max_context": args.max_context,
                "token_scale": args.token_scale, "tool_tokens": _pair(args.tool_tokens)}  # fmt: skip
    return replace(base, **{k: v for k, v in settings.items() if v is not None})


def _pair(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        low, high = (int(x) for x in text.split(","))
    except ValueError:
        raise SpecError(f"--tool-tokens takes MIN,MAX (two integers), got {text!r}") from None
    return low, high


def mooncake_from(args: argparse.Namespace) -> tuple[Trace, Trace]:
    """The public trace's two replays: arrival-bound, then saturated (its own salt: no shared KV)."""
    base = MOONCAKE_QUICK if args.quick else MOONCAKE
    settings = {
        "requests": args.trace_requests,
        "time_scale": args.time_scale,
        "token_scale": args.token_scale,
    }
    arrival = replace(base, **{k: v for k, v in settings.items() if v is not None})
    saturated = replace(arrival, name="mooncake_saturated", salt=2, time_scale=arrival.time_scale / SATURATE)
    return arrival, saturated


def pool_tokens(spec_agents: Agents | None, traces: tuple[Trace, ...], page_size: int) -> int:
    """The device pool a workload needs unless --pool-tokens is given: the agents' (`Agents.pool_tokens`),
    or room for a replay's longest request (x1.25), at least the chat default."""
    if spec_agents is not None:
        return spec_agents.pool_tokens(page_size)
    longest = max((trace.longest(trace.load(t), t) for t in traces if t.cut is Cut.CONVERSATIONS), default=0)
    return max(Shape().pool_tokens, math.ceil(1.25 * longest / page_size) * page_size)


def chat_from(
    args: argparse.Namespace, concurrencies: list[int]
) -> tuple[tuple[MultiTurn, ...], tuple[Trace, ...]]:
    """The chat workload: its multi-turn conversations and its trace (none with --no-trace)."""
    turns = {"rounds": args.rounds, "first_tokens": args.first_tokens, "question_tokens": args.question_tokens,
             "output_tokens": args.output_tokens}  # fmt: skip
    multiturn = tuple(MultiTurn(concurrency=c, **turns) for c in concurrencies)
    default = Trace()
    settings = {
        "requests": args.trace_requests,
        "time_scale": args.time_scale,
        "token_scale": args.token_scale,
    }
    chat_trace = replace(default, path=args.trace, **{k: v for k, v in settings.items() if v is not None})
    return multiturn, () if args.no_trace else (chat_trace,)


def fit_host(spec: BenchSpec, model: Path) -> BenchSpec:
    """`spec` with its host budget sized to hold as much KV of `model` as the device pool, where it
    asks for that (`BenchSpec.host_budget_fits_pool`)."""
    if not spec.host_budget_fits_pool:
        return spec
    budget = agent_loops.host_budget_mb(spec.shape.pool_tokens, model)
    return replace(spec, shape=replace(spec.shape, host_budget_mb=budget), host_budget_fits_pool=False)


def described(spec: BenchSpec) -> dict[str, object]:
    """The workload's shape for the final line: its token and time scales and the agents' sizes."""
    out: dict[str, object] = {}
    if spec.agents is not None:
        a = spec.agents
        out["agents"] = {"count": a.count, "think_s": a.think_s, "tool_tokens": list(a.tool_tokens),
                         "max_context": a.max_context, "token_scale": a.token_scale,
                         "scaled_max_context": a.scaled(a.max_context), "turns": len(agent_loops.send_order(a))}  # fmt: skip
    for t in spec.traces:
        out[t.name] = {"file": t.path.name if t.path else "synthesized", "requests_at_most": t.requests,
                       "cut": t.cut.value, "token_scale": t.token_scale, "time_scale": t.time_scale}  # fmt: skip
    return out
