"""Reads of spilled extents into host staging, shared by prefetches and the restores that use them.

Contract (every method runs on the scheduler thread and never blocks on I/O):
- one read per extent at a time (by extent identity): a prefetch, a hint and a restore of the same
  extent share it; a read that must cover more tokens replaces a shorter one;
- a read nobody consumes is released after `ttl_s` (`expire`; never one a layer-wise restore in
  progress lands from: the controller says which); a read several restores share is given up by the
  last of them (the controller's `finish_reads`, `release_unpacked`);
- a failed read marks its extent LOST (its nodes are pruned on their next visit), counted once;
- a read is good only if the tier says OK *and* it holds exactly the bytes asked for: anything
  else (a short completion included) is a MISMATCH, never KV;
- `landed` says, per layer group, how many leading tokens of an extent are verified in host memory
  right now (a staged extent still being written, a finished read, or the verified prefix of a read
  in flight: a grouped payload lands group 0 first); nothing else may be read from a buffer before
  its read completed OK;
- a read's buffer goes back through `release` (the controller's: it waits for any unpack still
  copying from it), never straight to staging; one whose transfer may still write it
  (`Completion.dest_unsafe`) never goes back (`spoil`);
- a restore's reads start in its refs' order (the prefix first) as long as staging has room; the
  first that finds none stops it (`Readiness.STREAMING`: the caller unpacks what lands and gives
  those reads back, `finish_extent`, then asks again) and waits for room (`waits`, room_waits.py).
  While one waits, prefetches start no new read (`prefetch`), nor, with `in_order`, does a restore
  none of whose reads waits (it takes reads under way or landed: restores take staging in the
  order they began waiting), nor may a store take the room its read needs (`room_wanted_bytes`:
  staging_share.py). Only a read larger than all of staging fails a restore for room;
- the tier reads a restore's (or a prefetch's) extents one after another, or, with `group_major`
  (layer-wise restores), layer group by layer group across them (`Tier.submit_load`'s `batch`: the
  reads one call starts join the first of them, never an earlier call's), so that group 0 of every extent
  lands first and the prefill can start after about 1/groups of the reads, not after most of them;
  a tier whose batches cost fewer calls (`Tier.batches_loads`: Mooncake) gets a call's reads as one
  batch in either case, in group order only if layer-wise (`group_order`: else it may read all
  their groups in one call);
- `restore_read_seconds` (`count_read_span`): the first read a restore used starting to the last
  one completing (when the tier posted its completion, `Completion.at`, not when the scheduler
  took it); counted by the controller once per restore that got all its bytes, whole (at
  `complete`, the reads of extents unpacked early included) or layer-wise (when it settled; a read
  whose completion was not taken yet is counted when it is), without streamed reads given back.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace

import torch
from sgl_hicache_kernels import KVPoolView, LayerGroups, packed_nbytes

from sgl_hicache.cache.metrics import SpillMetrics
from sgl_hicache.cache.room_waits import RoomWaits
from sgl_hicache.cache.spill_state import Extent, ExtentState, SpillRef
from sgl_hicache.cache.staging import StagingPool
from sgl_hicache.tier import Completion, Status, Ticket, Tier

logger = logging.getLogger(__name__)


class Readiness(enum.Enum):
    READY = "ready"  # every byte is in staging or read and verified
    LAYERWISE = "layerwise"  # reads in flight, each one's first layer group landed (layer-wise may start)
    PENDING = "pending"  # reads in flight
    STREAMING = "streaming"  # reads in flight or not: not every read could start (staging is full)
    FAILED = "failed"  # a read failed or can never start: recompute


@dataclass(eq=False)
class PendingRead:
    """One load of an extent's first `tokens` tokens into staging; shared by a prefetch and the
    restore using it."""

    extent: Extent
    ticket: Ticket
    buf: torch.Tensor
    tokens: int
    started: float
    prefetched: bool
    done: Completion | None = None
    finished: float = 0.0  # when the tier posted its completion (monotonic; 0: not taken yet)
    usable: bool = True
    deferred: bool = False  # a restore already found it pending
    users: set[object] = field(default_factory=set)  # restores it serves (`TakeBack.serve`)


@dataclass(frozen=True)
class Landing:
    """What of an extent is at hand: `buf` holds the packed bytes of its first `tokens` tokens (the
    controller's layer-grouped layout), of which `groups[g]` leading tokens of group g are verified."""

    buf: torch.Tensor
    tokens: int
    groups: tuple[int, ...]


class _Batch:
    """The reads one call starts (one restore's, or one prefetch's): if `batched`, each is read
    with the first of them (`Tier.submit_load`'s `batch`). A read started earlier (another
    request's prefetch of a shared prefix) is never joined: work joining it would rank ahead of
    everything submitted since, for as long as reads kept joining."""

    def __init__(self, batched: bool) -> None:
        self.batched = batched
        self.began = time.monotonic()
        self.ticket: Ticket | None = None

    def joined(self, read: PendingRead) -> None:
        if self.batched and self.ticket is None and read.done is None and read.started >= self.began:
            self.ticket = read.ticket


def needs(refs: Sequence[SpillRef]) -> dict[int, tuple[Extent, int]]:
    """Per extent (by identity): the extent and how many of its leading tokens the refs need."""
    out: dict[int, tuple[Extent, int]] = {}
    for ref in refs:
        _, need = out.get(id(ref.extent), (ref.extent, 0))
        out[id(ref.extent)] = (ref.extent, max(need, ref.offset + ref.count))
    return out


class ExtentReads:
    def __init__(self, tier: Tier, view: KVPoolView, staging: StagingPool, metrics: SpillMetrics,
                 ttl_s: float, release: Callable[[torch.Tensor], None],
                 spoil: Callable[[torch.Tensor], None], layout: LayerGroups | None = None, group_major: bool = False,
                 wait_s: float | None = None, in_order: bool = False) -> None:  # fmt: skip
        """`wait_s`: the longest a restore waits for its reads (`RestorePolicy.restore_wait_s`; None:
        `ttl_s`): a read that waited longer for room is wanted by no restore that is still waiting;
        `in_order`: restores take staging in the order they began waiting (room_waits.py)."""
        self.tier = tier
        self.view = view
        self.layout = layout or view.groups(0)  # the layer groups every buffer is laid out in
        self.staging = staging
        self.release, self.spoil = release, spoil
        self.metrics = metrics
        self.ttl_s = ttl_s
        self._reads: dict[int, PendingRead] = {}  # by id(extent): loads started (prefetch or restore)
        self._tickets: dict[Ticket, PendingRead] = {}  # loads whose completion is still due
        self._spans: list[list[PendingRead]] = []  # read spans to count once their reads complete
        # the reads restores wait to start for room in staging (by extent), and their order
        self.waits = RoomWaits(metrics, ttl_s if wait_s is None else min(ttl_s, wait_s), in_order)
        self._mismatch_logged = False
        self._too_large_logged = False
        self.group_major = group_major  # read the extents one call starts layer group by layer group

    @property
    def batched(self) -> bool:
        """Whether the reads one call starts go to the tier as one batch: layer-wise, or where the
        tier reads a batch in fewer calls than one by one (`Tier.batches_loads`)."""
        return self.group_major or self.tier.batches_loads

    def completed(self, done: Completion) -> bool:
        """Take a load's completion (from the tier's `get_finished`); False if not one of ours."""
        read = self._tickets.pop(done.ticket, None)
        if read is None:
            return False
        read.done = self._checked(read, done)
        read.finished = done.at
        if self._spans:
            self._count_spans()
        if not read.usable:
            self._give_back(read)
        return True

    def holding(self) -> list[PendingRead]:
        """Every read holding a block of staging: kept for a restore, or its completion still due."""
        return list({id(r): r for r in [*self._reads.values(), *self._tickets.values()]}.values())

    def landed_reads(self) -> list[PendingRead]:
        """The reads completed and verified that are kept for a restore (not given up)."""
        return [r for r in self._reads.values() if r.usable and r.done is not None and r.done.ok]

    @property
    def in_flight(self) -> int:
        return len(self._tickets)

    def prefetch(self, refs: Sequence[SpillRef]) -> int:
        """Start reading what `refs` need into staging, ahead of their restore. Coalesces with reads
        already started; starts none while a restore waits for room in staging (restores come
        first), and none after the first that finds no room (the prefix first). Returns the tokens
        now on their way."""
        tokens, room, batch = 0, not self.waits.wanted, _Batch(self.batched)
        for extent, need in needs(refs).values():
            if extent.state is ExtentState.WRITING:
                tokens += need
            elif (read := self.start(extent, need, True, room, batch.ticket)) is not None:
                batch.joined(read)
                tokens += need
            else:
                room = False
        return tokens

    def readiness(self, refs: Sequence[SpillRef], done: Collection[int] = ()) -> tuple[Readiness, float]:
        """Whether a restore of `refs` would find all its bytes at hand, starting the reads it still
        needs, in order, while staging has room (`done`: extents, by identity, the restore has
        unpacked whole already: it needs no read of them). Returns the verdict (STREAMING when a
        read could not start for room: none after it starts either) and how long the oldest
        pending read has run. While another restore waits for room and none of this one's reads
        does, it starts none (`RoomWaits.yields`; counted once in `restore_reads_yielded`)."""
        waited = 0.0
        state = Readiness.READY
        wanted = needs(refs)
        yields = self.waits.yields(wanted)  # the room goes to the restores that waited first
        room, batch = not yields, _Batch(self.batched)
        for eid, (extent, need) in wanted.items():
            if eid in done or (extent.state is ExtentState.WRITING and extent.staged is not None):
                continue
            read = self.start(extent, need, prefetch=False, new=room, batch=batch.ticket)
            if read is None:
                if extent.state is not ExtentState.ON_TIER or not self._fits(extent, need):
                    return Readiness.FAILED, 0.0
                if room:  # the read that found no room (none after it was tried)
                    self.waits.wait(eid, packed_nbytes(self.view, need))
                room, state = False, Readiness.STREAMING
                continue
            self.waits.end(eid)
            batch.joined(read)
            if read.done is not None and not read.done.ok:
                self._lose(read)
                return Readiness.FAILED, 0.0
            if read.done is None:
                state = Readiness.PENDING if state is Readiness.READY else state
                waited = max(waited, time.monotonic() - read.started)
                if not read.deferred:  # count each late read once, not each retry
                    read.deferred = True
                    self.metrics.inc("restore_deferrals")
        self.metrics.inc("restore_reads_yielded", int(yields and state is Readiness.STREAMING))
        return state, waited

    def _fits(self, extent: Extent, need: int) -> bool:
        """Whether a read of `need` tokens of `extent` could ever start: no larger than all of
        staging, or its longest run once blocks were set aside (`StagingPool.largest_bytes`;
        counted and logged once otherwise: the restore recomputes)."""
        nbytes = packed_nbytes(self.view, need)
        if nbytes <= self.staging.largest_bytes:
            return True
        self.metrics.inc("restores_too_large")
        if not self._too_large_logged:
            self._too_large_logged = True
            logger.warning("sgl_hicache: extent %s needs a read of %d B, more than staging's largest block (%d B): "
                           "its restores recompute (logged once; counted in restores_too_large); raise "
                           "--hicache-spill-staging", extent.key.hex(), nbytes,
                           self.staging.largest_bytes)  # fmt: skip
        return False

    @property
    def room_wanted(self) -> bool:
        """Whether a restore waits for room in staging to start a read (`RoomWaits.wanted`)."""
        return self.waits.wanted

    @property
    def room_wanted_bytes(self) -> int:
        """The bytes of the largest read a restore waits to start for room (0: none waits): what
        staging keeps for it from stores (`StagingShare.reserved`)."""
        return self.waits.wanted_bytes

    def landed(self, extent: Extent) -> Landing | None:
        """The buffer holding `extent`'s packed bytes and, per layer group, how many of its leading
        tokens are verified in it now (whole pages, or all the read covers); None when nothing is."""
        groups = self.layout.count
        if extent.state is ExtentState.WRITING and extent.staged is not None:
            return Landing(extent.staged, extent.tokens, (extent.tokens,) * groups)
        read = self._reads.get(id(extent))
        if read is None or not read.usable or (read.done is not None and not read.done.ok):
            return None
        if read.done is not None:
            return Landing(read.buf, read.tokens, (read.tokens,) * groups)
        nbytes = self.tier.landed(read.ticket)
        return Landing(read.buf, read.tokens, tuple(self.layout.landed(read.tokens, nbytes)))

    def landed_tokens(self, refs: Sequence[SpillRef], group: int | None = None) -> int:
        """Tokens of `refs` whose bytes are verified in host memory now (`landed`; the controller's
        `unpack_landed` unpacks them): in layer group `group`, or in the group that has most."""
        total = 0
        for ref in refs:
            landing = self.landed(ref.extent)
            if landing is not None:
                have = landing.groups if group is None else (landing.groups[group],)
                total += max(0, min(ref.count, max(have) - ref.offset))
        return total

    def failed(self, extent: Extent) -> bool:
        """Whether the read of `extent` completed and failed (or was given up): it will never land."""
        if extent.state is ExtentState.WRITING and extent.staged is not None:
            return False
        read = self._reads.get(id(extent))
        if read is None or not read.usable:
            return True
        if read.done is not None and not read.done.ok:
            self._lose(read)
            return True
        return False

    def read_of(self, extent: Extent) -> PendingRead | None:
        """The read of `extent` kept for a restore (in flight or landed), if any."""
        return r if (r := self._reads.get(id(extent))) is not None and r.usable else None

    def running(self, extent: Extent) -> PendingRead | None:
        """The read of `extent` still running (its completion not taken yet), if any."""
        return r if (r := self.read_of(extent)) is not None and r.done is None else None

    def gather(self, wanted: dict[int, tuple[Extent, int]]) -> dict[int, Landing] | None:
        """The packed bytes of every wanted extent, from staging or a read completed and verified;
        None if any is not at hand now. Never starts a read and never waits: between `readiness`
        saying READY and this call, the eviction that made room for the restore may have finished a
        write (its staging released) or abandoned a read; the restore then recomputes (counted in
        `restores_overtaken`) and the extent's next restore reads it again."""
        sources: dict[int, Landing] = {}
        for eid, (extent, need) in wanted.items():
            landing = self._at_hand(extent, need)
            if landing is None:
                return None
            sources[eid] = landing
        return sources

    def count_read_span(self, wanted: Collection[int]) -> None:
        """`restore_read_seconds` of a restore that got all its bytes from the reads of the extents
        `wanted` (by identity): the first of them starting to the last completing (`Completion.at`).
        If a completion was not taken yet (a layer-wise restore settles, inside the forward, on the
        bytes that landed), it is counted once the last one is (`completed`). Extents with no read
        (a write's staging, or given back) count nothing."""
        used = [r for r in (self._reads.get(eid) for eid in wanted) if r is not None]
        if used:
            self._spans.append(used)
            self._count_spans()

    def _count_spans(self) -> None:
        """Count the read spans whose every read has completed."""
        open_spans = []
        for used in self._spans:
            if all(r.finished for r in used):
                span = max(r.finished for r in used) - min(r.started for r in used)
                self.metrics.inc("restore_read_seconds", max(0.0, span))
            else:
                open_spans.append(used)
        self._spans = open_spans

    def _at_hand(self, extent: Extent, need: int) -> Landing | None:
        groups = self.layout.count
        if extent.state is ExtentState.WRITING and extent.staged is not None:
            return Landing(extent.staged, extent.tokens, (extent.tokens,) * groups)
        read = self._reads.get(id(extent))
        if read is None or not read.usable or read.tokens < need or read.done is None:
            self.metrics.inc("restores_overtaken")
            return None
        if not read.done.ok:
            self._lose(read)
            return None
        return Landing(read.buf, read.tokens, (read.tokens,) * groups)

    def start(self, extent: Extent, tokens: int, prefetch: bool, new: bool = True,
              batch: Ticket | None = None) -> PendingRead | None:  # fmt: skip
        """The read of `extent`'s first `tokens` tokens: the one under way, or a new one (only if
        `new`, and staging has room), read with the load `batch` (`Tier.submit_load`)."""
        read = self._reads.get(id(extent))
        if read is not None and read.tokens >= tokens and read.usable:
            if prefetch:
                self.metrics.inc("prefetch_coalesced")
                return read
            if read.prefetched:  # the first restore attempt that finds a prefetch's read
                self.metrics.inc("prefetch_hits")
                read.prefetched = False
            return read
        if read is not None and not prefetch:  # too short: a restore's now, until a longer one starts
            read.prefetched = False
        if not new or extent.state is not ExtentState.ON_TIER:
            return None
        nbytes = packed_nbytes(self.view, tokens)
        buf = self.staging.acquire(nbytes)
        if buf is None:
            return None
        started = time.monotonic()  # before the submit: its completion may be posted before it returns
        try:
            ticket = self.tier.submit_load(extent.key, buf.numpy(), nbytes, group_layers=self.layout.group_layers,
                                           batch=batch, group_order=self.group_major)  # fmt: skip
        except BaseException:  # nothing was queued (a submit raises before queueing): nobody holds it
            self.release(buf)
            raise
        if read is not None:
            self._abandon(read)
        read = PendingRead(extent, ticket, buf, tokens, started, prefetched=prefetch)
        self._reads[id(extent)] = read
        self._tickets[ticket] = read
        self.metrics.inc("prefetch_issued" if prefetch else "reads_on_demand")
        return read

    def _checked(self, read: PendingRead, done: Completion) -> Completion:
        """`done`, or a MISMATCH if it claims success with other than the bytes asked for."""
        want = packed_nbytes(self.view, read.tokens)
        if done.ok and done.nbytes != want:
            return replace(done, status=Status.MISMATCH, detail=f"loaded {done.nbytes} B of {want} B")
        return done

    def _lose(self, read: PendingRead) -> None:
        """A read failed: its extent is LOST (its nodes will be pruned), counted once."""
        if read.extent.state is ExtentState.LOST:
            return
        assert read.done is not None
        if read.done.status is Status.MISMATCH:
            self.metrics.inc("mismatch_extents")
            if not self._mismatch_logged:  # counted every time, logged once
                self._mismatch_logged = True
                logger.warning("sgl_hicache: extent %s is not what its key names (%s): recomputing; "
                               "later ones are only counted", read.extent.key.hex(), read.done.detail)  # fmt: skip
        elif read.done.status is Status.CORRUPT:
            self.metrics.inc("corrupt_extents")
        elif read.done.status is Status.MISS:
            self.metrics.inc("lost_extents")
        read.extent.state = ExtentState.LOST

    def finish_extent(self, extent_id: int, waits: bool = False) -> bool:
        """Give up the read of one extent (by identity), if any: a restore unpacked it whole (its
        staging goes back once that unpack ran: `release`), or will not happen; or, `waits`, a
        restore waits for room for a longer one (its wait stays). Whether one was."""
        if not waits:
            self.waits.end(extent_id)
        read = self._reads.pop(extent_id, None)
        if read is not None:
            self._abandon(read)
        return read is not None

    def _abandon(self, read: PendingRead) -> None:
        """Release a read's staging now if it finished, else when its completion arrives."""
        read.usable = False
        if read.done is not None or read.ticket not in self._tickets:
            self._give_back(read)
        if self._reads.get(id(read.extent)) is read:
            del self._reads[id(read.extent)]

    def _give_back(self, read: PendingRead) -> None:
        """`release` a read's buffer; `spoil` it where a transfer may still write it."""
        (self.spoil if read.done is not None and read.done.dest_unsafe else self.release)(read.buf)

    def clear(self) -> None:
        """Give up every read (a flush): staging comes back as their completions arrive."""
        self.waits.clear()
        for read in list(self._reads.values()):
            self._abandon(read)

    def expire(self, keep: Collection[int] = ()) -> None:
        """Reads nobody consumed within `ttl_s` (an unused prefetch, or a restore whose request went
        away while waiting) give their staging back; but for the extents in `keep` (by identity:
        those a layer-wise restore in progress still lands from, which ends within its forward).
        A read waiting for room is no longer waited for after the restore wait (`RoomWaits.expire`)."""
        self.waits.expire()
        now = time.monotonic()
        for read in list(self._reads.values()):
            if now - read.started > self.ttl_s and id(read.extent) not in keep:
                self.metrics.inc("prefetch_abandoned")
                self._abandon(read)
