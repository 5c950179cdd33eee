"""Landed reads an eviction's spill takes back: staging goes to evicted KV before reads that the tier
can serve again.

An eviction's spill that finds no block of staging drops its victim (`Refused.STAGING_FULL`): that
KV is gone, and its conversation recomputes it when it resumes. Staging is often held then by reads
that landed for requests still queued (a prefetch at arrival or a hint, a restore deferred), whose
bytes are on the tier: given back, such a read costs a second read when its restore comes, not a
recompute. So before a spill is refused for room, landed reads are given back one at a time until
its block fits (`block`):
- only reads completed and verified (a read in flight is the tier's until its completion);
- never one a restore in progress needs (`Restores.needs`: its slots taken, or landing layer-wise),
  nor one of the restore taking its slots now (`keeping`: the eviction that makes room for a restore
  must not take its bytes away; it would recompute, `restores_overtaken`);
- prefetches no restore attempt asked for yet before the reads of deferred restores, and in each the
  latest started first (admission is first come first served: its request is the furthest from it);
- none at all when even all of them would not make room (nothing is given back for nothing).
Each read given back counts `reads_taken_back`; its extent's next restore reads it again
(`reads_on_demand`). Background stores (write-through, write-ahead) never take back: nothing is
lost without them. Off (`take_back_reads` false): spills are refused as before.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from sgl_hicache.cache.metrics import SpillMetrics
from sgl_hicache.cache.reads import ExtentReads, PendingRead
from sgl_hicache.cache.restores import Restores
from sgl_hicache.cache.spill_state import SpillRef
from sgl_hicache.cache.staging import StagingPool


class TakeBack:
    def __init__(self, reads: ExtentReads, restores: Restores, metrics: SpillMetrics) -> None:
        self.reads = reads
        self.restores = restores
        self.metrics = metrics
        self._kept: set[int] = set()  # extents (by identity) of the restores taking their slots now

    @contextmanager
    def keeping(self, refs: Sequence[SpillRef]) -> Iterator[None]:
        """While a restore of `refs` takes its slots (evicting for room): its reads are never taken back."""
        added = {id(ref.extent) for ref in refs} - self._kept
        self._kept |= added
        try:
            yield
        finally:
            self._kept -= added

    def candidates(self) -> list[PendingRead]:
        """The landed reads a spill may take back, in the order it takes them (the module doc)."""
        free = [
            r
            for r in self.reads.landed_reads()
            if id(r.extent) not in self._kept and not self.restores.needs(id(r.extent))
        ]
        return sorted(free, key=lambda r: (not r.prefetched, -r.started))

    def block(self, staging: StagingPool, nbytes: int) -> torch.Tensor | None:
        """A block of `nbytes` for an eviction's spill, taken back from landed reads (the module doc);
        None, having given back nothing, when all of them would not make room."""
        reads = self.candidates()
        used = staging.used_bytes - sum(r.buf.numel() for r in reads)
        blocks = staging.free_block_bytes + sum(staging.block_bytes(r.buf.numel()) for r in reads)
        if used + nbytes > staging.capacity_bytes or blocks < staging.block_bytes(nbytes):
            return None
        for read in reads:
            self.reads.finish_extent(id(read.extent))
            self.metrics.inc("reads_taken_back")
            self.metrics.inc("reads_taken_back_tokens", read.tokens)
            buf = staging.acquire(nbytes)
            if buf is not None:
                return buf
        return None
