"""Host staging memory for spills in flight, bounded by `--hicache-spill-staging`.

A spilled node's packed KV lives in a staging buffer from the pack until the tier reports the write
finished (the tier holds the buffer until then). When the budget is used up, `acquire` returns None
and the caller drops the victim instead of spilling it: eviction never waits for the disk.
"""

from __future__ import annotations

import threading

import torch

from sgl_hicache.tier import alloc_aligned


class StagingPool:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._used = 0
        self.peak_bytes = 0  # high-water mark since start (to size the budget from measurement)
        self.refused = 0  # acquisitions refused for lack of budget (not those held to a lower limit)
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._used

    def acquire(self, nbytes: int, limit_bytes: int | None = None) -> torch.Tensor | None:
        """A page-aligned uint8 host tensor of `nbytes`, or None if that would take the bytes in use
        past `limit_bytes` (default: the whole budget; a lower limit keeps the rest for others, and
        its refusals are the caller's to count, not `refused`). Never blocks."""
        limit = self.capacity_bytes if limit_bytes is None else min(limit_bytes, self.capacity_bytes)
        with self._lock:
            if self._used + nbytes > limit:
                self.refused += limit_bytes is None
                return None
            self._used += nbytes
            self.peak_bytes = max(self.peak_bytes, self._used)
        return (
            torch.frombuffer(alloc_aligned(nbytes), dtype=torch.uint8)
            if nbytes
            else torch.empty(0, dtype=torch.uint8)
        )

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._used -= buf.numel()
            assert self._used >= 0, f"staging accounting went negative: {self._used}"
