"""The bytes a system writes to disk: /proc/<pid>/io write_bytes over its process trees, between a
workload's start and end (`bench/disk_writes.py`)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.bench.disk_writes import WriteMeter, tree, write_bytes

pytestmark = pytest.mark.skipif(write_bytes(os.getpid()) is None, reason="no /proc/<pid>/io here")

MiB = 2**20
# A process that starts a child and waits for it; the child waits for `go`, writes `size` bytes into
# `out` (buffered or O_DIRECT, synced), says `done` and waits for `stop`.
WRITER = """
import mmap, os, subprocess, sys, time
d, size, direct, role = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
def wait(name):
    while not os.path.exists(os.path.join(d, name)):
        time.sleep(0.01)
if role == "parent":
    subprocess.run([sys.executable, "-c", sys.argv[5], d, str(size), sys.argv[3], "child", sys.argv[5]])
    sys.exit(0)
open(os.path.join(d, "ready"), "w").close()
wait("go")
flags = os.O_WRONLY | os.O_CREAT | (os.O_DIRECT if direct else 0)
fd = os.open(os.path.join(d, "out"), flags)
buf = mmap.mmap(-1, size)
buf.write(b"x" * size)
os.write(fd, buf)
os.fsync(fd)
os.close(fd)
open(os.path.join(d, "done"), "w").close()
wait("stop")
"""


def _wait_for(path: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never came"
        time.sleep(0.01)


@pytest.fixture
def writer_tree(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A parent process whose child writes 4 MiB into `tmp_path` (on disk, not tmpfs) once told to."""
    direct = "1" if request.param else "0"
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path), str(4 * MiB), direct, "parent", WRITER]
    )
    try:
        _wait_for(tmp_path / "ready")
        yield proc, tmp_path
    finally:
        (tmp_path / "stop").touch()
        proc.wait(timeout=60)


@pytest.mark.parametrize("writer_tree", [False, True], ids=["buffered", "o_direct"], indirect=True)
def test_a_write_below_the_root_is_counted_once(writer_tree: tuple[subprocess.Popen[bytes], Path]) -> None:
    proc, d = writer_tree
    assert len(tree(proc.pid)) == 2, "the parent and the child that writes"
    meter = WriteMeter(lambda: (proc.pid, proc.pid))  # a root named twice (a daemon in the tree) counts once
    meter.start()
    (d / "go").touch()
    _wait_for(d / "done")
    written = meter.stop()
    assert 4 * MiB <= written < 5 * MiB


def test_a_root_that_cannot_be_read_makes_the_figure_nan() -> None:
    counts = {1: 100, 2: 50, 3: None, 4: 7}
    below = {1: [1, 2], 3: [3], 4: [4, 5]}
    meter = WriteMeter(lambda: (1, 4), read=counts.get, below=below.__getitem__)
    assert meter.total() == 157.0, "5 is gone by the time it is read: left out (its counts fold into 4's)"
    assert math.isnan(WriteMeter(lambda: (1, 3), read=counts.get, below=below.__getitem__).total())
    assert math.isnan(WriteMeter(lambda: (), read=counts.get, below=below.__getitem__).total()), "no root"
    gone = WriteMeter(lambda: (9,), read=counts.get, below=lambda pid: [])
    gone.start()
    assert math.isnan(gone.stop())
