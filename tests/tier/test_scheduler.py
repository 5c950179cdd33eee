"""Loads go first, stores are never starved, close drains follow-up jobs; periodic jobs stop at close."""

from __future__ import annotations

import itertools
import threading
import time

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


def test_a_periodic_job_runs_until_close_and_stops_with_the_threads():
    io = IoScheduler(threads=2, name="periodic-test")
    runs: list[float] = []
    io.every(0.02, lambda: runs.append(time.monotonic()))
    deadline = time.monotonic() + 10
    while len(runs) < 5:
        assert time.monotonic() < deadline, "the periodic job stopped running"
        time.sleep(0.005)
    io.close()
    after = len(runs)
    time.sleep(0.1)
    assert len(runs) == after, "ran after close"
    assert not [t for t in threading.enumerate() if t.name.startswith("periodic-test")]
    assert all(b - a >= 0.02 for a, b in itertools.pairwise(runs)), "runs closer than their period"


def test_a_due_periodic_job_goes_ahead_of_queued_jobs_and_survives_raising():
    io = IoScheduler(threads=1)
    gate, order = threading.Event(), []

    def tick() -> None:
        order.append("tick")
        raise RuntimeError("a bug in a periodic job: logged, and it runs again")

    io.submit_read(gate.wait)  # hold the only thread
    for i in range(3):
        io.submit_read(lambda i=i: order.append(f"r{i}"))
    io.every(3600, tick)  # due at once, then not for an hour
    gate.set()
    deadline = time.monotonic() + 10
    while len(order) < 4:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    io.close()
    assert order == ["tick", "r0", "r1", "r2"]

    again, ticks = IoScheduler(threads=1), []
    again.every(0.01, lambda: (ticks.append(1), 1 / 0))
    deadline = time.monotonic() + 10
    while len(ticks) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    again.close()


def test_reads_run_in_rank_order_first_come_first_served_among_equal_ranks():
    io = IoScheduler(threads=1)
    gate, order = threading.Event(), []
    io.submit_read(gate.wait)  # hold the only thread while we queue
    for name, rank in [("b0", (2, 0)), ("a1", (1, 1)), ("c", ()), ("a0", (1, 0)), ("b1", (2, 1)),
                       ("a0'", (1, 0)), ("c'", ())]:  # fmt: skip
        io.submit_read(lambda name=name: order.append(name), rank)
    gate.set()
    io.close()
    assert order == ["c", "c'", "a0", "a0'", "a1", "b0", "b1"]


def test_ranked_reads_still_leave_stores_their_share():
    io = IoScheduler(threads=1)
    gate, order = threading.Event(), []
    io.submit_read(gate.wait)
    io.submit_write(lambda: order.append("w"))
    for i in range(10):
        io.submit_read(lambda i=i: order.append(f"r{i}"), (10 - i, 0))
    gate.set()
    io.close()
    assert order.index("w") == WRITE_EVERY - 1, order
    assert [o for o in order if o != "w"] == [f"r{i}" for i in reversed(range(10))]
