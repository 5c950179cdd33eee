"""Loads go first, stores are never starved, close drains follow-up jobs."""

from __future__ import annotations

import threading

from sgl_hicache.tier.scheduler import WRITE_EVERY, IoScheduler


def test_reads_first_but_writes_not_starved():
    io = IoScheduler(threads=1)
    gate, order = threading.Event(), []
    io.submit_read(gate.wait)  # hold the only thread while we queue
    for i in range(3):
        io.submit_write(lambda i=i: order.append(f"w{i}"))
    for i in range(10):
        io.submit_read(lambda i=i: order.append(f"r{i}"))
    gate.set()
    io.close()
    reads_before_first_write = order.index("w0")
    assert reads_before_first_write == WRITE_EVERY - 1  # the gate job counted as the first read
    assert order[: WRITE_EVERY - 1] == [f"r{i}" for i in range(WRITE_EVERY - 1)]
    assert sorted(order) == sorted([f"w{i}" for i in range(3)] + [f"r{i}" for i in range(10)])
    assert order.index("w1") - order.index("w0") == WRITE_EVERY + 1


def test_close_runs_jobs_queued_by_jobs():
    io = IoScheduler(threads=2)
    done = []
    io.submit_read(lambda: io.submit_read(lambda: done.append(1)))
    io.close()
    assert done == [1]
