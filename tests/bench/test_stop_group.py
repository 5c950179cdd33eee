"""`stop_group`: a leader that lingers after its children (sglang's launcher sleeps 5 s for crash
diagnostics once its scheduler ends on SIGTERM) is killed once it is alone with `leader_last`; a
leader that still has a live child, or a stop without `leader_last`, gets its graceful exit."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.bench.server_process import spawn_group, stop_group

# The leader starts multiprocessing's resource tracker (as sglang's does) and a child; both the
# leader and the child note each SIGTERM in `log`. The child ends on it after `child_s`; the leader
# ends on it only after `leader_s` (or, if `leader_s` is 0, at once: a graceful exit).
LEADER = """
import multiprocessing.resource_tracker as rt, os, signal, subprocess, sys, time
log, child_s, leader_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
rt.ensure_running()
def note(who):
    with open(log, "a") as f:
        f.write(who + "\\n")
child = subprocess.Popen([sys.executable, "-c", '''
import signal, sys, time
def end(*_):
    open(sys.argv[1], "a").write("child\\\\n"); time.sleep(float(sys.argv[2])); sys.exit(0)
signal.signal(signal.SIGTERM, end)
open(sys.argv[1], "a").write("child up\\\\n")
time.sleep(600)
''', log, str(child_s)])
def end(*_):
    note("leader")
    time.sleep(leader_s)
    note("leader done")
    sys.exit(0)
signal.signal(signal.SIGTERM, end)
note("leader up")
time.sleep(600)
"""


def start(tmp_path: Path, child_s: float, leader_s: float) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp_path / "log"
    proc = spawn_group([sys.executable, "-c", LEADER, str(log), str(child_s), str(leader_s)], None)
    deadline = time.monotonic() + 30
    while not (log.exists() and {"leader up", "child up"} <= set(log.read_text().split("\n"))):
        assert time.monotonic() < deadline, "the group never started"
        time.sleep(0.05)
    return proc, log


def test_a_leader_left_alone_is_killed_with_leader_last(tmp_path: Path) -> None:
    proc, log = start(tmp_path, child_s=0.0, leader_s=20.0)  # would end gracefully within the grace
    stop_group(proc, 30.0, 10.0, leader_last=True)
    assert proc.returncode == -signal.SIGKILL
    lines = log.read_text().split("\n")
    assert "child" in lines and "leader" in lines and "leader done" not in lines


def test_a_leader_waits_while_its_child_still_ends(tmp_path: Path) -> None:
    """The child takes 1 s to end on SIGTERM, the leader 0.5 s: the leader is alone only after."""
    proc, log = start(tmp_path, child_s=1.0, leader_s=0.5)
    stop_group(proc, 30.0, 10.0, leader_last=True)
    assert proc.returncode == 0
    assert "leader done" in log.read_text().split("\n")


def test_without_leader_last_the_leader_gets_its_grace(tmp_path: Path) -> None:
    proc, log = start(tmp_path, child_s=0.0, leader_s=2.0)
    stop_group(proc, 30.0, 10.0)
    assert proc.returncode == 0
    assert "leader done" in log.read_text().split("\n")
