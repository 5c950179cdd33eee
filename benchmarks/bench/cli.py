"""`python -m sgl_hicache.bench`: ours vs sglang's default cache vs sglang HiCache vs LMCache, side by side.

Each system serves the same model (default: SmolLM2-135M-Instruct) with the same device pool,
host-memory budget and token-level workloads, `--repeats` times in interleaved order. `--workload`
(`bench/workloads.py`): `chat` (the default: closed-loop multi-turn chat at each concurrency, then a
Mooncake-format trace replay), `agents` (agent loops whose contexts grow by tool results and leave
device and host memory between turns) or `mooncake-trace` (Mooncake's FAST'25 synthetic trace,
arrival-bound and saturated); the final line says its token scale (`workload`) and gives, per
workload and system (`figures`), resumed-turn TTFT p50/p90, throughput, where resumed turns found
their prefix, tokens restored and recomputed, and disk bytes written per byte restored
(`bench/disk_writes.py`). By default the peers run in their strongest configurations of the
measured runs (`spec.DEFAULT_SYSTEMS`); every configuration of HiCache (`spec.HICACHE_CONFIGS`) and
LMCache (`spec.LMCACHE_CONFIGS`, each server beside its own LMCache daemon) can be named. For each
figure, ours is set against the best configuration of each peer at it (median over repeats): the
final line names them (`best_hicache_config`, `best_lmcache_config`) and gives the ratios
(`ttft_vs_best_hicache`, `throughput_vs_best_lmcache`, ...); `--gate` applies each workload's
targets against every peer that ran. Progress goes to stderr; results go to OUT_DIR/run-<time>/ as
results.json, requests.csv, summary.csv and ttft_per_round.png; the last stdout line is one JSON
object. Exit status: 0, or 1 when `--gate`/`--soak` fail, 2 on bad arguments.

`--servers 2` runs instead two servers behind sglang's router (smg), in the configurations of
`bench/cluster.py` (`--configs` picks some): sharing a tier (ours on one tier directory, writing
through or back; ours on separate ones; ours on a Mooncake Store; HiCache's `file` L3 in one shared
directory, and its `mooncake` L3 where it runs) and routing (ours behind round robin, smg's
approximate tree, or smg's index of the servers' KV events), on the multi-turn workloads.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks.bench import (
    agents,
    aggregate,
    cluster,
    disk_speed,
    gate,
    report,
    run,
    soak,
    systems,
    workloads,
)
from benchmarks.bench.agents import Agents
from benchmarks.bench.server_process import ServerStartError
from benchmarks.bench.spec import (
    DEFAULT_SYSTEMS,
    DEVICES,
    HICACHE,
    LMCACHE,
    SYSTEMS,
    BenchSpec,
    Gate,
    MultiTurn,
    Shape,
    Soak,
    SpecError,
    Trace,
    expand_systems,
    quick,
)
from benchmarks.bench.summary import ratios
from benchmarks.bench.workloads import AGENTS_QUICK, MOONCAKE, MOONCAKE_QUICK, SATURATE


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sgl_hicache.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    shape, mt, tr = Shape(), MultiTurn(), Trace()
    p.add_argument(
        "--quick",
        action="store_true",
        help="one repeat, the first concurrency only, at most 12 trace requests",
    )
    p.add_argument(
        "--systems", default=",".join(DEFAULT_SYSTEMS),
        help="comma-separated systems (default %(default)s: recompute, the resident reference, ours and the "
        "strongest configurations of each peer in the measured runs). Every configuration can be named: "
        f"{', '.join(SYSTEMS)}; 'hicache' = every HiCache configuration, 'lmcache' every LMCache one, 'all' "
        "every system (hicache-nixl with --device cuda only)",
    )  # fmt: skip
    p.add_argument("--repeats", type=int, default=None,
                   help=f"runs of each system, interleaved; figures are medians (default {BenchSpec().repeats}; --quick: 1)")  # fmt: skip
    p.add_argument(
        "--model", "--model-path", dest="model", default=shape.model,
        help="smollm2, a generated size (tiny, small) or a model dir (default %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--device", choices=DEVICES, default=shape.device,
        help="where every server runs, with sglang's defaults for that device (default %(default)s; "
        "cuda: your GPU box, HiCache with its GPU defaults: kernel I/O, page_first layout)",
    )  # fmt: skip
    p.add_argument(
        "--pool-tokens",
        type=int,
        help=f"device KV pool, tokens (default {shape.pool_tokens}; agents: one long context x1.25; "
        "mooncake-trace: its longest request x1.25, at least that)",
    )
    p.add_argument(
        "--host-budget-mb",
        type=int,
        help="our staging bound, what the *-budget HiCache configurations add to the device pool in their host "
        f"pool, LMCache's L1; MiB (default {shape.host_budget_mb}; agents: the device pool's KV)",
    )
    p.add_argument("--page-size", type=int, default=shape.page_size)
    p.add_argument(
        "--disk-read-mib-s", type=float, default=None, metavar="MIB_S",
        help="the disk's cold read speed that hicache-timeout-tuned's prefetch timeouts are derived from "
        "(default: measured under --out at the start of a run that has it, 64 MiB read once)",
    )  # fmt: skip
    p.add_argument(
        "--concurrency",
        default=",".join(str(m.concurrency) for m in BenchSpec().multiturn),
        help="multi-turn concurrencies, comma-separated; '' for none (default %(default)s)",
    )
    p.add_argument("--rounds", type=int, default=mt.rounds)
    p.add_argument("--first-tokens", type=int, default=mt.first_tokens)
    p.add_argument("--question-tokens", type=int, default=mt.question_tokens)
    p.add_argument("--output-tokens", type=int, default=mt.output_tokens)
    p.add_argument("--trace", type=Path, help="Mooncake-format JSONL trace (default: a synthesized one)")
    p.add_argument("--no-trace", action="store_true", help="skip the trace replay")
    p.add_argument("--trace-requests", type=int,
                   help=f"replay at most this many (default {tr.requests}; mooncake-trace: whole conversations, "
                   f"{MOONCAKE.requests}, --quick {MOONCAKE_QUICK.requests})")  # fmt: skip
    p.add_argument("--time-scale", type=float,
                   help=f"arrival times x this (default {tr.time_scale:g}; mooncake-trace: {MOONCAKE.time_scale:g}, "
                   f"--quick {MOONCAKE_QUICK.time_scale:g}; its saturated replay {SATURATE} x closer)")  # fmt: skip
    p.add_argument("--token-scale", type=float,
                   help=f"token counts x this (default {tr.token_scale:g}; agents: {Agents().token_scale:g}, --quick "
                   f"{AGENTS_QUICK.token_scale:g}; mooncake-trace: {MOONCAKE.token_scale:g})")  # fmt: skip
    workloads.add_arguments(p)
    p.add_argument("--gate", action="store_true", help="apply the gate's thresholds to the exit status")
    p.add_argument("--soak", type=float, default=0.0, metavar="MINUTES", help="then soak ours for MINUTES")
    p.add_argument(
        "--out", type=Path, default=Path("out/bench"), help="output directory (default %(default)s)"
    )
    p.add_argument(
        "--servers", type=int, default=1,
        help="1: the systems side by side (default); 2: two servers behind the router (smg) in each "
        "configuration of bench/cluster.py: sharing a tier (a directory, a Mooncake Store) and routing "
        "(round robin, approximate tree, KV events), multi-turn workloads only",
    )  # fmt: skip
    p.add_argument(
        "--configs",
        default=None,
        metavar="A,B",
        help="with --servers 2: only these configurations (default: all that can run here)",
    )
    p.add_argument("--keep-page-cache", action="store_true", help="do not drop the page cache between phases")
    return p


def spec_from(args: argparse.Namespace) -> BenchSpec:
    """The run `args` ask for; SpecError for settings that cannot work (`workloads` for each workload's)."""
    workloads.refuse_foreign_flags(args, parser())
    concurrencies = _ints(args.concurrency, "--concurrency")
    multiturn, traces = workloads.chat_from(args, concurrencies)
    agents = workloads.agents_from(args) if args.workload == "agents" else None
    if args.workload != "chat":
        multiturn, traces = (), workloads.mooncake_from(args) if args.workload == "mooncake-trace" else ()
    pool = args.pool_tokens or workloads.pool_tokens(agents, traces, args.page_size)
    shape = Shape(model=args.model, pool_tokens=pool, host_budget_mb=args.host_budget_mb or Shape().host_budget_mb,
                  page_size=args.page_size, device=args.device, disk_read_mib_s=args.disk_read_mib_s)  # fmt: skip
    soak_load = (multiturn or workloads.chat_from(args, [MultiTurn().concurrency])[0])[0]
    spec = BenchSpec(
        shape=shape, multiturn=multiturn, traces=traces, agents=agents,
        systems=expand_systems(args.systems, args.device),
        gate=Gate() if args.gate else None, soak=Soak(minutes=args.soak, load=soak_load) if args.soak > 0 else None,
        out_dir=args.out, drop_page_cache=not args.keep_page_cache,
        host_budget_fits_pool=agents is not None and args.host_budget_mb is None, workload=args.workload,
    )  # fmt: skip
    spec = quick(spec) if args.quick else spec
    return spec if args.repeats is None else replace(spec, repeats=args.repeats)


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise SpecError(f"{flag} takes comma-separated integers, got {text!r}") from None


def cluster_run(args: argparse.Namespace, spec: BenchSpec) -> bool:
    """Whether `--servers` asks for the two-server run (`bench/cluster.py`); SpecError for a
    `--servers` other than 1 or 2, or with settings the two-server run does not take."""
    if args.servers not in (1, 2):
        raise SpecError(f"--servers must be 1 or 2, got {args.servers}")
    if args.servers == 1:
        if args.configs is not None:
            raise SpecError("--configs names configurations of --servers 2")
        return False
    if spec.workload != "chat":
        raise SpecError(f"--servers 2 runs the chat workload's conversations, not --workload {spec.workload}")
    if not spec.multiturn:
        raise SpecError("--servers 2 runs the multi-turn workloads: give --concurrency")
    clashes = [flag for flag, on in (("--systems", args.systems != parser().get_default("systems")),
                                     ("--gate", args.gate), ("--soak", args.soak > 0)) if on]  # fmt: skip
    if clashes:
        raise SpecError(f"not with --servers 2 (it runs its own configurations): {', '.join(clashes)}")
    return True


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        spec = spec_from(args)
        if cluster_run(args, spec):
            return cluster.execute(spec, cluster.select(args.configs))
        return execute(spec)
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ServerStartError as e:
        where = f"{args.out}/run-*/<system>-r<repeat>.log"
        print(f"error: a server did not start: {str(e).splitlines()[0]} (its log: {where})", file=sys.stderr)
        return 1


def execute(spec: BenchSpec) -> int:
    model = run.resolve_model(spec.shape.model, spec.out_dir)
    spec = workloads.fit_host(spec, model)
    replays = run.trace_requests(spec, run.vocab_size(model))
    systems.check_hicache_holds(spec.systems, spec.shape, model, run.history_tokens(spec, replays))
    if spec.agents is not None:
        agents.check_leaves_memory(spec.agents, spec.systems, spec.shape, model)
    spec = replace(spec, shape=disk_speed.measured_shape(spec.shape, spec.systems, spec.out_dir))
    systems.check_runnable(spec.systems, spec.shape, model, spec.out_dir)
    out = (spec.out_dir / time.strftime("run-%Y%m%d-%H%M%S")).resolve()  # servers get absolute paths
    out.mkdir(parents=True, exist_ok=True)
    print(f"workload {spec.workload}: {json.dumps(workloads.described(spec))}; pool {spec.shape.pool_tokens} "
          f"tokens, host budget {spec.shape.host_budget_mb} MiB", file=sys.stderr)  # fmt: skip
    order = run.schedule(spec.systems, spec.repeats) if spec.multiturn or replays or spec.agents else []
    runs: dict[str, list[run.SystemOutcome]] = {}
    for repeat, name in order:  # each system's list is in repeat order
        runs.setdefault(name, []).append(run.run_system(name, spec, model, out, replays, repeat))
    measured = run.measured(runs, systems.kv_bytes_per_token(model))
    figures = aggregate.medians(measured)
    extra: dict[str, Any] = _extra(spec, runs)
    failures = gate.check(spec.gate, figures) if spec.gate else []
    if spec.soak is not None:
        s = soak.run(spec, spec.soak, model, out, run.vocab_size(model))
        extra.update(s.figures())
        failures += s.failures(spec.soak)
    if spec.gate or spec.soak:
        extra["gate"] = "fail" if failures else "pass"
        extra["gate_failures"] = failures
    extra.update(report.versus_best_keys(aggregate.versus_best(measured), measured))
    extra["figures"] = report.per_system(figures)
    line = report.final_line(figures, {w: ratios(f) for w, f in figures.items()}, extra)
    report.write(out, run.results(runs), figures, line, run.metrics(runs), measured)
    for f in failures:
        print(f"gate: {f}", file=sys.stderr)
    print(json.dumps(line, sort_keys=True), flush=True)
    return 1 if failures else 0


def _extra(spec: BenchSpec, runs: dict[str, list[run.SystemOutcome]]) -> dict[str, Any]:
    methods = sorted({m for os_ in runs.values() for o in os_ for m in o.page_cache})
    return {
        "out_dir": str(spec.out_dir),
        "model": spec.shape.model,
        "workload": {"name": spec.workload, **workloads.described(spec)},
        "repeats": spec.repeats,
        "order": [f"{name}/r{r}" for r, name in run.schedule(spec.systems, spec.repeats)] if runs else [],
        "shape": asdict(spec.shape),
        "page_cache": ",".join(methods) if methods else "kept",
        "rss_peak_mb": {n: max(o.rss_peak_mb for o in os_) for n, os_ in runs.items()},
        "tier_mb": {n: max(o.tier_bytes for o in os_) / 2**20 for n, os_ in runs.items()},
        "peer_configs": {n: HICACHE[n].label for n in runs if n in HICACHE}
        | {n: LMCACHE[n].label for n in runs if n in LMCACHE},
    }
