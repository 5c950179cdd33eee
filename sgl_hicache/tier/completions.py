"""Tickets and completions: issued on submit, posted by I/O threads, drained by the caller; and the
bookkeeping every backend keeps beside them (`Returned`: the loads whose completion the caller has
not taken yet, which `Tier.landed` asks; `Returned.guard`: the jobs that end an operation, which end
it even when they raise; `Returned.dest_unsafe`: the loads whose destination a transfer may still
write, whatever ends them)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any, Generic, TypeVar

from sgl_hicache.tier.faults import Counters, FaultLog
from sgl_hicache.tier.keys import ExtentKey
from sgl_hicache.tier.results import Completion, Op, Status, Ticket


class CompletionQueue:
    """Thread-safe. `post` never blocks on I/O; `wait` blocks until its ticket is posted. A ticket
    has one completion: the first posted (a later post of the ticket is dropped)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._tickets = itertools.count(1)
        self._issued = 0
        self._pending: set[Ticket] = set()
        self._done: dict[Ticket, Completion] = {}
        self._followers: dict[Ticket, list[Ticket]] = {}

    def issue(self) -> Ticket:
        with self._cond:
            ticket = Ticket(next(self._tickets))
            self._issued = int(ticket)
            self._pending.add(ticket)
            return ticket

    @property
    def issued(self) -> int:
        """The last ticket issued (0: none yet); tickets are issued in increasing order."""
        with self._cond:
            return self._issued

    def follow(self, leader: Ticket, ticket: Ticket) -> None:
        """Complete `ticket` (pending) with `leader`'s outcome; call before `leader` is posted."""
        with self._cond:
            self._followers.setdefault(leader, []).append(ticket)

    def post(self, c: Completion, posting: Callable[[], None] | None = None) -> bool:
        """Complete `c.ticket` and its followers not completed yet with `c`; False (nothing done) if
        `c.ticket` was completed already. `posting` (counting it, say) runs only if it is posted,
        before any waiter can see it."""
        with self._cond:
            if c.ticket not in self._pending:
                return False
            if posting is not None:
                posting()
            for t in [c.ticket, *self._followers.pop(c.ticket, [])]:
                if t in self._pending:
                    self._pending.discard(t)
                    self._done[t] = replace(c, ticket=t)
            self._cond.notify_all()
            return True

    def drain(self) -> list[Completion]:
        with self._cond:
            done, self._done = list(self._done.values()), {}
        return done

    def wait_posted(self, timeout: float) -> bool:
        """Whether a completion is waiting to be drained, after waiting up to `timeout` for one."""
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._done), timeout)

    def wait(self, ticket: Ticket, timeout: float | None = None) -> Completion:
        with self._cond:
            if ticket not in self._pending and ticket not in self._done:
                raise KeyError(f"unknown or already returned ticket {ticket}")
            if not self._cond.wait_for(lambda: ticket in self._done, timeout):
                raise TimeoutError(f"ticket {ticket} still in flight after {timeout} s")
            return self._done.pop(ticket)


L = TypeVar("L")
Job = Callable[[], None]


class Returned(Generic[L]):
    """A backend's completions as the caller takes them (`Tier.get_finished`, `Tier.wait`), and its
    loads in flight (`loading`: ticket -> the backend's record of it, guarded by the backend's
    `lock`), each forgotten once its completion is returned; `landed` reads a record's verified
    prefix with `progress`. Faults `guard` catches are counted in `counters` and logged by `faults`
    (once per kind a minute, with the traceback), as failures on `where`. A load marked
    `dest_unsafe` is returned with `Completion.dest_unsafe` set, whoever posted it."""

    def __init__(self, lock: threading.Lock, progress: Callable[[L], int], counters: Counters,
                 faults: FaultLog, where: str) -> None:  # fmt: skip
        self.queue = CompletionQueue()
        self.loading: dict[Ticket, L] = {}
        self._unsafe: set[Ticket] = set()  # loads whose destination a transfer may still write
        self._lock, self._progress = lock, progress
        self._counters, self._faults, self._where = counters, faults, where

    def guard(self, ticket: Ticket, op: Op, key: ExtentKey, job: Job) -> Job:
        """`job`, an I/O job that ends operation `ticket` (posts its completion), made to end it even
        if it raises: then `ticket` completes IO_ERROR, counted in `io_errors` (and
        `store_failures` for a store), and the raise is logged. If `job` posted before raising, its
        completion stands and was counted by whoever posted it: the raise is logged only (one
        operation, one completion, one count). Every job that ends an operation runs so; a job that
        shares the operation with others (a load's pieces) must raise only where no other job of it
        still touches its buffer (its end)."""

        def run() -> None:
            try:
                job()
            except Exception as e:  # the binding raising, an OSError of a cleanup, a bug: never lost
                # logged and counted before a waiter can see the completion
                self._faults.unexpected(op, e, self._where)
                why = f"unexpected {type(e).__name__}: {e}"
                self.queue.post(
                    Completion(ticket, op, key, Status.IO_ERROR, 0, why), partial(self._failed, op)
                )

        return run

    def _failed(self, op: Op) -> None:
        self._counters.add("io_errors")
        if op is Op.STORE:
            self._counters.add("store_failures")

    def get_finished(self) -> list[Completion]:
        return self._returned(self.queue.drain())

    def wait(self, ticket: Ticket, timeout: float | None = None) -> Completion:
        return self._returned([self.queue.wait(ticket, timeout)])[0]

    def dest_unsafe(self, ticket: Ticket) -> None:
        """A transfer of load `ticket` that the store gave up on may still write its destination:
        its completion says so (`Completion.dest_unsafe`). Call before the load's end is posted."""
        with self._lock:
            self._unsafe.add(ticket)

    def _returned(self, done: list[Completion]) -> list[Completion]:
        with self._lock:
            for c in done:
                self.loading.pop(c.ticket, None)
            unsafe = {c.ticket for c in done if c.ticket in self._unsafe}
            self._unsafe -= unsafe
        return [replace(c, dest_unsafe=True) if c.ticket in unsafe else c for c in done]

    def landed(self, ticket: Ticket) -> int:
        with self._lock:
            load = self.loading.get(ticket)
        return 0 if load is None else self._progress(load)


class ReturnedCompletions:
    """The completion half of `Tier`'s contract (see there), for a backend whose completions are a
    `Returned` (`_returned`); listed before the tier base class."""

    _returned: Returned[Any]

    def get_finished(self) -> list[Completion]:
        return self._returned.get_finished()

    def wait(self, ticket: Ticket, timeout: float | None = None) -> Completion:
        return self._returned.wait(ticket, timeout)

    def wait_posted(self, timeout: float) -> bool:
        return self._returned.queue.wait_posted(timeout)

    def landed(self, ticket: Ticket) -> int:
        return self._returned.landed(ticket)
