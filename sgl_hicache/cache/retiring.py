"""Staging blocks on their way back: a block goes back to staging only once every copy using it is
done (the pack that filled it, the last unpack that read it), so no device copy ever reads or writes
a block another store or read has taken since. The controller owns one; the copies are
`CopyEngine`'s (on CPU they are done when enqueued).

A read's block that a transfer the tier gave up on may still write (`Completion.dest_unsafe`) never
goes back (`spoil`): no later read or pack could then find bytes changed after they were verified
or packed. Each rank of a TP group sets aside its own; nothing agreed depends on staging's size
(a read or a spill it refuses is a local verdict, agreed as any other)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from sgl_hicache.cache.device import Copy
from sgl_hicache.cache.metrics import SpillMetrics
from sgl_hicache.cache.staging import StagingPool

logger = logging.getLogger(__name__)


class Retiring:
    def __init__(self, staging: StagingPool, metrics: SpillMetrics) -> None:
        self.staging = staging
        self.metrics = metrics
        self._spoil_logged = self._spoil_share_logged = False
        self._readers: dict[int, Copy] = {}  # staging block (data_ptr) -> the last unpack reading it
        self._waiting: list[
            tuple[torch.Tensor, list[Copy]]
        ] = []  # blocks released once their copies are done

    def reading(self, buf: torch.Tensor, copy: Copy) -> None:
        """`copy` (an unpack) reads staging block `buf`: its release waits for it."""
        if buf.numel():
            self._readers[buf.data_ptr()] = copy

    def busy(self, buf: torch.Tensor) -> bool:
        """Whether an unpack still reads staging block `buf` (given back, it would not be free yet)."""
        reader = self._readers.get(buf.data_ptr()) if buf.numel() else None
        return reader is not None and not reader.done

    def retire(self, buf: torch.Tensor, copy: Copy | None = None) -> None:
        """Give a staging block back once the copies using it are done (`copy`, and the last unpack
        that read it); at once if they are."""
        reader = self._readers.pop(buf.data_ptr(), None) if buf.numel() else None
        pending = [c for c in (copy, reader) if c is not None and not c.done]
        if pending:
            self._waiting.append((buf, pending))
        else:
            self.staging.release(buf)

    def spoil(self, buf: torch.Tensor) -> None:
        """Never give a read's staging block back: a transfer may still write it. Set aside for good
        (`StagingPool.spoil`; an unpack still reading its verified part needs nothing more: nobody
        else will take it), counted in `staging_spoiled_bytes`, logged once."""
        if buf.numel():
            self._readers.pop(buf.data_ptr(), None)
        nbytes = self.staging.spoil(buf)
        self.metrics.inc("staging_spoiled_bytes", nbytes)
        gone = self.staging.spoiled_bytes
        if nbytes and not self._spoil_share_logged and gone * 4 > gone + self.staging.capacity_bytes:
            self._spoil_share_logged = True
            logger.error("sgl_hicache: over a quarter of staging (%d B) is set aside for reads whose "
                         "transfers the tier gave up on; restores and spills now have %d B, at most %d B "
                         "in one block (restart the server to get it back; see the tier's I/O errors)",
                         gone, self.staging.capacity_bytes, self.staging.largest_bytes)  # fmt: skip
        if nbytes and not self._spoil_logged:
            self._spoil_logged = True
            logger.warning("sgl_hicache: a tier read failed with its transfer maybe still writing its staging "
                           "block: %d B of staging set aside for good (%d B left; later ones are only "
                           "counted in staging_spoiled_bytes)", nbytes, self.staging.capacity_bytes)  # fmt: skip

    def release_done(self) -> None:
        """Give back the blocks whose copies are done now."""
        waiting, self._waiting = self._waiting, []
        for buf, copies in waiting:
            if all(c.done for c in copies):
                self.staging.release(buf)
            else:
                self._waiting.append((buf, copies))

    def blocks(self) -> Iterator[torch.Tensor]:
        """The blocks still waiting for their copies."""
        return (buf for buf, _ in self._waiting)
