"""Tickets and completions: issued on submit, posted by I/O threads, drained by the caller; and the
bookkeeping every backend keeps beside them (`Returned`: the loads whose completion the caller has
not taken yet, which `Tier.landed` asks)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Generic, TypeVar

from sgl_hicache.tier.base import Completion, Ticket


class CompletionQueue:
    """Thread-safe. `post` never blocks on I/O; `wait` blocks until its ticket is posted."""

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

    def post(self, c: Completion) -> None:
        with self._cond:
            for t in [c.ticket, *self._followers.pop(c.ticket, [])]:
                self._pending.discard(t)
                self._done[t] = replace(c, ticket=t)
            self._cond.notify_all()

    def drain(self) -> list[Completion]:
        with self._cond:
            done, self._done = list(self._done.values()), {}
        return done

    def wait(self, ticket: Ticket, timeout: float | None = None) -> Completion:
        with self._cond:
            if ticket not in self._pending and ticket not in self._done:
                raise KeyError(f"unknown or already returned ticket {ticket}")
            if not self._cond.wait_for(lambda: ticket in self._done, timeout):
                raise TimeoutError(f"ticket {ticket} still in flight after {timeout} s")
            return self._done.pop(ticket)


L = TypeVar("L")


class Returned(Generic[L]):
    """A backend's completions as the caller takes them (`Tier.get_finished`, `Tier.wait`), and its
    loads in flight (`loading`: ticket -> the backend's record of it, guarded by the backend's
    `lock`), each forgotten once its completion is returned; `landed` reads a record's verified
    prefix with `progress`."""

    def __init__(self, lock: threading.Lock, progress: Callable[[L], int]) -> None:
        self.queue = CompletionQueue()
        self.loading: dict[Ticket, L] = {}
        self._lock, self._progress = lock, progress

    def get_finished(self) -> list[Completion]:
        return self._returned(self.queue.drain())

    def wait(self, ticket: Ticket, timeout: float | None = None) -> Completion:
        return self._returned([self.queue.wait(ticket, timeout)])[0]

    def _returned(self, done: list[Completion]) -> list[Completion]:
        with self._lock:
            for c in done:
                self.loading.pop(c.ticket, None)
        return done

    def landed(self, ticket: Ticket) -> int:
        with self._lock:
            load = self.loading.get(ticket)
        return 0 if load is None else self._progress(load)
