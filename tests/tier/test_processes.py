"""Crash safety (SIGKILL at random moments) and two processes sharing one directory."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sgl_hicache.tier import ROOT_KEY, Status
from tests.tier.common import key_for, payload_for, tokens_for
from tests.tier.writer_proc import size_of

ROOT = Path(__file__).resolve().parents[2]
CAPACITY = 1_500_000


def spawn(directory: Path, mode: str, first: int, count: int, capacity: int = CAPACITY) -> subprocess.Popen:
    args = [
        sys.executable,
        "-m",
        "tests.tier.writer_proc",
        str(directory),
        mode,
        str(first),
        str(count),
        str(capacity),
    ]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", proc.stderr.read()
    return proc


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def verify_all(tier, first: int, count: int) -> int:
    """Every indexed or loadable extent is byte-correct; returns how many were readable."""
    readable = 0
    for i in range(first, first + count):
        buf = bytearray(size_of(i))
        done = tier.wait(tier.submit_load(key_for(i), buf))
        assert done.status in (Status.OK, Status.MISS), done
        if done.ok:
            assert bytes(buf) == payload_for(i, size_of(i)).tobytes()
            readable += 1
    return readable


def test_sigkill_writer_then_reopen(make_tier, procs, tmp_path):
    directory, rng, readable = tmp_path / "tier", random.Random(1234), 0
    for trial in range(24):
        proc = spawn(directory, "store", trial * 1000, 400)
        procs.append(proc)
        time.sleep(rng.uniform(0.0, 0.25))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        tier = make_tier(directory=directory, capacity_bytes=CAPACITY)
        assert tier.stats().bytes_stored <= CAPACITY
        tier.check_integrity()  # no temp files left, index == files
        readable += verify_all(tier, trial * 1000, 400)
        tier.close()
    assert readable > 24  # the kills did land after some publishes


def test_two_processes_share_a_directory(make_tier, procs, tmp_path):
    directory = tmp_path / "tier"
    tier = make_tier(directory=directory, capacity_bytes=CAPACITY)
    writer = spawn(directory, "store", 0, 40, capacity=10 * CAPACITY)
    procs.append(writer)
    assert writer.stdout.readline().strip() == "done", writer.stderr.read()
    assert verify_all(tier, 0, 40) == 40  # written by the other process, not (yet) in our index
    reader = spawn(directory, "load", 0, 40)
    procs.append(reader)
    assert reader.stdout.readline().strip() == "done", reader.stderr.read()


def test_concurrent_writer_reader_and_evictor(make_tier, procs, tmp_path):
    """A reader racing a writer and an evicting opener sees only OK-and-correct or MISS."""
    directory = tmp_path / "tier"
    writer = spawn(directory, "store", 0, 300)
    reader = spawn(directory, "load", 0, 300)
    procs += [writer, reader]
    evictor = make_tier(directory=directory, capacity_bytes=CAPACITY // 3)
    for i in range(0, 300, 3):
        evictor.discard(key_for(i))
    for p in (writer, reader):
        assert p.stdout.readline().strip() == "done", p.stderr.read()


def test_evicted_by_other_process_is_a_clean_miss(make_tier, tmp_path):
    directory = tmp_path / "tier"
    a, b = make_tier(directory=directory), make_tier(directory=directory)
    assert a.wait(a.submit_store(key_for(1), payload_for(1, 5000), tokens_for(1), ROOT_KEY)).ok
    assert b.discard(key_for(1))
    done = a.wait(a.submit_load(key_for(1), bytearray(5000)))
    assert done.status is Status.MISS and not a.contains(key_for(1))
