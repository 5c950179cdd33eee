"""Moving KV between the device pool and the tier: pack → store on spill, load → unpack on restore.

`SpillIO` knows nothing of the radix tree: it turns slot lists into extents and back. Contract:
- `store` never blocks on I/O: it packs into staging (bounded), submits the write and returns the
  new `Extent` (WRITING); None when the tier is unusable or staging is full (the caller drops).
  The caller may free the slots as soon as `store` returns: the pack has completed.
- `poll` (never blocks) moves finished writes to ON_TIER / LOST and frees their staging.
- `restore` is all or nothing: it fills every requested slot, or returns False (the caller frees the
  slots and recomputes). Any tier failure marks the extent LOST; nothing read is used unverified.
  Blocks for the reads (at most `timeout_s`); extents still WRITING are served from staging.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import torch

from sgl_hicache.cache.spill_state import Extent, ExtentState, SpillRef
from sgl_hicache.cache.staging import StagingPool
from sgl_hicache.kernels import KVPoolView, pack_kv, packed_nbytes, unpack_kv
from sgl_hicache.server.metrics import SpillMetrics
from sgl_hicache.tier import ExtentKey, Status, Ticket, Tier

logger = logging.getLogger(__name__)


class SpillIO:
    def __init__(self, tier: Tier, view: KVPoolView, staging: StagingPool, metrics: SpillMetrics,
                 timeout_s: float) -> None:  # fmt: skip
        self.tier = tier
        self.view = view
        self.staging = staging
        self.metrics = metrics
        self.timeout_s = timeout_s
        self._writing: dict[Ticket, Extent] = {}
        self._abandoned: dict[Ticket, torch.Tensor] = {}  # timed-out loads still writing their buffer

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
            abandoned = self._abandoned.pop(done.ticket, None)
            if abandoned is not None:
                self.staging.release(abandoned)
                continue
            extent = self._writing.pop(done.ticket, None)
            if extent is not None:
                self._finish_write(extent, done.ok)

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
        held = staged + sum(buf.numel() for buf in self._abandoned.values())
        assert self.staging.used_bytes == held, f"staging used {self.staging.used_bytes} != held {held}"
        if not self._writing and not self._abandoned:
            self.tier.check_integrity()

    def restore(self, parts: Sequence[tuple[SpillRef, torch.Tensor]]) -> bool:
        """Unpack each ref's tokens into its slots (same length); all or nothing."""
        sources = self._read_extents(parts)
        if sources is None:
            self.metrics.inc("restore_failures")
            return False
        try:
            for ref, slots in parts:
                src = sources[id(ref.extent)][packed_nbytes(self.view, ref.offset) :]
                unpack_kv(self.view, slots, src.to(self.view.device, non_blocking=True))
        finally:
            for extent_id, buf in sources.items():
                if not _is_staged(parts, extent_id, buf):
                    self.staging.release(buf)
        self.metrics.inc("restored_tokens", sum(len(s) for _, s in parts))
        return True

    def _read_extents(self, parts: Sequence[tuple[SpillRef, torch.Tensor]]) -> dict[int, torch.Tensor] | None:
        need: dict[int, int] = defaultdict(int)
        extents: dict[int, Extent] = {}
        for ref, _ in parts:
            extents[id(ref.extent)] = ref.extent
            need[id(ref.extent)] = max(need[id(ref.extent)], ref.offset + ref.count)
        sources: dict[int, torch.Tensor] = {}
        loads: dict[int, tuple[Ticket, torch.Tensor]] = {}
        ok = True
        for eid, extent in extents.items():
            if extent.state is ExtentState.WRITING and extent.staged is not None:
                sources[eid] = extent.staged
            elif extent.state is ExtentState.ON_TIER:
                started = self._submit_load(extent, packed_nbytes(self.view, need[eid]))
                if started is None:
                    ok = False
                    break
                loads[eid] = started
            else:
                ok = False
                break
        for eid, (ticket, buf) in loads.items():
            if self._wait_load(extents[eid], ticket, buf):
                sources[eid] = buf
            else:
                ok = False
        if not ok:
            for eid, buf in sources.items():
                if eid in loads and loads[eid][1] is buf:
                    self.staging.release(buf)
            return None
        return sources

    def _submit_load(self, extent: Extent, nbytes: int) -> tuple[Ticket, torch.Tensor] | None:
        buf = self.staging.acquire(nbytes)
        if buf is None:
            return None
        return self.tier.submit_load(extent.key, buf.numpy(), nbytes), buf

    def _wait_load(self, extent: Extent, ticket: Ticket, buf: torch.Tensor) -> bool:
        try:
            done = self.tier.wait(ticket, timeout=self.timeout_s)
        except TimeoutError:
            self._abandoned[ticket] = buf  # the tier still writes into it; freed by poll()
            logger.warning(
                "sgl_hicache: restore read of %s timed out after %.1fs", extent.key.hex(), self.timeout_s
            )
            return False
        if done.ok:
            self.metrics.inc("restored_bytes", done.nbytes)
            return True
        self.staging.release(buf)
        if done.status in (Status.CORRUPT, Status.MISS):
            self.metrics.inc("corrupt_extents")
        extent.state = ExtentState.LOST
        return False

    def _pack(self, slots: torch.Tensor, buf: torch.Tensor) -> None:
        if self.view.device.type == "cpu":
            pack_kv(self.view, slots, buf)
            return
        tmp = torch.empty(buf.numel(), dtype=torch.uint8, device=self.view.device)
        pack_kv(self.view, slots, tmp)
        buf.copy_(tmp)  # synchronous: the slots may be reused once this returns


def _is_staged(parts: Sequence[tuple[SpillRef, torch.Tensor]], extent_id: int, buf: torch.Tensor) -> bool:
    return any(id(ref.extent) == extent_id and ref.extent.staged is buf for ref, _ in parts)
