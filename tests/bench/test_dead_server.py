"""A server that dies during a workload (a peer's scheduler raising, as sglang 0.5.23's LMCache path
does under device-pool pressure) costs that system its requests, counted as errors, not the run:
the benchmark records the workload without its `/metrics` and goes on with the other systems."""

from __future__ import annotations

import pytest

from benchmarks.bench import drive, run
from benchmarks.bench.client import Result
from benchmarks.bench.server_process import free_port


async def _failed(workload: str) -> drive.Driven:
    r = Result("a", workload, 1, True, prompt_tokens=10, error="ClientConnectorError: refused")
    return drive.Driven(workload, [r], 1.0)


def test_a_workload_on_a_dead_server_is_recorded_with_its_errors(capsys: pytest.CaptureFixture[str]) -> None:
    outcome = run.SystemOutcome()
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    run._record(outcome, gone, _failed("trace"))
    assert outcome.metrics == {"trace": {}}
    assert [r.error for r in outcome.results["trace"]] == ["ClientConnectorError: refused"]
    assert outcome.wall_s == {"trace": 1.0}
    assert capsys.readouterr().err.strip() == f"bench: {gone} does not answer after trace (its server died?)"
