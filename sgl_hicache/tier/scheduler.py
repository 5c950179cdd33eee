"""A pool of I/O threads with two queues: loads before stores, stores never starved.

Why not one priority queue: strict priority would let a steady stream of loads starve stores
forever (the cache would then never free host memory). Here a worker takes a load when one is
queued, except that after `WRITE_EVERY` consecutive loads taken while a store was waiting it takes
the store: stores get at least 1/(WRITE_EVERY+1) of dispatches under load pressure.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

WRITE_EVERY = 4
logger = logging.getLogger("sgl_hicache.tier")

Job = Callable[[], None]


class IoScheduler:
    def __init__(self, threads: int, name: str = "sgl-hicache-io") -> None:
        self._cond = threading.Condition()
        self._reads: deque[Job] = deque()
        self._writes: deque[Job] = deque()
        self._reads_since_write = 0
        self._closed = False
        self._active = 0
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def submit_read(self, job: Job) -> None:
        self._push(self._reads, job)

    def submit_write(self, job: Job) -> None:
        self._push(self._writes, job)

    def _push(self, queue: deque[Job], job: Job) -> None:
        with self._cond:
            queue.append(job)
            self._cond.notify()

    def _next(self) -> Job | None:
        with self._cond:
            while not (self._reads or self._writes or (self._closed and not self._active)):
                self._cond.wait()
            self._active += 1
            take_write = self._writes and (not self._reads or self._reads_since_write >= WRITE_EVERY)
            if take_write:
                self._reads_since_write = 0
                return self._writes.popleft()
            if self._reads:
                self._reads_since_write += 1 if self._writes else 0
                return self._reads.popleft()
            self._active -= 1
            self._cond.notify_all()
            return None

    def _run(self) -> None:
        while (job := self._next()) is not None:
            try:
                job()  # jobs report their own errors as completions
            except Exception:  # a bug in a job: keep its traceback, keep the thread
                logger.exception("spill tier I/O job raised")
            finally:
                with self._cond:
                    self._active -= 1
                    self._cond.notify_all()

    def close(self) -> None:
        """Run every queued job (and the jobs they queue), then stop the threads."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()
