"""Tickets and completions: issued on submit, posted by I/O threads, drained by the caller."""

from __future__ import annotations

import itertools
import threading
from dataclasses import replace

from sgl_hicache.tier.base import Completion, Ticket


class CompletionQueue:
    """Thread-safe. `post` never blocks on I/O; `wait` blocks until its ticket is posted."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._tickets = itertools.count(1)
        self._pending: set[Ticket] = set()
        self._done: dict[Ticket, Completion] = {}
        self._followers: dict[Ticket, list[Ticket]] = {}

    def issue(self) -> Ticket:
        with self._cond:
            ticket = Ticket(next(self._tickets))
            self._pending.add(ticket)
            return ticket

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
