"""Landed reads an eviction's spill, or a restore waiting for room, takes back: staging goes to evicted
KV and to restores before reads that the tier can serve again.

An eviction's spill that finds no block of staging drops its victim (`Refused.STAGING_FULL`): that
KV is gone, and its conversation recomputes it when it resumes. Staging is often held then by reads
that landed for requests still queued (a prefetch at arrival or a hint, a restore deferred), whose
bytes are on the tier: given back, such a read costs a second read when its restore comes, not a
recompute. So before a spill is refused for room, landed reads are given back one at a time until
its block fits (`block`):
- only reads completed and verified (a read in flight is the tier's until its completion);
- only prefetches (at arrival, or hinted) that no restore attempt has asked for yet: a read a
  restore found and was deferred for is the next round's admission (taking those back made the
  same restores wait and re-read again and again: 3x the reads on demand, more restores too late,
  docs/RESULTS.md);
- never one a restore in progress needs (`Restores.needs`: its slots taken, or landing layer-wise);
  the restore whose slots the eviction makes room for has asked for its reads just before
  (`ExtentReads.readiness`), so none of them is a prefetch any more (else it would be overtaken and
  recompute: tests/cache/test_take_back.py);
- the latest started first (admission is first come first served: its request is the furthest
  from it);
- only those whose blocks make the free block the spill takes (the room they leave beside each
  other and the free space, not in pieces), none whose block an unpack still reads, and none at
  all when even all of them would not make room (nothing is given back for nothing).
Each read given back counts `reads_taken_back`; its extent's next restore reads it again
(`reads_on_demand`). Background stores (write-through, write-ahead) never take back: nothing is
lost without them. Off (`take_back_reads` false): spills are refused as before.

A restore whose read waits for room in staging takes back the same way (`for_restore`, asked by
the controller's `readiness`; `restores_take_back`, off by default): by the same rule (`room`), for
that read's bytes, never the reads of its own extents; then its reads are asked for again. Else
the room it waits for stays with reads of requests further back in the queue until they are used,
or `prefetch_ttl_s` or an eviction's spill takes them back. A restore that yields to a waiting one
(room_waits.py) waits for no read, so it takes back nothing. Counted in `reads_taken_back` and,
apart, `reads_taken_back_for_restores`.

Whatever the key, a waiting restore first gives back its own read of the extent it waits for when
that read is shorter than it needs, no restore uses it (`serve`: one for a shorter prefix of the
same history, deferred for it or having started it, until it is done with it) and no other restore
in progress needs it (`_short`): the longer read replaces it, and where staging cannot hold both it could never start
beside it (the restore waited until too late, every time; tests/cache/test_restore_order.py).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from sgl_hicache.cache.metrics import SpillMetrics
from sgl_hicache.cache.reads import ExtentReads, PendingRead, needs
from sgl_hicache.cache.restores import RestoreProgress, Restores
from sgl_hicache.cache.retiring import Retiring
from sgl_hicache.cache.spill_state import Extent, SpillRef
from sgl_hicache.cache.staging import StagingPool


class TakeBack:
    def __init__(self, reads: ExtentReads, restores: Restores, retiring: Retiring, metrics: SpillMetrics,
                 for_restores: bool = False) -> None:  # fmt: skip
        """`for_restores`: a restore waiting for room takes back too (`restores_take_back`)."""
        self.reads = reads
        self.restores = restores
        self.retiring = retiring
        self.metrics = metrics
        self.for_restores = for_restores

    def candidates(self) -> list[PendingRead]:
        """The landed reads a spill may take back, in the order it takes them (the module doc)."""
        free = [
            r for r in self.reads.landed_reads() if r.prefetched and not self.restores.needs(id(r.extent))
        ]
        return sorted(free, key=lambda r: -r.started)

    def block(self, staging: StagingPool, nbytes: int) -> torch.Tensor | None:
        """A block of `nbytes` for an eviction's spill, taken back from landed reads (`room`); None,
        having given back nothing, when they would not make room."""
        return staging.acquire(nbytes) if self.room(staging, nbytes) is not None else None

    def for_restore(
        self,
        refs: Sequence[SpillRef],
        staging: StagingPool,
        progress: RestoreProgress | None = None,
        done: Collection[int] = (),
    ) -> bool:
        """Room for a restore of `refs` (`progress`: its own in the table, if any) whose read waits
        for it (`ExtentReads.waits`): its own read of that extent if shorter than it needs, which
        it gives back (the longer read replaces it; no other restore in progress needs it), else,
        with `for_restores`, landed reads of others taken back for that read's bytes (`room`),
        never its own extents'. `done`: extents it unpacked whole (another restore's wait on one of
        them is not its own). Whether any read was given back (its reads may start now)."""
        mine = needs(refs)
        waiting = self.reads.waits.first(e for e in mine if e not in done)
        if waiting is None:
            return False
        eid, nbytes = waiting
        if self._short(mine[eid], progress):
            return self.reads.finish_extent(eid, waits=True)
        taken = (self.room(staging, nbytes, exclude=mine) if self.for_restores else None) or 0
        self.metrics.inc("reads_taken_back_for_restores", taken)
        return taken > 0

    def serve(self, refs: Sequence[SpillRef], owner: object, done: Collection[int] = ()) -> None:
        """`owner`'s restore (None: none) uses the reads long enough for it, but of the extents in
        `done` (unpacked whole), until `unserve`: `_short` gives none of them back."""
        for eid, (extent, need) in needs(refs).items() if owner is not None else ():
            if eid not in done and (read := self.reads.read_of(extent)) is not None and read.tokens >= need:
                read.users.add(owner)

    def unserve(self, refs: Sequence[SpillRef], owner: object) -> None:
        """`owner`'s restore is done with the reads of `refs` (finished, gave up, unpacked them whole)."""
        for extent, _ in needs(refs).values():
            if (read := self.reads.read_of(extent)) is not None:
                read.users.discard(owner)

    def _short(self, wanted: tuple[Extent, int], progress: RestoreProgress | None) -> bool:
        """Whether the read of `wanted`'s extent holds fewer tokens than wanted, no restore uses it
        (`PendingRead.users`, `serve`: a shorter prefix of the same history, deferred for it or
        started it on demand) and no restore in progress but `progress` needs it: it would hold the room its
        replacement needs (with staging too small for both, for good: its restore then went too
        late, every time). A read another restore uses completes that restore, then is given back
        (given back at once, it was started again every round and neither completed)."""
        read = self.reads.read_of(wanted[0])
        return (
            read is not None
            and read.tokens < wanted[1]
            and not read.users
            and not self.restores.needs(id(wanted[0]), but=progress)
        )

    def room(self, staging: StagingPool, nbytes: int, exclude: Collection[int] = ()) -> int | None:
        """Give back landed reads (the module doc; not those of the extents in `exclude`, by
        identity) until `staging` has a free block of `nbytes`: only those whose blocks make it
        (`StagingPool.freed_for`), none whose block an unpack still reads. Returns how many were
        given back; None, having given back nothing, when they would not make room."""
        reads = [
            r for r in self.candidates()
            if r.buf.numel() and not self.retiring.busy(r.buf) and id(r.extent) not in exclude
        ]  # fmt: skip
        chosen = staging.freed_for(nbytes, [r.buf for r in reads])
        if chosen is None:
            return None
        for read in (reads[i] for i in chosen):
            self.reads.finish_extent(id(read.extent))
            self.metrics.inc("reads_taken_back")
            self.metrics.inc("reads_taken_back_tokens", read.tokens)
        return len(chosen)
