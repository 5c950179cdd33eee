"""What of staging a store may take, and why a store is refused: one rule, asked by the controller's
`store` (`take`) and `background_fit` (controller.py), and the one place those refusals are counted
and logged.

- An eviction's spill may fill all of staging; a **background** store (a write-through or a
  write-ahead: nothing is lost without it) only `BACKGROUND_SHARE` of it, so eviction spills and
  reads always have the rest.
- **Room for a waiting restore** (`restore_reserve`, off by default: measured no better): while a restore waits for room
  to start a read (`ExtentReads.room_wanted_bytes`), no store may take the bytes that read needs:
  staging freed as earlier writes finish goes to the read, not to the next eviction. A spill that
  would take them is dropped unwritten (`RESERVED`, counted in `spills_refused_reserved`), but
  for one whose drop would lose more than its own tokens (`yields` False: a pinned conversation,
  spilled nodes below it, which the drop would take along); a background store is deferred
  (`writes_through_deferred`). Only a store its own limit would have taken counts there; one
  refused anyway counts as before. The room is counted as the read will take it: in bytes of the
  budget and in whole blocks of the arena (a 5 KiB store holds an 8 KiB block), though not where
  they lie (fragmented, the read waits until a block beside its room comes back).
- **Landed reads yield to evicted KV** (`take_back_reads`, on by default): an eviction's spill that
  finds no room takes it back from prefetched reads that landed for queued requests before it is refused
  (take_back.py: the tier serves those again; a dropped victim is recomputed).
- A refusal is `Refused`: momentary (writes in flight hold staging, or room is kept for a read) or
  for good (a node larger than all of staging, or than the background share). The lasting ones are
  logged once with the flag to raise; every one is counted.
Staging is passed in at each call (tests swap the controller's arena for a smaller one).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable

import torch
from sgl_hicache_kernels import KVPoolView, packed_nbytes

from sgl_hicache.cache.metrics import SpillMetrics
from sgl_hicache.cache.staging import StagingPool

logger = logging.getLogger(__name__)

BACKGROUND_SHARE = 0.5
"""The part of staging that background stores (write-through) may fill: the rest is kept for
eviction spills (else a dropped node) and reads (else a recompute), which share it."""


class Refused(enum.Enum):
    """Why `SpillController.store` did not take a node (see controller.py's module doc)."""

    STAGING_FULL = "staging_full"  # momentarily: writes in flight hold staging
    RESERVED = "reserved"  # momentarily: it would take the room a restore's read waits for
    TOO_LARGE = "too_large"  # never: larger than all of staging
    DEFERRED = "deferred"  # a write-through: its share of staging is full now, or kept for a read
    TOO_LARGE_FOR_SHARE = "too_large_for_share"  # a write-through: larger than its share


class StagingShare:
    def __init__(
        self,
        view: KVPoolView,
        metrics: SpillMetrics,
        wanted: Callable[[], int] | None = None,
        take_back: Callable[[StagingPool, int], torch.Tensor | None] | None = None,
    ) -> None:
        """`wanted`: the bytes of the read a restore waits to start for room (0: none waits), kept
        from stores; None: none kept (`restore_reserve` off). `take_back`: a block of staging for an
        eviction's spill that found none, given back by landed reads (`TakeBack.block`); None:
        such a spill is refused (`take_back_reads` off)."""
        self.view = view
        self.metrics = metrics
        self.wanted = wanted
        self.take_back = take_back
        self._logged: set[str] = set()  # counters whose warning was logged (`_count_once`)

    @staticmethod
    def background_limit(staging: StagingPool) -> int:
        """The bytes of staging background stores (write-through, write-ahead) may hold at once."""
        return int(staging.capacity_bytes * BACKGROUND_SHARE)

    def reserved(self, staging: StagingPool) -> int:
        """The bytes of staging no store may take now: those a waiting restore's read needs."""
        return 0 if self.wanted is None else min(self.wanted(), staging.capacity_bytes)

    def background_fit(self, staging: StagingPool, tokens: int) -> Refused | None:
        """Whether a background store of `tokens` tokens would find its share of staging now (None),
        or DEFERRED (not now: writes in flight hold it, or a waiting read's room is in it) or
        TOO_LARGE_FOR_SHARE (never); counts nothing (`take` counts a store's refusals)."""
        nbytes, limit = packed_nbytes(self.view, tokens), self.background_limit(staging)
        if nbytes > min(limit, staging.largest_bytes):  # never: its share, or the longest run left
            return Refused.TOO_LARGE_FOR_SHARE
        if staging.used_bytes + nbytes > limit or not self._leaves_room(staging, nbytes):
            return Refused.DEFERRED
        return None

    def take(
        self, staging: StagingPool, tokens: int, background: bool = False, yields: bool = True
    ) -> torch.Tensor | Refused:
        """A block of staging for the packed KV of `tokens` tokens, or why a store may not have one
        (counted; logged once if lasting): an eviction's spill may fill staging, a `background`
        store its share of it, and neither the room a waiting restore's read needs, unless it does
        not `yield` (a spill whose drop would lose more than its own tokens)."""
        nbytes = packed_nbytes(self.view, tokens)
        limit = self.background_limit(staging) if background else None
        if yields and self._takes_reserved(staging, nbytes, limit):
            self.metrics.inc("writes_through_deferred" if background else "spills_refused_reserved")
            return Refused.DEFERRED if background else Refused.RESERVED
        buf = staging.acquire(nbytes, limit)
        if buf is None and self._may_take_back(staging, nbytes, limit, yields):
            assert self.take_back is not None
            buf = self.take_back(staging, nbytes)
        return buf if buf is not None else self._refused(staging, tokens, nbytes, limit)

    def _may_take_back(self, staging: StagingPool, nbytes: int, limit: int | None, yields: bool) -> bool:
        """Whether a store refused room may have landed reads given back for it: an eviction's spill
        (not a `limit`ed background store) that fits staging; while a restore waits for room with
        `restore_reserve` on, only one that does not `yield` (the room given back is the read's
        first; a pinned conversation's or a node with spilled children's spill loses more dropped)."""
        return (
            self.take_back is not None
            and limit is None
            and nbytes <= staging.largest_bytes
            and (not yields or not self.reserved(staging))
        )

    def _takes_reserved(self, staging: StagingPool, nbytes: int, limit: int | None) -> bool:
        """Whether a store of `nbytes` within `limit` (None: all of staging) would fit it but take
        room kept for a waiting restore's read (one that does not fit is refused as before)."""
        own = staging.capacity_bytes if limit is None else limit
        return staging.used_bytes + nbytes <= own and not self._leaves_room(staging, nbytes)

    def _leaves_room(self, staging: StagingPool, nbytes: int) -> bool:
        """Whether a store of `nbytes` leaves the bytes kept for a waiting restore's read, counted
        as the read will take them: within the budget, and in whole blocks (a block is whole pages:
        a store of 5 KiB takes 8 KiB of the arena)."""
        kept = self.reserved(staging)
        if not kept:
            return True
        block = staging.block_bytes
        return (
            staging.used_bytes + nbytes <= staging.capacity_bytes - kept
            and block(nbytes) + block(kept) <= staging.free_block_bytes
        )

    def _refused(self, staging: StagingPool, tokens: int, nbytes: int, limit: int | None) -> Refused:
        """Why a store of `tokens` tokens (`nbytes` packed) found no block of staging within `limit`
        (None: all of it; else a background store's share); counted, and logged once if lasting."""
        if limit is not None and nbytes <= min(limit, staging.largest_bytes):
            self.metrics.inc("writes_through_deferred")
            return Refused.DEFERRED
        if limit is not None:
            self._count_once(
                "writes_through_too_large",
                "sgl_hicache: a node of %d tokens (%d B of KV) is never written through: write-through may "
                "fill %d B of staging; it is written when evicted instead, and the nodes below it on its "
                "path too (logged once; counted in writes_through_too_large): raise --hicache-spill-staging "
                "to at least %s",
                tokens, nbytes, limit, _size_flag(int(nbytes / BACKGROUND_SHARE) + 1),
            )  # fmt: skip
            return Refused.TOO_LARGE_FOR_SHARE
        if nbytes <= staging.largest_bytes:  # all of staging, less what was set aside (`spoil`)
            self.metrics.inc("spills_refused_staging_full")
            return Refused.STAGING_FULL
        self._count_once(
            "spills_refused_too_large",
            "sgl_hicache: a node of %d tokens (%d B of KV) can never spill: staging's largest block is %d B; "
            "it and any like it are dropped (logged once; counted in spills_refused_too_large): raise "
            "--hicache-spill-staging to at least %s",
            tokens, nbytes, staging.largest_bytes, _size_flag(nbytes),
        )  # fmt: skip
        return Refused.TOO_LARGE

    def _count_once(self, counter: str, warning: str, *args: object) -> None:
        """Count `counter`; log `warning` the first time only (a condition that will recur)."""
        self.metrics.inc(counter)
        if counter not in self._logged:
            self._logged.add(counter)
            logger.warning(warning, *args)

    def log_extent_bound(self, staging: StagingPool) -> None:
        """At start, once: the longest extent staging can hold. A node is written as one extent
        and restored by one read of it, so a longer node is dropped when evicted; a history of many
        extents streams through staging whatever its length. No config check can refuse a staging
        for this: no flag bounds a node's length (a whole prompt can be one node)."""
        page = self.view.page_size
        tokens = staging.capacity_bytes // packed_nbytes(self.view, page) * page
        logger.info("sgl_hicache: staging of %d B holds an extent of at most %d tokens (%d B of KV a "
                    "page of %d); longer nodes are dropped when evicted (spills_refused_too_large)",
                    staging.capacity_bytes, tokens, packed_nbytes(self.view, page), page)  # fmt: skip


def _size_flag(nbytes: int) -> str:
    """`nbytes` rounded up to whole MiB, as --hicache-spill-staging takes it (a bare number is GB)."""
    return f"{-(-nbytes // (1 << 20))}M"
