"""Moving KV between the device pool and the tier: pack → store on spill, load → unpack on restore.

`SpillIO` knows nothing of the radix tree: it turns slot lists into extents and back. Contract:
- `store` never blocks on I/O: it packs into staging (bounded), submits the write and returns the
  new `Extent` (WRITING); None when the tier is unusable or staging is full (the caller drops).
  The caller may free the slots as soon as `store` returns: the pack has completed.
- `poll` (never blocks) moves finished writes to ON_TIER / LOST and frees their staging.
- `prefetch` (never blocks) starts the reads a coming restore will need, into staging; reads of one
  extent coalesce; a prefetch nobody uses is released after `prefetch_ttl_s`.
- `restore` is all or nothing: it fills every requested slot, or returns False (the caller frees the
  slots and recomputes). Any tier failure marks the extent LOST; nothing read is used unverified.
  It uses the prefetched reads, starts the missing ones, and blocks for them (at most `timeout_s`
  each); extents still WRITING are served from staging.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sgl_hicache.cache.spill_state import Extent, ExtentState, SpillRef
from sgl_hicache.cache.staging import StagingPool
from sgl_hicache.kernels import KVPoolView, pack_kv, packed_nbytes, unpack_kv
from sgl_hicache.server.metrics import SpillMetrics
from sgl_hicache.tier import Completion, ExtentKey, Status, Ticket, Tier

logger = logging.getLogger(__name__)


class SpillIO:
    def __init__(self, tier: Tier, view: KVPoolView, staging: StagingPool, metrics: SpillMetrics,
                 timeout_s: float, prefetch_ttl_s: float = 30.0) -> None:  # fmt: skip
        self.tier = tier
        self.view = view
        self.staging = staging
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.prefetch_ttl_s = prefetch_ttl_s
        self._writing: dict[Ticket, Extent] = {}
        self._reads: dict[int, PendingRead] = {}  # by id(extent): loads started (prefetch or restore)
        self._read_tickets: dict[Ticket, PendingRead] = {}  # loads whose completion is still due

    def store(
        self, key: ExtentKey, parent: ExtentKey, tokens: np.ndarray, slots: torch.Tensor
    ) -> Extent | None:
        nbytes = packed_nbytes(self.view, len(slots))
        buf = self.staging.acquire(nbytes)
        if buf is None:
            return None
        self._pack(slots, buf)
        ticket = self.tier.submit_store(key, buf.numpy(), tokens, parent)
        extent = Extent(key, len(slots), ExtentState.WRITING, staged=buf)
        self._writing[ticket] = extent
        self.metrics.inc("spilled_bytes", nbytes)
        return extent

    def poll(self) -> None:
        for done in self.tier.get_finished():
            read = self._read_tickets.pop(done.ticket, None)
            if read is not None:
                read.done = done
                if not read.usable:
                    self.staging.release(read.buf)
                continue
            extent = self._writing.pop(done.ticket, None)
            if extent is not None:
                self._finish_write(extent, done.ok)
        self._expire_prefetches()

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

    def check_integrity(self) -> None:
        staged = sum(e.staged.numel() for e in self._writing.values() if e.staged is not None)
        reads = {id(r): r for r in [*self._reads.values(), *self._read_tickets.values()]}
        held = staged + sum(r.buf.numel() for r in reads.values())
        assert self.staging.used_bytes == held, f"staging used {self.staging.used_bytes} != held {held}"
        if not self._writing and not self._read_tickets:
            self.tier.check_integrity()

    def prefetch(self, refs: Sequence[SpillRef]) -> int:
        """Start reading what `refs` need into staging, ahead of their restore. Never blocks;
        coalesces with reads already started. Returns the tokens now on their way."""
        tokens = 0
        for extent, need in _needs(refs).values():
            if (
                extent.state is ExtentState.WRITING
                or self._start_read(extent, need, prefetch=True) is not None
            ):
                tokens += need
        return tokens

    def readiness(self, refs: Sequence[SpillRef]) -> tuple[Readiness, float]:
        """Whether a restore of `refs` would find all its bytes at hand, starting the reads it still
        needs. Never blocks. Returns the verdict and how long the oldest pending read has run."""
        self.poll()
        waited = 0.0
        state = Readiness.READY
        for extent, need in _needs(refs).values():
            if extent.state is ExtentState.WRITING and extent.staged is not None:
                continue
            read = self._start_read(extent, need, prefetch=False)
            if read is None:
                return Readiness.FAILED, 0.0
            if read.done is not None and not read.done.ok:
                self._lose(read)
                return Readiness.FAILED, 0.0
            if read.done is None:
                state = Readiness.PENDING
                waited = max(waited, time.monotonic() - read.started)
                if not read.deferred:  # count each late read once, not each retry
                    read.deferred = True
                    self.metrics.inc("restore_deferrals")
        return state, waited

    def abandon(self, refs: Sequence[SpillRef]) -> None:
        """Give up the reads started for `refs` (their restore will not happen)."""
        for extent_id in _needs(refs):
            self._finish_read(extent_id)

    def restore(self, parts: Sequence[tuple[SpillRef, torch.Tensor]]) -> bool:
        """Unpack each ref's tokens into its slots (same length); all or nothing."""
        sources = self._gather(_needs([ref for ref, _ in parts]))
        if sources is not None:
            for ref, slots in parts:
                src = sources[id(ref.extent)][packed_nbytes(self.view, ref.offset) :]
                unpack_kv(self.view, slots, src.to(self.view.device, non_blocking=True))
        for ref, _ in parts:
            self._finish_read(id(ref.extent))
        if sources is None:
            self.metrics.inc("restore_failures")
            return False
        self.metrics.inc("restored_tokens", sum(len(s) for _, s in parts))
        return True

    def _gather(self, needs: dict[int, tuple[Extent, int]]) -> dict[int, torch.Tensor] | None:
        """The packed bytes of every needed extent (staging or a verified read); None on any failure."""
        pending: dict[int, PendingRead] = {}
        for eid, (extent, need) in needs.items():
            if extent.state is ExtentState.WRITING and extent.staged is not None:
                continue
            read = self._start_read(extent, need, prefetch=False)
            if read is None:
                return None
            pending[eid] = read
        sources = {eid: extent.staged for eid, (extent, _) in needs.items() if eid not in pending}
        for eid, read in pending.items():
            if not self._await(read):
                return None
            sources[eid] = read.buf
        return sources  # type: ignore[return-value]

    def _start_read(self, extent: Extent, nbytes_tokens: int, prefetch: bool) -> PendingRead | None:
        read = self._reads.get(id(extent))
        nbytes = packed_nbytes(self.view, nbytes_tokens)
        if read is not None and read.nbytes >= nbytes and read.usable:
            if prefetch:
                self.metrics.inc("prefetch_coalesced")
            elif read.prefetched:  # the first restore attempt that finds a prefetch's read
                self.metrics.inc("prefetch_hits")
                read.prefetched = False
            return read
        if extent.state is not ExtentState.ON_TIER:
            return None
        buf = self.staging.acquire(nbytes)
        if buf is None:
            return None
        ticket = self.tier.submit_load(extent.key, buf.numpy(), nbytes)
        if read is not None:
            self._abandon(read)
        read = PendingRead(extent, ticket, buf, nbytes, time.monotonic(), prefetched=prefetch)
        self._reads[id(extent)] = read
        self._read_tickets[ticket] = read
        self.metrics.inc("prefetch_issued" if prefetch else "reads_on_demand")
        return read

    def _await(self, read: PendingRead) -> bool:
        if read.done is None:
            try:
                read.done = self.tier.wait(read.ticket, timeout=self.timeout_s)
            except TimeoutError:
                logger.warning(
                    "sgl_hicache: restore read of %s timed out after %.1fs",
                    read.extent.key.hex(),
                    self.timeout_s,
                )
                return False
            self._read_tickets.pop(read.ticket, None)
        if read.done.ok:
            self.metrics.inc("restored_bytes", read.done.nbytes)
            return True
        self._lose(read)
        return False

    def _lose(self, read: PendingRead) -> None:
        """A read failed: its extent is LOST (its nodes will be pruned), counted once."""
        if read.extent.state is ExtentState.LOST:
            return
        assert read.done is not None
        if read.done.status in (Status.CORRUPT, Status.MISS):
            self.metrics.inc("corrupt_extents")
        read.extent.state = ExtentState.LOST

    def _finish_read(self, extent_id: int) -> None:
        read = self._reads.pop(extent_id, None)
        if read is not None:
            self._abandon(read)

    def _abandon(self, read: PendingRead) -> None:
        """Release a read's staging now if it finished, else when its completion arrives (poll)."""
        read.usable = False
        if read.done is not None or read.ticket not in self._read_tickets:
            self.staging.release(read.buf)
        if self._reads.get(id(read.extent)) is read:
            del self._reads[id(read.extent)]

    def _expire_prefetches(self) -> None:
        """Reads nobody consumed within `prefetch_ttl_s` (an unused prefetch, or a restore whose
        request went away while waiting) give their staging back."""
        now = time.monotonic()
        for read in list(self._reads.values()):
            if now - read.started > self.prefetch_ttl_s:
                self.metrics.inc("prefetch_abandoned")
                self._abandon(read)

    def _pack(self, slots: torch.Tensor, buf: torch.Tensor) -> None:
        if self.view.device.type == "cpu":
            pack_kv(self.view, slots, buf)
            return
        tmp = torch.empty(buf.numel(), dtype=torch.uint8, device=self.view.device)
        pack_kv(self.view, slots, tmp)
        buf.copy_(tmp)  # synchronous: the slots may be reused once this returns


def _needs(refs: Sequence[SpillRef]) -> dict[int, tuple[Extent, int]]:
    """Per extent (by identity): the extent and how many of its leading tokens the refs need."""
    needs: dict[int, tuple[Extent, int]] = {}
    for ref in refs:
        _, need = needs.get(id(ref.extent), (ref.extent, 0))
        needs[id(ref.extent)] = (ref.extent, max(need, ref.offset + ref.count))
    return needs


class Readiness(enum.Enum):
    READY = "ready"  # every byte is in staging or read and verified
    PENDING = "pending"  # reads in flight
    FAILED = "failed"  # a read failed or could not start: recompute


@dataclass(eq=False)
class PendingRead:
    """One load of an extent's prefix into staging; shared by a prefetch and the restore using it."""

    extent: Extent
    ticket: Ticket
    buf: torch.Tensor
    nbytes: int
    started: float
    prefetched: bool
    done: Completion | None = None
    usable: bool = True
    deferred: bool = False  # a restore already found it pending
