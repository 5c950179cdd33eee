"""Who holds host staging: the blocks in use, split by what holds them (`StagingHolder`), read off
the controller's own state (its writes in flight, its reads and the restores in progress, its
blocks retiring), never kept beside it: the split is what `SpillController.check_integrity` checks
against the arena's accounting.

A read's holder is its purpose now: `restore` while a restore in progress needs it (its slots taken:
`Restores.needs`), else `prefetch` while no restore attempt has asked for it (`PendingRead.prefetched`),
else `restore_deferred` (a restore attempt found or started it and was deferred, or its request went
away: the read expires after `prefetch_ttl_s`); `abandoned` once given up while in flight.

`HeldTime` integrates the split over time for `/metrics` (`staging_held_byte_seconds_total{holder}`,
`staging_used_seconds_total{used}`), sampled when the controller's `poll` begins, before it takes the
tier's completions: staging comes back only at a poll, so between two polls (a forward, mostly) it
is held as the second poll finds it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

import torch

from sgl_hicache.cache.metrics import USED_BANDS, SpillMetrics, StagingHolder
from sgl_hicache.cache.reads import ExtentReads, PendingRead
from sgl_hicache.cache.restores import Restores
from sgl_hicache.cache.spill_state import Extent


def held(
    writes: Iterable[Extent], retiring: Iterable[torch.Tensor], reads: ExtentReads, restores: Restores
) -> dict[StagingHolder, int]:
    """Staging in use by holder: `writes` (extents packing or on their way to the tier), `retiring`
    (blocks waiting for their copies), every read holding a block (`ExtentReads.holding`)."""
    out = dict.fromkeys(StagingHolder, 0)
    out[StagingHolder.WRITE] = sum(e.staged.numel() for e in writes if e.staged is not None)
    out[StagingHolder.RETIRING] = sum(buf.numel() for buf in retiring)
    for read in reads.holding():
        out[read_holder(read, restores)] += read.buf.numel()
    return out


def read_holder(read: PendingRead, restores: Restores) -> StagingHolder:
    if not read.usable:
        return StagingHolder.ABANDONED
    if restores.needs(id(read.extent)):
        return StagingHolder.RESTORE
    return StagingHolder.PREFETCH if read.prefetched else StagingHolder.RESTORE_DEFERRED


def used_band(used: int, capacity: int) -> str:
    """The quarter of `capacity` that `used` bytes fall in (`USED_BANDS`; all of it in the last)."""
    return USED_BANDS[min(len(USED_BANDS) - 1, used * len(USED_BANDS) // max(capacity, 1))]


class HeldTime:
    """Integrates staging's holders over time into `metrics` (`SpillMetrics.add_staging_time`)."""

    def __init__(self, metrics: SpillMetrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self.clock = clock
        self._last = clock()

    def add(self, held: Mapping[StagingHolder, int], capacity: int) -> None:
        """Staging was held as `held` (of `capacity` bytes) since the last call."""
        now = self.clock()
        seconds, self._last = max(0.0, now - self._last), now
        self.metrics.add_staging_time(held, seconds, used_band(sum(held.values()), capacity))
