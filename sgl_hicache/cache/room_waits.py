"""The reads restores wait to start for room in staging, and the order restores take staging in.

A restore whose read finds no room in staging registers it here, by extent identity (`wait`;
counted once in `restore_staging_waits`), with the bytes it needs. The entry goes when the read
starts or its extent's read is given up (`end`: unpacked whole, its restore done, failed or given
up), at a flush (`clear`), or `ttl_s` after it began waiting (`expire`: no restore that still
waits can want it then; its restore gave up or went away). While any entry is here:
- prefetches start no read (`ExtentReads.prefetch`);
- with `in_order` (`restores_in_order`, a key), a restore none of whose extents waits starts no
  new read either (`yields`): the room staging gets back goes to the restores that began waiting
  first. It still takes the reads already under way or landed (one whose reads all started is
  unaffected), and it does not wait here itself (it would become a waiter, and the order would be
  lost). Restores that wait here start reads between them as before: whichever is tried first;
- with `restore_reserve`, no store takes the bytes of the largest waiting read (`wanted_bytes`,
  staging_share.py);
- a waiting restore takes back its own shorter read of that extent and, with `restores_take_back`,
  landed prefetches no restore asked for (`first`: its waiting read; take_back.py).
No deadlock: a waiting restore progresses as without the order (its reads land, it unpacks them
and gives them back; writes in flight finish), nobody waits for a restore that yields, and every
entry ends by the time its restore would have given up (`ttl_s`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from sgl_hicache.cache.metrics import SpillMetrics


class RoomWaits:
    def __init__(self, metrics: SpillMetrics, ttl_s: float, in_order: bool = False) -> None:
        self.metrics = metrics
        self.ttl_s = ttl_s
        self.in_order = in_order
        self._waiting: dict[int, tuple[float, int]] = {}  # by id(extent): (since when, bytes it needs)

    def wait(self, eid: int, nbytes: int) -> None:
        """A restore could not start extent `eid`'s read of `nbytes` for room."""
        if eid not in self._waiting:
            self.metrics.inc("restore_staging_waits")
        since = self._waiting.get(eid, (time.monotonic(), 0))[0]
        self._waiting[eid] = (since, nbytes)

    def end(self, eid: int) -> None:
        """Extent `eid`'s read started, or was given up: nobody waits for its room any more."""
        self._waiting.pop(eid, None)

    def clear(self) -> None:
        self._waiting.clear()

    def expire(self) -> None:
        """Entries older than `ttl_s` go: their restore gave up or went away (aborted, its chain
        dropped), so prefetches, other restores and stores may take the room."""
        now = time.monotonic()
        for eid in [e for e, (since, _) in self._waiting.items() if now - since > self.ttl_s]:
            del self._waiting[eid]

    @property
    def wanted(self) -> bool:
        """Whether a restore waits for room in staging to start a read."""
        return bool(self._waiting)

    @property
    def wanted_bytes(self) -> int:
        """The bytes of the largest waiting read (0: none waits)."""
        return max((nbytes for _, nbytes in self._waiting.values()), default=0)

    def yields(self, extents: Iterable[int]) -> bool:
        """Whether a restore of `extents` (by identity) must start no new read: another restore
        waits for room and none of these does (`in_order`)."""
        return self.in_order and bool(self._waiting) and self._waiting.keys().isdisjoint(extents)

    def first(self, extents: Iterable[int]) -> tuple[int, int] | None:
        """The first of `extents` (by identity) whose read waits for room, and the bytes it needs."""
        return next(((e, self._waiting[e][1]) for e in extents if e in self._waiting), None)
