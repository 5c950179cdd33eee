"""A load in flight, its pieces read in any order: which are done, the first error, and the verified
byte prefix of its destination that `Tier.landed` reports. Both backends keep one per load (the
file tier reads a piece a job, the Mooncake tier a layer group a job)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from sgl_hicache.tier.codec import Plan, finish_plan
from sgl_hicache.tier.format import Header


class LoadProgress:
    """The pieces of `plan` (in destination order: layer group by layer group, so their leading run
    is a byte prefix of the destination) finish in any order; `done` records each once, the first
    error wins (`error`), and exactly one call, the one that records the last piece, returns True:
    its caller ends the load. `landed`: the bytes of the leading run of pieces that passed their
    check, at most `want`; a load that rearranges its bytes (`plan.convert`) lands nothing before
    `finish` (its verified bytes are not yet in the layout asked for); after `finish`, `want`."""

    def __init__(self, plan: Plan, want: int) -> None:
        self.plan, self.pieces, self.want = plan, plan.pieces, want
        self.remaining = len(plan.pieces)
        self.error: Exception | None = None
        self.lock = threading.Lock()
        self._verified = [False] * self.remaining
        self._prefix = 0
        self._finished = False

    def done(self, indices: Sequence[int], error: Exception | None) -> bool:
        """Record the outcome of pieces `indices` (verified if `error` is None); True for the call
        that records the last piece of the load."""
        with self.lock:
            self.error = self.error or error
            for i in indices:
                self._verified[i] = error is None
            while self._prefix < len(self._verified) and self._verified[self._prefix]:
                self._prefix += 1
            self.remaining -= len(indices)
            return self.remaining == 0

    def fail(self, error: Exception) -> None:
        """Record `error` as the load's (the first error wins) without recording any piece."""
        with self.lock:
            self.error = self.error or error

    def finish(self, header: Header, dest: memoryview) -> None:
        """Once every piece is verified: rearrange `dest` as planned (`codec.finish_plan`; raises
        ValueError as it does), then all `want` bytes have landed."""
        finish_plan(header, self.plan, dest, self.want)
        with self.lock:
            self._finished = True

    @property
    def landed(self) -> int:
        with self.lock:
            if self._finished:
                return self.want
            if self.plan.convert is not None or not self._prefix:
                return 0
            last = self.pieces[self._prefix - 1]
            return min(self.want, last.dest_off + last.need)
