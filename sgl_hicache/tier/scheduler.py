"""A pool of I/O threads with two queues: loads before stores, stores never starved, one thread
always left to loads.

Why not one priority queue: strict priority would let a steady stream of loads starve stores
forever (the cache would then never free host memory). Here a worker takes a load when one is
queued, except that after `WRITE_EVERY` consecutive loads taken while a store was waiting it takes
the store: stores get at least 1/(WRITE_EVERY+1) of dispatches under load pressure.

Why stores never hold every thread: a store may wait on its thread for room (`ProcessBudget.make_room`,
up to ROOM_WAIT_S) or for a slow disk; if every thread held such a store, a restore's load would
queue behind them for that long. With `threads >= 2` at most `threads - 1` stores run at once, so a
load always finds a thread within one load's time. With one thread stores and loads take turns on
it; a store can then never wait for room (no other store holds bytes in flight), only for its write.

Reads run in the order of their `rank` (a tuple, compared as tuples: `()` first), first come first
served among equal ranks. Both tiers rank a load's jobs by (batch, layer group), so that the
extents of one restore are read layer group by layer group and restores one after another
(`FileTier.submit_load`, `mooncake/load.py`); unranked reads keep their arrival order. Ranks
order reads among themselves only: the stores' share above is counted the same.

Periodic jobs (`every`: the refresh of `Tier.shared`) run on the same threads, ahead of queued
jobs when due; an idle worker waits on the condition with a timeout until the next one is due,
so they need no thread of their own, and `close` stops them with the workers.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

WRITE_EVERY = 4
logger = logging.getLogger("sgl_hicache.tier")

Job = Callable[[], None]
Rank = tuple[int, ...]


@dataclass
class _Periodic:
    job: Job
    period_s: float
    due: float  # time.monotonic(); inf while it runs


class IoScheduler:
    def __init__(self, threads: int, name: str = "sgl-hicache-io") -> None:
        self._cond = threading.Condition()
        self._reads: list[tuple[Rank, int, Job]] = []  # a heap: rank, then arrival
        self._arrivals = itertools.count()
        self._writes: deque[Job] = deque()
        self._reads_since_write = 0
        self._closed = False
        self._active = 0
        self._writing = 0  # stores running now
        self.max_writers = max(1, threads - 1)
        self._periodic: list[_Periodic] = []
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def submit_read(self, job: Job, rank: Rank = ()) -> None:
        """Queue a read; it runs before every queued read of a higher `rank` (see the module doc)."""
        with self._cond:
            heapq.heappush(self._reads, (rank, next(self._arrivals), job))
            self._cond.notify_all()

    def submit_write(self, job: Job) -> None:
        with self._cond:
            self._writes.append(job)
            self._cond.notify_all()  # a thread that may not take a store must not swallow the wake-up

    def every(self, period_s: float, job: Job) -> None:
        """Run `job` on a worker now and then `period_s` after each run ends, ahead of queued jobs,
        one run at a time, until `close` (no run starts once it is called). For short jobs that
        never wait; one that raises is logged and runs again all the same."""
        with self._cond:
            self._periodic.append(_Periodic(job, period_s, time.monotonic()))
            self._cond.notify_all()

    def _next(self) -> tuple[Job, bool] | None:
        """The next job and whether it is a store; None when closed and drained."""
        with self._cond:
            while (due := self._due()) is None:
                if self._reads or self._write_allowed() or (self._closed and not self._active):
                    break
                self._cond.wait(self._until_due())
            if due is not None:
                self._active += 1
                return due, False
            if self._write_allowed() and (not self._reads or self._reads_since_write >= WRITE_EVERY):
                self._reads_since_write = 0
                self._active += 1
                self._writing += 1
                return self._writes.popleft(), True
            if self._reads:
                self._reads_since_write += 1 if self._writes else 0
                self._active += 1
                return heapq.heappop(self._reads)[2], False
            self._cond.notify_all()
            return None

    def _due(self) -> Job | None:
        """A periodic job whose time has come (marked running), if any and not closed."""
        now = time.monotonic()
        for p in () if self._closed else self._periodic:
            if p.due <= now:
                p.due = math.inf
                return partial(self._run_periodic, p)
        return None

    def _until_due(self) -> float | None:
        """Seconds until the next periodic job is due; None (wait for a notify) if none is."""
        due = min((p.due for p in self._periodic), default=math.inf)
        return None if self._closed or due == math.inf else max(0.0, due - time.monotonic())

    def _run_periodic(self, p: _Periodic) -> None:
        try:
            p.job()
        finally:
            with self._cond:
                p.due = time.monotonic() + p.period_s

    def _write_allowed(self) -> bool:
        return bool(self._writes) and self._writing < self.max_writers

    def _run(self) -> None:
        while (next_job := self._next()) is not None:
            job, is_write = next_job
            try:
                job()  # jobs report their own errors as completions
            except Exception:  # a bug in a job: keep its traceback, keep the thread
                logger.exception("spill tier I/O job raised")
            finally:
                with self._cond:
                    self._active -= 1
                    self._writing -= int(is_write)
                    self._cond.notify_all()

    def close(self) -> None:
        """Run every queued job (and the jobs they queue), then stop the threads."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()
