"""A load keeps its latency while stores hold I/O threads waiting for room (issue 12)."""

from __future__ import annotations

import threading
import time

import pytest

import sgl_hicache.tier.file.publish as publish
from sgl_hicache.tier import ROOT_KEY
from sgl_hicache.tier.format import ALIGN
from tests.tier.common import key_for, payload_for, tokens_for

THREADS = 4


def wait_until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def file_bytes(n: int) -> int:
    return ALIGN + -(-n // ALIGN) * ALIGN


@pytest.fixture
def stall_writes(monkeypatch):
    """Call it to make every later extent write wait for the event it returns (a stalled disk);
    released at teardown."""
    gate = threading.Event()
    real = publish.write_extent

    def write(*args, **kw):
        gate.wait()
        return real(*args, **kw)

    def stall() -> threading.Event:
        monkeypatch.setattr(publish, "write_extent", write)
        return gate

    yield stall
    gate.set()


def test_load_completes_while_stores_wait_for_room(make_tier, stall_writes):
    unit = file_bytes(10_000)
    tier = make_tier(capacity_bytes=3 * unit, io_threads=THREADS)
    assert tier.wait(tier.submit_store(key_for(0), payload_for(0, 10_000), tokens_for(0), ROOT_KEY), 10).ok
    gate = stall_writes()
    entered = threading.Semaphore(0)
    make_room = tier._budget.make_room

    def counted(nbytes, key):
        entered.release()
        return make_room(nbytes, key)

    tier._budget.make_room = counted
    # Extent 1 reserves a unit and stalls in its write; 2..4 need the whole budget, which only the
    # end of 1 can give (0 alone is too small to evict for them): they wait in make_room.
    tier.submit_store(key_for(1), payload_for(1, 10_000), tokens_for(1), ROOT_KEY)
    wait_until(lambda: tier._budget.index.reserved > 0)  # 1 reserved first (else a big one could evict 0)
    big = 3 * unit - ALIGN
    for i in (2, 3, 4):
        tier.submit_store(key_for(i), payload_for(i, big), tokens_for(i), ROOT_KEY)
    for _ in range(THREADS - 1):  # the stores that may hold threads are all in, or waiting for room
        assert entered.acquire(timeout=10)
    entered.acquire(timeout=1)  # the fourth, if stores may take every thread (they must not)
    dest = bytearray(10_000)
    done = tier.wait(tier.submit_load(key_for(0), dest), timeout=10)
    assert done.ok and bytes(dest) == payload_for(0, 10_000).tobytes()
    gate.set()
