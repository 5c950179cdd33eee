"""`SpillController`: the one object that moves KV between the device pool and the tier.

It owns the staging arena, the stores and reads in flight, the restores in progress (their slots
and early unpacks), the lookups' I/O half and the ordering of every copy against sglang's forward
(`CopyEngine`); it knows nothing of the radix tree (sglang's `HiCacheController` and vLLM's
`kv_offload` worker side are the models). Every method runs on the scheduler thread and never
blocks on I/O or on the device, except `wait_writes` and `close` (tests, shutdown).

Contract:
- `store` packs a node's slots into staging and submits the extent's write once the pack is done;
  a `Refused` reason when staging cannot hold it (the caller drops the node), counted as
  `spills_refused_staging_full` (momentarily: writes in flight hold it) or `spills_refused_too_large`
  (never: larger than all of staging; logged once with the flag to raise). A `background` store (a
  write-through: nothing is lost without it) may fill staging only up to `BACKGROUND_SHARE` of it,
  so eviction spills and reads always have the rest; refused, it is counted as
  `writes_through_deferred` or `writes_through_too_large` (logged once). While a restore waits for
  room to start a read, no store takes the bytes that read needs (`restore_reserve`): a spill is
  refused (`spills_refused_reserved`), a write-through deferred. That rule and those
  refusals are `StagingShare`'s (staging_share.py). Before an eviction's spill is refused for room,
  prefetched reads that landed for queued requests give it theirs (`TakeBack`: the tier serves
  them again; never the reads a restore has asked for). The caller may free the
  slots as soon as `store` returns (later forwards wait for the pack's gather).
- `poll` (never blocks) submits the writes whose packs are done, moves finished writes to ON_TIER
  or LOST, hands finished loads to `reads`, and gives back staging whose copies are done. It never
  touches the tree; finished lookups wait for `take_lookups`.
- A restore is all or nothing. The caller allocates its slots and registers them with
  `restores.open` (the table owns them from then on), may `unpack_landed` while reads are in flight
  (early unpack) and `release_unpacked` the reads of extents unpacked whole (streaming: the next
  `readiness` needs no read of them and starts the reads that found no room; with keys off by
  default, restores take room in the order they began waiting, `restores_in_order`, room_waits.py,
  and one whose read waits takes back others' landed prefetches, `restores_take_back`), then
  `complete`s it: every read it needs completed and verified (never waited for: see
  `ExtentReads.gather`), the rest unpacked; True leaves it in the table for the caller's
  `restores.hand_over`, False frees its slots (the request recomputes). Any tier failure marks
  the extent LOST; nothing read is used unverified.
- A read shared by several restores in progress (open in `restores`, or handed over layer-wise
  and still landing: `Restores.hand_over(landing=True)` until `landed`) is given up only by the last
  that needs it (`finish_reads`, `release_unpacked`), and never expires while a layer-wise restore
  lands from it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from sgl_hicache_kernels import DEFAULT_LAYER_GROUPS, KVPoolView, default_group_layers

from sgl_hicache.cache.device import Copy, CopyEngine, Streams, streams_for
from sgl_hicache.cache.lookups import FoundSegments, Lookups
from sgl_hicache.cache.metrics import SpillMetrics, StagingHolder
from sgl_hicache.cache.reads import ExtentReads, Landing, Readiness, needs
from sgl_hicache.cache.restores import RestoreProgress, Restores
from sgl_hicache.cache.retiring import Retiring
from sgl_hicache.cache.spill_state import Extent, ExtentState, SpillRef
from sgl_hicache.cache.staging import StagingPool
from sgl_hicache.cache.staging_holders import HeldTime, held
from sgl_hicache.cache.staging_share import Refused, StagingShare
from sgl_hicache.cache.take_back import TakeBack
from sgl_hicache.tier import Completion, ExtentKey, Ticket, Tier
from sgl_hicache.tier.results import LookupResult

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Store:
    """What a write needs besides its bytes, kept while its pack runs."""

    extent: Extent
    parent: ExtentKey
    tokens: np.ndarray
    store_tokens: bool
    aliases: Sequence[tuple[int, bytes]]
    cache_salt: str | None = None


class SpillController:
    def __init__(self, tier: Tier, view: KVPoolView, staging: StagingPool, metrics: SpillMetrics, timeout_s: float,
                 allocator: Any, prefetch_ttl_s: float = 30.0, streams: Streams | None = None,
                 layer_groups: int = DEFAULT_LAYER_GROUPS, group_major: bool = False,
                 restore_reserve: bool = False, restore_wait_s: float | None = None,
                 take_back_reads: bool = True, restores_in_order: bool = False,
                 restores_take_back: bool = False) -> None:  # fmt: skip
        self.view = view
        self.metrics = metrics
        self.timeout_s = timeout_s
        # every extent this controller writes and reads is laid out in these layer groups (format v6)
        self.layout = view.groups(default_group_layers(len(view.layers), layer_groups))
        self.engine = CopyEngine(view, streams or streams_for(view.device), self.layout)
        self.retiring = Retiring(staging, metrics)  # blocks given back once their copies are done
        # group_major: layer-wise restores start once group 0 of every extent landed: read that first
        self.reads = ExtentReads(tier, view, staging, metrics, prefetch_ttl_s, self.retire,
                                 self.retiring.spoil, self.layout, group_major, restore_wait_s,
                                 restores_in_order)  # fmt: skip
        self.restores = Restores(allocator, self.engine, prefetch_ttl_s)
        self.lookups = Lookups()
        self._packing: list[_Store] = []  # stores whose pack is not done yet (submitted by `poll`)
        self._writing: dict[Ticket, Extent] = {}
        # what a store may take of staging (not the room a waiting restore's read needs), its refusals
        wanted = (lambda: self.reads.room_wanted_bytes) if restore_reserve else None
        # landed reads yield to spills (`take_back_reads`) and to restores waiting for room
        self.take_back = TakeBack(self.reads, self.restores, self.retiring, metrics, restores_take_back)
        self.share = StagingShare(view, metrics, wanted, self.take_back.block if take_back_reads else None)
        self.share.log_extent_bound(staging)
        self.held_time = HeldTime(metrics)  # staging held per holder over time, for /metrics

    @property
    def staging(self) -> StagingPool:
        return self.reads.staging

    @staging.setter
    def staging(self, staging: StagingPool) -> None:  # tests swap in a smaller arena while idle
        self.reads.staging = self.retiring.staging = staging

    @property
    def tier(self) -> Tier:
        return self.reads.tier

    @tier.setter
    def tier(self, tier: Tier) -> None:  # tests wrap the tier in a FaultyTier after writing
        self.reads.tier = tier

    # ---- stores -------------------------------------------------------------------------------

    def store(
        self, key: ExtentKey, parent: ExtentKey, tokens: np.ndarray, slots: torch.Tensor, store_tokens: bool,
        aliases: Sequence[tuple[int, bytes]] = (), background: bool = False, cache_salt: str | None = None,
        yields: bool = True,
    ) -> Extent | Refused:  # fmt: skip
        """`store_tokens`: whether the extent file may hold the token ids (the default tenant's only);
        `aliases`: the path keys inside it, so other servers find it (`Tier.submit_store`);
        `cache_salt`: the request's tenant salt, tagged in the file so a purge finds it;
        `background`: a write-through, bounded by `BACKGROUND_SHARE` of staging; `yields`: leaves a
        waiting restore's read its room (`StagingShare.take`)."""
        buf = self.share.take(self.staging, len(slots), background, yields)
        if isinstance(buf, Refused):
            return buf
        t0 = time.perf_counter()
        try:
            copy = self.engine.pack(slots, buf)
        except BaseException:  # whatever was enqueued before the raise may still write into it
            self.retire(buf, self.engine.write_barrier())
            raise
        self.metrics.inc("spill_pack_seconds", time.perf_counter() - t0)
        extent = Extent(key, len(slots), ExtentState.WRITING, staged=buf, pack=copy)
        self._packing.append(_Store(extent, parent, tokens, store_tokens, aliases, cache_salt))
        self.metrics.inc("spilled_bytes", buf.numel())
        self._submit_packed()
        return extent

    def background_fit(self, tokens: int) -> Refused | None:
        """`StagingShare.background_fit` on this controller's staging; counts nothing."""
        return self.share.background_fit(self.staging, tokens)

    def _submit_packed(self) -> None:
        """Submit the writes whose packs are done, oldest first; stop at the first still running."""
        while self._packing:
            pack = self._packing[0].extent.pack
            if pack is not None and not pack.done:
                return
            self._submit(self._packing.pop(0))

    def _submit(self, request: _Store) -> None:
        extent = request.extent
        extent.pack = None
        assert extent.staged is not None
        try:
            ticket = self.tier.submit_store(extent.key, extent.staged.numpy(), request.tokens, request.parent,
                                            store_tokens=request.store_tokens, aliases=request.aliases,
                                            cache_salt=request.cache_salt,
                                            group_layers=self._stored_groups)  # fmt: skip
        except BaseException:  # nothing was queued (a submit raises before queueing): nobody holds it
            self._lose(extent)
            raise
        self._writing[ticket] = extent

    @property
    def _stored_groups(self) -> int:
        """The `group_layers` of the extents this controller writes (0: page-major, one group)."""
        return self.layout.group_layers if self.layout.count > 1 else 0

    def still_stored(self, extent: Extent) -> bool:
        """Whether `extent` is on its way (its bytes in staging) or, as this process's index says,
        on the tier (another process sharing the root may have evicted it since: see the cache)."""
        if extent.state is ExtentState.WRITING:
            return extent.staged is not None
        return extent.state is ExtentState.ON_TIER and self.tier.contains(extent.key)

    def reused(self, extent: Extent) -> None:
        """An eviction points at `extent` instead of writing it again: the tier's LRU sees a use."""
        if extent.state is ExtentState.ON_TIER:
            self.tier.touch(extent.key)

    @property
    def writes_in_flight(self) -> int:
        return len(self._writing) + len(self._packing)

    # ---- completions --------------------------------------------------------------------------

    def poll(self) -> None:
        """Take every finished tier operation and copy. The tier hands each completion over once:
        one whose handling raises must not lose the ones after it (their writes would stay in
        flight, their staging held, for good), so all are handled and then the first exception is
        raised."""
        self.held_time.add(self.staging_held(), self.staging.capacity_bytes)  # held since the last poll
        errors: list[Exception] = []
        for done in self.tier.get_finished():
            try:
                self._complete(done)
            except Exception as e:  # re-raised below, after the rest are handled
                errors.append(e)
        self._submit_packed()
        self.retiring.release_done()
        self.reads.expire(keep=self.restores.landing_extents())
        self.restores.expire()
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
        self._release_staged(extent)
        extent.state = ExtentState.ON_TIER if ok else ExtentState.LOST
        if not ok:
            self.metrics.inc("spill_failures")

    def _lose(self, extent: Extent) -> None:
        self._release_staged(extent)
        extent.state = ExtentState.LOST

    def _release_staged(self, extent: Extent) -> None:
        if extent.staged is not None:
            self.retire(extent.staged, extent.pack)
            extent.staged, extent.pack = None, None

    def retire(self, buf: torch.Tensor, copy: Copy | None = None) -> None:
        """Give a staging block back once the copies using it are done (`Retiring.retire`)."""
        self.retiring.retire(buf, copy)

    # ---- reads and restores -------------------------------------------------------------------

    def prefetch(self, refs: Sequence[SpillRef]) -> int:
        return self.reads.prefetch(refs)

    def readiness(self, refs: Sequence[SpillRef], owner: object = None) -> tuple[Readiness, float]:
        """`ExtentReads.readiness` of `refs`, needing no read of the extents `owner`'s restore of
        exactly `refs` has unpacked whole already (streamed: see `release_unpacked`). A read of
        theirs that waits for room takes landed prefetches back first (`TakeBack.for_restore`)."""
        progress = self.restores.get(owner) if owner is not None else None
        done = progress.done_extents() if progress is not None and progress.refs == tuple(refs) else set()
        state, waited = self.reads.readiness(refs, done)
        self.take_back.serve(refs, owner, done)
        if state is Readiness.STREAMING and self.take_back.for_restore(refs, self.staging, progress, done):
            state, waited = self.reads.readiness(refs, done)  # its read has room now
        return state, waited

    def release_unpacked(self, owner: object) -> int:
        """Give back the reads of the extents `owner`'s restore has unpacked whole (each block goes
        back to staging once the unpack reading it ran: `retire`), so the restore's next reads find
        room: a restore streams through staging. `complete` then needs no source for them. Returns
        the reads given back."""
        progress = self.restores.get(owner)
        if progress is None:
            return 0
        unpacked = progress.done_extents()
        self.take_back.unserve([r for r in progress.refs if id(r.extent) in unpacked], owner)
        done = [eid for eid in unpacked if not self.restores.needs(eid, but=progress)]
        released = sum(self.reads.finish_extent(eid) for eid in done)
        progress.released += released
        return released

    def finish_reads(self, refs: Sequence[SpillRef], owner: object = None) -> None:
        """Give up the reads of `refs`' extents (used by `owner`'s restore, or their restore will not
        happen), but for those a restore in progress other than `owner`'s still needs
        (`Restores.needs`): a read shared by several restores goes with the last that needs it."""
        mine = self.restores.get(owner) if owner is not None else None
        self.take_back.unserve(refs, owner)
        for eid in needs(refs):
            if not self.restores.needs(eid, but=mine):
                self.reads.finish_extent(eid)

    def unpack_landed(
        self, owner: object, progress: RestoreProgress | None = None, fence: list[Any] | None = None
    ) -> int:
        """Unpack into `owner`'s restore (or `progress`, a layer-wise one, whose unpacks wait for
        `fence` only) whatever of its refs is verified in host memory and not unpacked yet (a prefix
        of each ref in each layer group, whole pages); returns the tokens unpacked now (in layer
        groups: a token counts once all its groups are)."""
        progress = progress or self.restores.get(owner)
        assert progress is not None, f"no restore in progress for {owner}"
        done = 0
        for i, ref, _ in progress.parts():
            landing = self.reads.landed(ref.extent)
            if landing is None:
                continue
            for g, landed in enumerate(landing.groups):
                upto = max(0, min(ref.count, landed - ref.offset))
                if upto > progress.unpacked[i][g]:
                    done += upto - progress.unpacked[i][g]
                    self._unpack(progress, i, g, landing, upto, fence)
        if done:
            self.restores.stats.steps += 1
            self.restores.stats.tokens += done // progress.groups
        return done // progress.groups

    def complete(self, owner: object) -> bool:
        """Finish `owner`'s restore (see the module doc); all or nothing."""
        progress = self.restores.get(owner)
        assert progress is not None, f"no restore in progress for {owner}"
        self.restores.stats.finished += progress.any_unpacked
        done = progress.done_extents()  # streamed: unpacked whole, their reads given back
        sources = self.reads.gather({e: n for e, n in needs(progress.refs).items() if e not in done})
        try:
            if sources is not None:
                self.reads.count_read_span(needs(progress.refs))  # also the reads unpacked early
                for i, ref, _ in progress.parts():
                    if id(ref.extent) in done:
                        continue
                    for g in range(progress.groups):
                        self._unpack(progress, i, g, sources[id(ref.extent)], ref.count)
        finally:  # an unpack that raised gives the reads' staging back now, not after their TTL
            self.finish_reads(progress.refs, owner)
        if sources is None:
            self.metrics.inc("restore_failures")
            self.restores.drop(owner)
            return False
        self.metrics.inc("restores_streamed", int(progress.released > 0))
        return True

    def count_restored(self, progress: RestoreProgress) -> None:
        """A restore succeeded (agreed across TP ranks: the cache calls this once per restore, after a
        whole restore's hand-over or when a layer-wise one ended OK everywhere): its tokens, and the
        verified bytes it unpacked from tier reads (`restored_bytes`: not those of a write's staging).
        A restore that failed, was dropped or freed counts nothing; one reopened counts its last
        progress only."""
        self.metrics.inc("restored_tokens", progress.tokens)
        self.metrics.inc("restored_bytes", progress.read_bytes)

    def _unpack(self, progress: RestoreProgress, i: int, g: int, landing: Landing, upto: int,
                fence: list[Any] | None = None) -> None:  # fmt: skip
        """Tokens [unpacked, upto) of ref i of `progress` in layer group g, from its extent's packed
        bytes (`landing`: a buffer of `landing.tokens` tokens): exactly those bytes are copied."""
        ref, start = progress.refs[i], progress.unpacked[i][g]
        if upto <= start:
            return
        first = sum(r.count for r in progress.refs[:i])
        lo, hi = self.layout.span(g, landing.tokens, ref.offset + start, ref.offset + upto)
        src, buf = landing.buf[lo:hi], landing.buf
        slots = progress.slots[first + start : first + upto]
        t0 = time.perf_counter()
        try:
            copy = self.engine.unpack(slots, src, after=ref.extent.pack, group=g, fence=fence)
        except BaseException:  # chunks enqueued before the raise still write the slots, read `buf`
            self._reading(progress, buf, self.engine.load_barrier(), g)
            raise
        self.metrics.inc("restore_unpack_seconds", time.perf_counter() - t0)
        if buf is not ref.extent.staged:  # read from the tier and verified, not its write's staging
            progress.read_bytes += hi - lo  # counted if the restore succeeds (`count_restored`)
        self._reading(progress, buf, copy, g)
        progress.unpacked[i][g] = upto

    def _reading(self, progress: RestoreProgress, buf: torch.Tensor, copy: Copy, group: int) -> None:
        """`copy` is the last unpack into `progress`'s slots (of layer group `group`) and from
        staging block `buf`: freeing the slots and releasing the block wait for it."""
        progress.last_copy = copy
        progress.group_copies[group] = copy
        self.retiring.reading(buf, copy)

    # ---- lookups ------------------------------------------------------------------------------

    def take_lookups(self) -> list[tuple[FoundSegments, LookupResult]]:
        found, seconds = self.lookups.finished(self.tier)
        self.metrics.inc("lookup_seconds", seconds)
        return found

    # ---- lifecycle ----------------------------------------------------------------------------

    def clear(self) -> None:
        """A flush: every read, restore in progress and lookup is given up."""
        self.restores.clear()
        self.reads.clear()
        self.lookups.clear()

    def wait_writes(self, timeout_s: float = 30.0) -> None:
        """Block until every submitted write has finished (tests, shutdown); then `poll`."""
        for request in self._packing:
            if request.extent.pack is not None:
                self.engine.streams.synchronize(request.extent.pack.event)
        self._submit_packed()
        for ticket in list(self._writing):
            try:
                done = self.tier.wait(ticket, timeout=timeout_s)
            except KeyError:  # already returned through get_finished by another caller
                continue
            self._complete(done)
        self.poll()

    def close(self, timeout_s: float) -> None:
        """Shutdown: submit the writes whose packs are done (waiting for the device's copies: their
        bytes are the only copy of evicted KV), then close the tier, giving its writes at most
        `timeout_s` (then abandoned, their temp files removed; see `Tier.close`). Later stores
        complete REJECTED (their extents LOST). Blocks. The tier is closed even when the first step
        raises (a device error: what is not submitted then is lost, as after a crash); raises that."""
        try:
            for request in self._packing:
                if request.extent.pack is not None:
                    self.engine.streams.synchronize(request.extent.pack.event)
            self._submit_packed()
        finally:
            self.tier.close(timeout_s)

    def check_integrity(self, with_tier: bool = True) -> None:
        """Staging accounting, and the tier's own check when nothing is in flight (`with_tier`;
        off for a directory that other processes change, where index and files legitimately differ)."""
        split = self.staging_held()
        assert self.staging.used_bytes == sum(split.values()), (
            f"staging used {self.staging.used_bytes} != {split}"
        )
        self.staging.check_integrity()
        if with_tier and not self.writes_in_flight and not self.reads.in_flight:
            self.tier.check_integrity()

    def staging_held(self) -> dict[StagingHolder, int]:
        """Staging in use by what holds it (`staging_holders.held`); sums to `staging.used_bytes`."""
        writes = [*self._writing.values(), *(request.extent for request in self._packing)]
        return held(writes, self.retiring.blocks(), self.reads, self.restores)
