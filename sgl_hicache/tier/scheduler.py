"""A pool of I/O threads with two queues: loads before stores, stores never starved, one thread
always left to loads.

Why not one priority queue: strict priority would let a steady stream of loads starve stores
forever (the cache would then never free host memory). Here a worker takes a load when one is
queued, except that after `WRITE_EVERY` consecutive loads taken while a store was waiting it takes
the store: stores get at least 1/(WRITE_EVERY+1) of dispatches under load pressure.

Why stores never hold every thread: a store may wait on its thread for room (`Space.make_room`,
up to ROOM_WAIT_S) or for a slow disk; if every thread held such a store, a restore's load would
queue behind them for that long. With `threads >= 2` at most `threads - 1` stores run at once, so a
load always finds a thread within one load's time. With one thread stores and loads take turns on
it; a store can then never wait for room (no other store holds bytes in flight), only for its write.
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
        self._writing = 0  # stores running now
        self.max_writers = max(1, threads - 1)
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
            self._cond.notify_all()  # a thread that may not take a store must not swallow the wake-up

    def _next(self) -> tuple[Job, bool] | None:
        """The next job and whether it is a store; None when closed and drained."""
        with self._cond:
            while not (self._reads or self._write_allowed() or (self._closed and not self._active)):
                self._cond.wait()
            if self._write_allowed() and (not self._reads or self._reads_since_write >= WRITE_EVERY):
                self._reads_since_write = 0
                self._active += 1
                self._writing += 1
                return self._writes.popleft(), True
            if self._reads:
                self._reads_since_write += 1 if self._writes else 0
                self._active += 1
                return self._reads.popleft(), False
            self._cond.notify_all()
            return None

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
