"""`--workload`: agents and the public Mooncake trace as the CLI builds them, the trace subset kept in
the repository with its licence, and one-line refusals (exit 2) of flags that cannot work."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from benchmarks.bench import cli, run, trace, workloads
from benchmarks.bench.agents import Agents
from benchmarks.bench.spec import Cut, SpecError, Trace
from benchmarks.bench.workloads import AGENTS_QUICK, MOONCAKE_FAST25, SATURATE

NOTICE = MOONCAKE_FAST25.parent / "NOTICE"


def spec(*argv: str) -> cli.BenchSpec:
    return cli.spec_from(cli.parser().parse_args(list(argv)))


def test_the_trace_subset_parses_and_carries_its_licence() -> None:
    assert MOONCAKE_FAST25.stat().st_size < 200_000
    records = trace.read(MOONCAKE_FAST25, 10**6)
    assert len(records) == 446 and all(
        a.timestamp_ms <= b.timestamp_ms for a, b in itertools.pairwise(records)
    )
    first: dict[int, float] = {}
    for r in records:
        first.setdefault(r.hash_ids[0], r.timestamp_ms)
    assert max(first.values()) < 60_000, "every kept conversation begins in the trace's first 60 s"
    notice = NOTICE.read_text()
    for where in ("https://github.com/kvcache-ai/Mooncake", "FAST25-release/traces/synthetic_trace.jsonl",
                  "3b5a594133958449a1feaf1c9e0fc1b553e34a28", "Apache License 2.0", "LICENSE-APACHE-2.0"):  # fmt: skip
        assert where in notice, where
    licence = (MOONCAKE_FAST25.parent / "LICENSE-APACHE-2.0").read_text()
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence


def test_whole_conversations_are_kept_in_the_order_they_begin() -> None:
    def rec(t: float, *ids: int) -> trace.TraceRecord:
        return trace.TraceRecord(t, 10, 1, ids)

    records = [rec(0, 1), rec(1, 2), rec(2, 1, 5), rec(3, 3), rec(4, 2, 6), rec(5, 2, 6, 7), rec(6, 1, 5, 8)]
    kept = trace.whole_conversations(records, limit=4)
    assert [r.timestamp_ms for r in kept] == [0, 2, 3, 6], "conversation 2 (3 turns) does not fit after 1 (3)"
    assert [r.timestamp_ms for r in trace.whole_conversations(records, 7)] == [0, 1, 2, 3, 4, 5, 6]
    with pytest.raises(SpecError, match="no conversation of the trace has at most 0 requests"):
        trace.whole_conversations(records, 0)


def test_mooncake_trace_is_replayed_arrival_bound_then_saturated() -> None:
    s = spec("--workload", "mooncake-trace")
    arrival, saturated = s.traces
    assert s.workload == "mooncake-trace" and not s.multiturn and s.agents is None
    assert (arrival.name, saturated.name) == ("mooncake_arrival", "mooncake_saturated")
    assert arrival.path == saturated.path == MOONCAKE_FAST25 and arrival.cut is Cut.CONVERSATIONS
    assert saturated.time_scale == arrival.time_scale / SATURATE and arrival.salt != saturated.salt
    a, b = (trace.to_requests(trace.load(t), t, 1024) for t in (arrival, saturated))
    assert [len(r.input_ids) for r in a] == [len(r.input_ids) for r in b]
    assert a[0].input_ids != b[0].input_ids, "the two replays share no KV on one server"
    assert b[-1].at_s == pytest.approx(a[-1].at_s / SATURATE)
    assert sum(r.resumed for r in a) >= len(a) / 3, "whole conversations: their later turns come back"
    longest = trace.longest(trace.load(arrival), arrival)
    assert s.shape.pool_tokens >= 1.25 * longest and s.shape.pool_tokens % s.shape.page_size == 0
    quick = spec("--workload", "mooncake-trace", "--quick", "--trace-requests", "30")
    assert [t.requests for t in quick.traces] == [30, 30] and quick.repeats == 1
    assert spec("--workload", "mooncake-trace", "--quick").traces[0].requests == 40
    assert spec().traces == (Trace(),), "chat keeps its synthesized trace"


def test_agents_come_with_a_pool_for_one_long_context_and_a_host_budget_as_large(model: Path) -> None:
    s = spec("--workload", "agents")
    assert s.agents == Agents() and not s.multiturn and not s.traces
    assert s.shape.pool_tokens == Agents().pool_tokens(16) and s.host_budget_fits_pool
    fitted = workloads.fit_host(s, model)
    assert fitted.shape.host_budget_mb == math.ceil(s.shape.pool_tokens * 23040 / 2**20)
    assert workloads.fit_host(fitted, model) == fitted
    assert run.history_tokens(s, []) == max(max(Agents().plan(i)) for i in range(Agents().count))
    quick = spec("--workload", "agents", "--quick", "--agents", "6")
    assert quick.agents == Agents(count=6, think_s=AGENTS_QUICK.think_s, token_scale=AGENTS_QUICK.token_scale)
    given = spec("--workload", "agents", "--tool-tokens", "512,2048", "--max-context", "16384", "--think-s", "0",
                 "--token-scale", "0.25", "--pool-tokens", "9000", "--host-budget-mb", "7")  # fmt: skip
    assert given.agents is not None and given.agents.tool_tokens == (512, 2048) and given.agents.think_s == 0
    assert (given.shape.pool_tokens, given.shape.host_budget_mb, given.host_budget_fits_pool) == (
        9000,
        7,
        False,
    )
    shape = json.loads(json.dumps(workloads.described(s)))["agents"]
    assert shape["token_scale"] == 1 / 16 and shape["scaled_max_context"] == 2048


@pytest.mark.parametrize(
    "args, message",
    [
        (["--workload", "agents", "--agents", "1"], "--agents must be >= 2"),
        (["--workload", "agents", "--tool-tokens", "8,x"], "--tool-tokens takes MIN,MAX (two integers), got '8,x'"),
        (["--workload", "agents", "--tool-tokens", "9000,100"], "tool tokens must be 1 <= min <= max"),
        (["--workload", "agents", "--max-context", "4096"], "leaves no second turn"),
        (["--workload", "agents", "--think-s", "-1"], "think time must be >= 0"),
        (["--agents", "4"], "not with --workload chat: --agents"),
        (["--workload", "agents", "--concurrency", "4", "--trace-requests", "3"],
         "not with --workload agents: --concurrency, --trace-requests"),
        (["--workload", "mooncake-trace", "--think-s", "1", "--no-trace"],
         "not with --workload mooncake-trace: --think-s, --no-trace"),
        (["--workload", "agents", "--servers", "2"], "--servers 2 runs the chat workload's conversations"),
        (["--workload", "agents", "--systems", "ours", "--host-budget-mb", "100000"],
         "resumed turns would find their context out of device and host memory"),
    ],
)  # fmt: skip
def test_bad_workload_flags_are_one_line_and_exit_2(
    args: list[str], message: str, model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert cli.main(["--model", str(model), "--out", str(out), *args]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], captured.err
    assert captured.out == "" and not list(out.glob("run-*")), "refused before anything ran"
