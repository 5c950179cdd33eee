"""Host memory a Mooncake real client maps (`SharedMemory`), for the standalone mode (`real_client`).

A server that joins the store through a `mooncake_client` on its host (`setup_dummy`) moves bytes
only through memory that process has mapped: memory made by `MooncakeHostMemAllocator` (a memfd,
mapped shared and populated at once) and registered whole with the store (`register_buffer` of any
other range, or of part of an allocation, is refused). The real client then copies objects into and
out of it itself; a buffer anywhere else is refused by every call that moves bytes (INVALID_PARAMS),
which is why `StoreClient.addressable` tells the two apart.

An allocation is unmapped (`free`) when its last view is gone, never before: a torch tensor made over
it (`torch.frombuffer`, the staging arena) keeps it, as does every slice. The real client keeps its
own mapping until the buffer is unregistered or this client closes.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Any


class SharedMemory:
    """Allocations the real client can map (the module doc); thread-safe."""

    def __init__(self) -> None:
        from mooncake.store import MooncakeHostMemAllocator

        self._allocator: Any = MooncakeHostMemAllocator()
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> memoryview:
        """`nbytes` (at least 1) of shared memory, page-aligned and zeroed; MemoryError if the
        allocator refuses (it raises RuntimeError, or answers 0)."""
        try:
            with self._lock:
                ptr = int(self._allocator.alloc(max(nbytes, 1)))
        except RuntimeError as e:
            raise MemoryError(f"Mooncake could not allocate {nbytes} B of shared memory: {e}") from None
        if ptr == 0:
            raise MemoryError(f"Mooncake could not allocate {nbytes} B of shared memory")
        array = (ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr)
        weakref.finalize(array, self._free, ptr).atexit = False  # never under threads at exit
        return memoryview(array).cast("B")[:nbytes]

    def _free(self, ptr: int) -> None:
        with self._lock:
            self._allocator.free(ptr)
