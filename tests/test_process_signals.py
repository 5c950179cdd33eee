"""A driver killed by SIGTERM or interrupted by SIGINT stops the servers it started (issue 12).

The driver is a child Python process that starts a `ServerProcess` of a stand-in server (a tiny HTTP
server module that also starts a worker in its process group, as sglang starts its scheduler); no
sglang here. The test signals the driver and checks that the server's whole group is gone.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.bench.server_process import group_alive
from tests.standin_server import standin_source

REPO = Path(__file__).resolve().parents[1]

STANDIN = standin_source(
    'subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # a worker in our group'
)

DRIVER = """
import sys, time
from pathlib import Path
from benchmarks.bench.server_process import ServerProcess

server = ServerProcess(Path("unused"), 1, module="standin_server", env={"PYTHONPATH": sys.argv[1]})
server.start(timeout_s=60)
print(server.proc.pid, flush=True)
time.sleep(600)
"""


def wait_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while group_alive(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.fixture
def driver(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """(the driver process, the process group of the server it started), all killed at teardown."""
    (tmp_path / "standin_server.py").write_text(STANDIN)
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    pgid = 0
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the driver did not start its server within 60 s"
        pgid = int(proc.stdout.readline())
        yield proc, pgid
    finally:
        for group in (pgid, proc.pid):
            with contextlib.suppress(ProcessLookupError):
                if group:
                    os.killpg(group, signal.SIGKILL)
        proc.wait(10)


@pytest.mark.parametrize(
    "signum, exit_codes",
    [(signal.SIGTERM, {128 + signal.SIGTERM}), (signal.SIGINT, {-signal.SIGINT, 128 + signal.SIGINT, 1})],
    ids=["SIGTERM", "SIGINT"],
)
def test_a_signalled_driver_stops_its_servers(
    driver: tuple[subprocess.Popen[str], int], signum: int, exit_codes: set[int]
) -> None:
    proc, pgid = driver
    assert group_alive(pgid)
    proc.send_signal(signum)
    assert proc.wait(30) in exit_codes
    assert wait_gone(pgid, 10), "the server's process group outlived its driver"
