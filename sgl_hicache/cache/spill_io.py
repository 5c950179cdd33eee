"""Moving KV between the device pool and the tier: pack → store on spill, load → unpack on restore.

`SpillIO` knows nothing of the radix tree: it turns slot lists into extents and back. Contract:
- `store` never blocks on I/O: it packs into staging (bounded), submits the write and returns the
  new `Extent` (WRITING); None when staging cannot hold it (the caller drops the node), counted as
  `spills_refused_staging_full` (momentarily: writes in flight hold it) or
  `spills_refused_too_large` (never: larger than all of staging; logged once with the flag to raise).
  A `background` store (a write-through: nothing is lost without it) may fill staging only up to
  `BACKGROUND_SHARE` of it, so eviction spills and reads (restores, prefetches) always have the rest
  between them; refused, it is counted as `writes_through_deferred` (momentarily: the next insert on
  its path tries again) or `writes_through_too_large` (never: larger than the share; logged once).
  The caller may free the slots as soon as `store` returns: the pack has completed.
- `poll` (never blocks) moves finished writes to ON_TIER / LOST and frees their staging, and hands
  finished loads to `reads` (`ExtentReads`: prefetch, coalescing, readiness; see reads.py).
- `unpack_landed` (never blocks) unpacks the verified prefix of a restore's reads into its slots
  while later chunks are still being read; those slots serve nothing until `restore` succeeds.
- `restore` is all or nothing: it fills every requested slot, or returns False (the caller frees the
  slots and recomputes). Any tier failure marks the extent LOST; nothing read is used unverified.
  It never blocks: it uses only reads that completed (the caller's readiness check waited for them
  by deferring admission) and extents still WRITING from staging; anything no longer at hand
  (released by the eviction that made room for the restore) makes it return False.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from sgl_hicache.cache.metrics import SpillMetrics
from sgl_hicache.cache.partial_restore import RestoreProgress
from sgl_hicache.cache.reads import ExtentReads, needs
from sgl_hicache.cache.spill_state import Extent, ExtentState, SpillRef
from sgl_hicache.cache.staging import StagingPool
from sgl_hicache.kernels import KVPoolView, pack_kv, packed_nbytes, unpack_kv
from sgl_hicache.tier import Completion, ExtentKey, Ticket, Tier

logger = logging.getLogger(__name__)

BACKGROUND_SHARE = 0.5
"""The part of staging that background stores (write-through) may fill: the rest is kept for
eviction spills (else a dropped node) and reads (else a recompute), which share it."""


class SpillIO:
    def __init__(self, tier: Tier, view: KVPoolView, staging: StagingPool, metrics: SpillMetrics,
                 timeout_s: float, prefetch_ttl_s: float = 30.0) -> None:  # fmt: skip
        self.view = view
        self.staging = staging
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.reads = ExtentReads(tier, view, staging, metrics, prefetch_ttl_s)
        self._writing: dict[Ticket, Extent] = {}
        self._logged: set[str] = set()  # counters whose warning was logged (`_count_once`)

    @property
    def tier(self) -> Tier:
        return self.reads.tier

    @tier.setter
    def tier(self, tier: Tier) -> None:  # tests wrap the tier in a FaultyTier after writing
        self.reads.tier = tier

    def store(
        self, key: ExtentKey, parent: ExtentKey, tokens: np.ndarray, slots: torch.Tensor, store_tokens: bool,
        aliases: Sequence[tuple[int, bytes]] = (), background: bool = False,
    ) -> Extent | None:  # fmt: skip
        """`store_tokens`: whether the extent file may hold the token ids (the default tenant's only);
        `aliases`: the path keys inside it, so other servers find it (`Tier.submit_store`);
        `background`: a write-through, bounded by `BACKGROUND_SHARE` of staging."""
        nbytes = packed_nbytes(self.view, len(slots))
        limit = int(self.staging.capacity_bytes * BACKGROUND_SHARE) if background else None
        buf = self.staging.acquire(nbytes, limit)
        if buf is None:
            if limit is not None:
                self._deferred(len(slots), nbytes, limit)
            else:
                self._refused(len(slots), nbytes)
            return None
        try:
            self._pack(slots, buf)
            ticket = self.tier.submit_store(
                key, buf.numpy(), tokens, parent, store_tokens=store_tokens, aliases=aliases
            )
        except BaseException:  # nothing was queued (a submit raises before queueing): nobody holds it
            self.staging.release(buf)
            raise
        extent = Extent(key, len(slots), ExtentState.WRITING, staged=buf)
        self._writing[ticket] = extent
        self.metrics.inc("spilled_bytes", nbytes)
        return extent

    def _deferred(self, tokens: int, nbytes: int, limit: int) -> None:
        if nbytes <= limit:
            self.metrics.inc("writes_through_deferred")
            return
        self._count_once(
            "writes_through_too_large",
            "sgl_hicache: a node of %d tokens (%d B of KV) is never written through: write-through may "
            "fill %d B of staging; it is written when evicted instead, and the nodes below it on its "
            "path too (logged once; counted in writes_through_too_large): raise --hicache-spill-staging "
            "to at least %d B",
            tokens, nbytes, limit, int(nbytes / BACKGROUND_SHARE) + 1,
        )  # fmt: skip

    def _refused(self, tokens: int, nbytes: int) -> None:
        if nbytes <= self.staging.capacity_bytes:
            self.metrics.inc("spills_refused_staging_full")
            return
        self._count_once(
            "spills_refused_too_large",
            "sgl_hicache: a node of %d tokens (%d B of KV) can never spill: staging holds %d B in all; "
            "it and any like it are dropped (logged once; counted in spills_refused_too_large): raise "
            "--hicache-spill-staging to at least %d B",
            tokens, nbytes, self.staging.capacity_bytes, nbytes,
        )  # fmt: skip

    def _count_once(self, counter: str, warning: str, *args: object) -> None:
        """Count `counter`; log `warning` the first time only (a condition that will recur)."""
        self.metrics.inc(counter)
        if counter not in self._logged:
            self._logged.add(counter)
            logger.warning(warning, *args)

    def close(self, timeout_s: float) -> None:
        """Shutdown: close the tier, giving its writes at most `timeout_s` (then abandoned, their
        temp files removed; see `Tier.close`). Later stores complete REJECTED (their extents LOST)."""
        self.tier.close(timeout_s)

    def poll(self) -> None:
        """Take every finished tier operation. The tier hands each completion over once: one whose
        handling raises must not lose the ones after it (their writes would stay in flight, their
        staging held, for good), so all are handled and then the first exception is raised."""
        errors: list[Exception] = []
        for done in self.tier.get_finished():
            try:
                self._complete(done)
            except Exception as e:  # re-raised below, after the rest are handled
                errors.append(e)
        self.reads.expire()
        if errors:
            raise errors[0]

    def _complete(self, done: Completion) -> None:
        if self.reads.completed(done):
            return
        extent = self._writing.pop(done.ticket, None)
        if extent is None:
            return
        try:
            self._finish_write(extent, done.ok)
        except Exception:  # whatever it reached: the staging goes back and the extent is never read
            if extent.staged is not None:
                self.staging.release(extent.staged)
                extent.staged = None
            extent.state = ExtentState.LOST
            raise

    def _finish_write(self, extent: Extent, ok: bool) -> None:
        if extent.staged is not None:
            self.staging.release(extent.staged)
            extent.staged = None
        extent.state = ExtentState.ON_TIER if ok else ExtentState.LOST
        if not ok:
            self.metrics.inc("spill_failures")

    @property
    def writes_in_flight(self) -> int:
        return len(self._writing)

    def wait_writes(self, timeout_s: float = 30.0) -> None:
        """Block until every submitted write has finished (tests, shutdown); then `poll`."""
        for ticket in list(self._writing):
            extent = self._writing[ticket]
            try:
                done = self.tier.wait(ticket, timeout=timeout_s)
            except KeyError:  # already returned through get_finished by another caller
                continue
            del self._writing[ticket]
            self._finish_write(extent, done.ok)
        self.poll()

    def check_integrity(self, with_tier: bool = True) -> None:
        """Staging accounting, and the tier's own check when nothing is in flight (`with_tier`;
        off for a directory that other processes change, where index and files legitimately differ)."""
        staged = sum(e.staged.numel() for e in self._writing.values() if e.staged is not None)
        held = staged + self.reads.held_bytes
        assert self.staging.used_bytes == held, f"staging used {self.staging.used_bytes} != held {held}"
        if with_tier and not self._writing and not self.reads.in_flight:
            self.tier.check_integrity()

    def landed_tokens(self, refs: Sequence[SpillRef]) -> int:
        """Tokens of `refs` whose bytes are verified in host memory now (see `unpack_landed`)."""
        return sum(max(0, min(ref.count, self.reads.landed(ref.extent)[1] - ref.offset)) for ref in refs)

    def unpack_landed(self, progress: RestoreProgress) -> int:
        """Unpack into `progress`'s slots whatever of its refs is verified in host memory and not
        unpacked yet (a prefix of each ref, whole pages); returns the tokens unpacked now. Never
        blocks. The slots stay unserved until `restore(progress)` succeeds."""
        done = 0
        for i, (ref, slots) in enumerate(progress.parts()):
            buf, landed = self.reads.landed(ref.extent)
            upto = max(0, min(ref.count, landed - ref.offset))
            if buf is not None and upto > progress.unpacked[i]:
                self._unpack(ref, slots, buf, progress.unpacked[i], upto)
                done += upto - progress.unpacked[i]
                progress.unpacked[i] = upto
        return done

    def restore(self, progress: RestoreProgress) -> bool:
        """Finish a restore: every read it needs completed and verified (never waited for here: see
        `ExtentReads.gather`), then the rest of each ref unpacked; all or nothing (False: the caller
        frees the slots and recomputes)."""
        sources = self.reads.gather(needs(progress.refs))
        if sources is not None:
            for i, (ref, slots) in enumerate(progress.parts()):
                self._unpack(ref, slots, sources[id(ref.extent)], progress.unpacked[i], ref.count)
                progress.unpacked[i] = ref.count
        self.reads.finish(progress.refs)
        if sources is None:
            self.metrics.inc("restore_failures")
            return False
        self.metrics.inc("restored_tokens", progress.tokens)
        return True

    def _unpack(self, ref: SpillRef, slots: torch.Tensor, buf: torch.Tensor, start: int, end: int) -> None:
        """Tokens [start, end) of `ref` (relative to it) from the extent's packed bytes in `buf`."""
        if end > start:
            src = buf[packed_nbytes(self.view, ref.offset + start) :]
            unpack_kv(self.view, slots[start:end], src.to(self.view.device, non_blocking=True))

    def _pack(self, slots: torch.Tensor, buf: torch.Tensor) -> None:
        if self.view.device.type == "cpu":
            pack_kv(self.view, slots, buf)
            return
        tmp = torch.empty(buf.numel(), dtype=torch.uint8, device=self.view.device)
        pack_kv(self.view, slots, tmp)
        buf.copy_(tmp)  # synchronous: the slots may be reused once this returns
