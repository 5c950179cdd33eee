"""Host staging memory for spills and restores in flight: one arena of `--hicache-spill-staging`
bytes, allocated once (and, on a GPU, registered with the driver once: pinned), handed out in
page-aligned blocks.

A spilled node's packed KV lives in a block from its pack until the tier reports the write finished;
a restore's read lives in one from the load until its unpack completed. When no block fits,
`acquire` returns None and the caller drops the victim (or recomputes): nothing ever waits for the
disk. Why one arena: a device copy to or from pageable memory is synchronous (the driver stages it
through its own pinned buffer), and registering memory per copy costs more than the copy; sglang's
HiCache host pool is one pinned allocation for the same reason.

Blocks are first-fit over a free list kept sorted and coalesced, so fragmentation can refuse a
block while as many bytes are free in pieces; `refused` counts those refusals with the others.

A block that a transfer the tier gave up on may still write (`Completion.dest_unsafe`) is never
given back: `spoil` sets it aside for good, and staging shrinks by it (`capacity_bytes`).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
from collections.abc import Callable, Sequence

import torch

from sgl_hicache.tier import alloc_aligned

logger = logging.getLogger(__name__)

ALIGN = 4096  # direct I/O wants page-aligned buffers


class StagingPool:
    """`alloc` makes the arena (the tier's `host_memory`: memory it moves bytes through best)."""

    def __init__(self, capacity_bytes: int, alloc: Callable[[int], memoryview] = alloc_aligned) -> None:
        self.capacity_bytes = capacity_bytes
        self._size = _round(capacity_bytes)  # the arena is whole pages: every block in it is too
        self._arena = torch.frombuffer(alloc(max(self._size, ALIGN)), dtype=torch.uint8)
        self._free: list[tuple[int, int]] = [(0, self._size)]  # (offset, size), by offset
        self._blocks: dict[int, tuple[int, int]] = {}  # data_ptr -> (offset, size) of blocks in use
        self._spoiled: list[tuple[int, int]] = []  # (offset, size) of blocks set aside for good
        self._used = 0
        self._held = 0  # bytes of the blocks in use (whole pages)
        self.peak_bytes = 0  # high-water mark since start (to size the budget from measurement)
        self.refused = 0  # acquisitions refused for lack of room (not those held to a lower limit)
        self.pinned = False
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def free_block_bytes(self) -> int:
        """The arena's bytes in no block: what blocks (whole pages, `block_bytes`) may still take,
        in pieces if it is fragmented."""
        return self._size - self._held - self.spoiled_bytes

    @property
    def spoiled_bytes(self) -> int:
        """The bytes of the blocks set aside for good (`spoil`): no longer staging."""
        return sum(size for _, size in self._spoiled)

    @property
    def largest_bytes(self) -> int:
        """The most one block could ever take: all of staging, or, once blocks were set aside
        (`spoil`), the longest run of the arena between them (a read or spill larger than this can
        never start: it is too large, not waiting for room)."""
        with self._lock:
            if not self._spoiled:
                return self.capacity_bytes
            edges = [(0, 0), *sorted(self._spoiled), (self._size, 0)]
        gaps = (start - (at + size) for (at, size), (start, _) in itertools.pairwise(edges))
        return min(self.capacity_bytes, max(gaps))

    @staticmethod
    def block_bytes(nbytes: int) -> int:
        """The bytes of the block `acquire(nbytes)` takes: whole pages."""
        return _round(nbytes)

    @property
    def arena(self) -> memoryview:
        """The whole arena (for a tier that maps it once: `Tier.register_host_memory`)."""
        return self._arena.numpy().data

    def pin(self) -> bool:
        """Register the arena with the CUDA driver (page-locked), once; whether it is pinned. A
        failure is logged and copies then run synchronously through the driver's own staging."""
        if self.pinned or not torch.cuda.is_available():
            return self.pinned
        err = torch.cuda.cudart().cudaHostRegister(self._arena.data_ptr(), self._arena.numel(), 0)
        self.pinned = int(err) == 0
        if not self.pinned:
            logger.warning("sgl_hicache: could not pin %d B of staging (cudaHostRegister: %s); host "
                           "copies will be synchronous", self._arena.numel(), err)  # fmt: skip
        return self.pinned

    def acquire(self, nbytes: int, limit_bytes: int | None = None) -> torch.Tensor | None:
        """A page-aligned uint8 block of `nbytes` in the arena, or None if that would take the bytes
        in use past `limit_bytes` (default: the whole budget; a lower limit keeps the rest for others,
        and its refusals are the caller's to count, not `refused`) or no free block fits. Never blocks."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        limit = self.capacity_bytes if limit_bytes is None else min(limit_bytes, self.capacity_bytes)
        size = _round(nbytes)
        with self._lock:
            if self._used + nbytes > limit:
                self.refused += limit_bytes is None
                return None
            i = next((i for i, (_, free) in enumerate(self._free) if free >= size), None)
            if i is None:
                self.refused += 1
                return None
            offset, free = self._free.pop(i)
            if free > size:
                self._free.insert(i, (offset + size, free - size))
            buf = self._arena[offset : offset + nbytes]
            self._blocks[buf.data_ptr()] = (offset, size)
            self._used += nbytes
            self._held += size
            self.peak_bytes = max(self.peak_bytes, self._used)
        return buf

    def freed_for(self, nbytes: int, bufs: Sequence[torch.Tensor]) -> list[int] | None:
        """Which of `bufs` (blocks in use), given back, would let `acquire(nbytes)` succeed: the
        fewest of the shortest leading run of them that does (those whose blocks lie in the free
        block it would take), by index; None if all of them would not (the room in pieces, or the
        bytes in use over the budget). Changes nothing."""
        size = _round(nbytes)
        with self._lock:
            spans = [self._blocks[buf.data_ptr()] for buf in bufs]
            free = list(self._free)
            for n, span in enumerate(spans):
                _free_span(free, span)  # on a copy of the free list
                run = next(((o, f) for o, f in free if f >= size), None)
                if run is None:
                    continue
                chosen = [i for i in range(n + 1) if run[0] <= spans[i][0] < run[0] + run[1]]
                if self._used - sum(bufs[i].numel() for i in chosen) + nbytes > self.capacity_bytes:
                    chosen = list(range(n + 1))  # within the budget only with the others too
                if self._used - sum(bufs[i].numel() for i in chosen) + nbytes <= self.capacity_bytes:
                    return chosen
        return None

    def release(self, buf: torch.Tensor) -> None:
        if buf.numel() == 0:
            return
        with self._lock:
            offset, size = self._blocks.pop(buf.data_ptr())
            self._used -= buf.numel()
            self._held -= size
            assert self._used >= 0, f"staging accounting went negative: {self._used}"
            _free_span(self._free, (offset, size))

    def spoil(self, buf: torch.Tensor) -> int:
        """Set block `buf` (in use) aside for good instead of releasing it: a transfer may still
        write it. It is never handed out again; its bytes leave `used_bytes` and `capacity_bytes`
        (staging is that much smaller from now). Returns them (whole pages)."""
        if buf.numel() == 0:
            return 0
        with self._lock:
            offset, size = self._blocks.pop(buf.data_ptr())
            self._used -= buf.numel()
            self._held -= size
            self._spoiled.append((offset, size))
            self.capacity_bytes = max(0, self.capacity_bytes - size)
        return size

    def check_integrity(self) -> None:
        """Free blocks, blocks in use and blocks set aside tile the arena exactly; AssertionError
        with the numbers."""
        with self._lock:
            spans = sorted([*self._free, *self._blocks.values(), *self._spoiled])
            end = 0
            for offset, size in spans:
                assert offset == end, f"staging block at {offset} where {end} was expected"
                end = offset + size
            assert end == self._size, f"staging blocks cover {end} B of {self._size} B"
            held = sum(size for _, size in self._blocks.values())
            assert self._held == held, f"staging counts {self._held} B of blocks in use, they hold {held} B"


def _free_span(free: list[tuple[int, int]], span: tuple[int, int]) -> None:
    """Add `span` (offset, size) to the free list `free` (sorted by offset), merged with its free
    neighbours."""
    i = bisect.bisect(free, span)
    free.insert(i, span)
    if i + 1 < len(free) and free[i][0] + free[i][1] == free[i + 1][0]:
        free[i] = (free[i][0], free[i][1] + free.pop(i + 1)[1])
    if i > 0 and free[i - 1][0] + free[i - 1][1] == free[i][0]:
        free[i - 1] = (free[i - 1][0], free[i - 1][1] + free.pop(i)[1])


def _round(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN
