"""What a failed job of the Mooncake backend leaves (`Failures.classify`): its status (an object gone
is a clean MISS, a newer format's header a MISS kept in the store), a failure of the store logged
(rate-limited), a bad extent's header removed (`drop`), and a key that did not load forgotten. The
tier counts the status when it posts it (`COUNTER_OF`).

Chunk names are unique per publish (client.py): a chunk that fails its checksum under a header
still the one the load verified is that extent's (CORRUPT, the header dropped); under a header
replaced since, a MISS (`still`; nothing removed)."""

from __future__ import annotations

import threading

from sgl_hicache.tier.faults import Counters, FaultLog, logger
from sgl_hicache.tier.format import FormatError, Mismatch, NewerFormat
from sgl_hicache.tier.keys import ExtentKey
from sgl_hicache.tier.mooncake import objects
from sgl_hicache.tier.mooncake.client import Names, StoreClient
from sgl_hicache.tier.mooncake.recent import RecentExtents
from sgl_hicache.tier.mooncake.scratch import ScratchExhausted
from sgl_hicache.tier.results import Op, Status

COUNTER_OF = {Status.MISS: "misses", Status.CORRUPT: "checksum_failures", Status.MISMATCH: "mismatches",
              Status.NO_SPACE: "no_space", Status.IO_ERROR: "io_errors"}  # fmt: skip


class Failures:
    """`index` is the tier's, guarded by its `lock`."""

    def __init__(self, client: StoreClient, names: Names, lock: threading.Lock, index: RecentExtents,
                 counters: Counters, faults: FaultLog, where: str) -> None:  # fmt: skip
        self._client, self._names, self._lock, self._index = client, names, lock, index
        self._counters, self._faults, self._where = counters, faults, where

    def classify(self, op: Op, key: ExtentKey, salt: bytes | None, err: Exception,
                 seen: objects.Opened | None = None) -> Status:  # fmt: skip
        """The status of a failed job, after its side effects: a bad extent dropped, a failure of the
        store logged (rate-limited), a key that did not load forgotten. `seen`: the header the load
        verified, if it got that far (its chunks then failed)."""
        if isinstance(err, objects.Gone):
            status = Status.MISS
        elif isinstance(err, NewerFormat):  # a newer server's extent: kept for it, never corrupt
            status = Status.MISS
            self._counters.add("newer_extents")
        elif isinstance(err, FormatError) and seen is not None and not self.still(key, seen):
            # The key was re-published (or removed) since the load verified its header: not this
            # extent's fault. Nothing is removed.
            status = Status.MISS
        elif isinstance(err, FormatError):
            status = Status.MISMATCH if isinstance(err, Mismatch) else Status.CORRUPT
            self.drop(key, salt)
        elif isinstance(err, objects.StoreFailed):
            status = Status.NO_SPACE if err.reply.no_space and op is Op.STORE else Status.IO_ERROR
            self._faults.report(op, err, self._where)
        elif isinstance(err, ScratchExhausted):  # counted and rate-limited as the store's failures
            status = Status.IO_ERROR
            self._faults.report(op, err, self._where)
        else:
            status = Status.IO_ERROR
            logger.error("spill tier (mooncake) %s job failed unexpectedly", op.value, exc_info=err)
        if op is Op.LOAD:
            with self._lock:
                self._index.forget(key)
        return status

    def still(self, key: ExtentKey, seen: objects.Opened) -> bool:
        """Whether `key`'s header is still the one a failed load verified (then the failure is that
        extent's; chunk names are unique per publish, so no other publish's chunk was read). A
        store that does not answer proves nothing: not still (a miss, nothing removed). The store
        has no compare-and-delete: a re-publish landing after this check and before `drop`'s
        remove loses its header (a miss for every reader, stored again on the next spill; never
        wrong bytes)."""
        try:
            return objects.header_is(self._client, self._names, key, seen.salt, seen.raw)
        except Exception:
            return False

    def drop(self, key: ExtentKey, salt: bytes | None) -> None:
        """Remove a bad extent's header (its chunks are left to the master's eviction). The key
        leaves the index even if the removal raises (which propagates): it claims no bad extent."""
        try:
            self._client.remove(self._names.header(key, salt))
        finally:
            with self._lock:
                self._index.forget(key)
