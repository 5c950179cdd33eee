"""A server given `cpus` (bench/server_process.py) runs, with every process of its group, on those
CPUs from its start, with `OMP_NUM_THREADS` their count; no sglang here: stand-in children report
what they got."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

from benchmarks.bench.server_process import ServerProcess, check_cpus, spawn_group, stop_group
from tests.standin_server import standin_source

REPORT = "import os; print(sorted(os.sched_getaffinity(0)), os.environ.get('OMP_NUM_THREADS'), flush=True)"

STANDIN = standin_source(
    f"{REPORT}\nsubprocess.run([sys.executable, '-c', {REPORT!r}])  # a worker in our group, started after exec"
)

LAST = max(os.sched_getaffinity(0))  # a share of one CPU, not this process's whole set on 2+ CPUs


def report(log: Path) -> str:
    return log.read_text().strip()


Reporter = Callable[[Mapping[str, str] | None], str]


@pytest.fixture
def reporter(tmp_path: Path) -> Iterator[Reporter]:
    """Runs `REPORT` by `spawn_group` on CPU `LAST` with an env (None: this process's), returns its
    output; stops every group it started at teardown."""
    procs: list[subprocess.Popen[bytes]] = []

    def run(env: Mapping[str, str] | None) -> str:
        log = tmp_path / f"child-{len(procs)}.log"
        procs.append(spawn_group([sys.executable, "-c", REPORT], log, env, cpus=(LAST,)))
        assert procs[-1].wait(30) == 0
        return report(log)

    yield run
    for proc in procs:
        stop_group(proc, 1.0, 1.0)


def test_spawn_group_pins_the_child_and_sets_omp_threads(
    reporter: Reporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert reporter(None) == f"[{LAST}] 1"


def test_spawn_group_keeps_an_omp_thread_count_already_set(reporter: Reporter) -> None:
    assert reporter({**os.environ, "OMP_NUM_THREADS": "3"}) == f"[{LAST}] 3"


@pytest.fixture
def pinned_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServerProcess]:
    """A started stand-in server on CPU `LAST`, the driver's environment without OMP_NUM_THREADS."""
    (tmp_path / "standin_server.py").write_text(STANDIN)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    server = ServerProcess(Path("unused"), 1, module="standin_server", log_path=tmp_path / "server.log",
                           env={"PYTHONPATH": str(tmp_path)}, cpus=(LAST,))  # fmt: skip
    with server:
        yield server


def test_a_server_and_the_processes_it_starts_run_on_its_cpus(pinned_server: ServerProcess) -> None:
    assert pinned_server.log_path is not None
    assert report(pinned_server.log_path).splitlines() == [f"[{LAST}] 1"] * 2  # the server, its worker


@pytest.mark.parametrize(
    ("cpus", "message"),
    [((), "cannot pin a process to no CPUs"), ((LAST + 1,), f"CPUs [{LAST + 1}] are not among")],
)
def test_unusable_cpus_are_a_value_error(cpus: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        ServerProcess(Path("unused"), 1, cpus=cpus)
    with pytest.raises(ValueError, match=re.escape(message)):
        spawn_group([sys.executable, "-c", "pass"], None, cpus=cpus)


def test_check_cpus_sorts_and_deduplicates() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    assert check_cpus([*reversed(cpus), cpus[0]]) == tuple(cpus)
