"""The byte budget and free-space watermark: reservations, LRU eviction, unlinking victims.

`Space` owns the index and the lock that guards it; NvmeTier takes `space.lock` for index reads.
Unlinks happen outside the lock; the bytes of a victim count as on disk until it is buried.
The directory-wide budget, shared with every process using the same root, is `shared.SharedBudget`:
`make_room` reserves there after making room here, and every unlink goes through it.
"""

from __future__ import annotations

import threading
import time

from sgl_hicache.config import TierConfig
from sgl_hicache.tier.base import Op
from sgl_hicache.tier.faults import Counters, FaultLog
from sgl_hicache.tier.index import Entry, Index, OverBudget
from sgl_hicache.tier.keys import ExtentKey
from sgl_hicache.tier.ledger import Ledger
from sgl_hicache.tier.paths import ExtentPaths, free_bytes
from sgl_hicache.tier.shared import SharedBudget

ROOM_WAIT_S = 30.0


class Space:
    def __init__(
        self, cfg: TierConfig, paths: ExtentPaths, counters: Counters, faults: FaultLog, ledger: Ledger | None
    ) -> None:
        self._cfg, self._paths, self._counters, self._faults = cfg, paths, counters, faults
        self.paths, self.counters, self.faults = paths, counters, faults
        self.index = Index(cfg.capacity_bytes)
        self.lock = threading.Lock()
        self._room = threading.Condition(self.lock)  # notified when reserved or dying bytes drop
        self.shared = SharedBudget(self, ledger, cfg.capacity_bytes)

    def release(self, nbytes: int, shared: bool = True) -> None:
        """Give back a reservation of a store that failed (here, and unless `shared` is False, in the
        directory's ledger)."""
        with self.lock:
            self.index.release(nbytes)
            self._room.notify_all()
        if shared:
            self.shared.release(nbytes)

    def commit(self, key: ExtentKey, entry: Entry) -> None:
        """A store's file is published: its reservation becomes an index entry, in one step."""
        with self.lock:
            self.index.release(entry.file_bytes)
            self._room.notify_all()
            self.index.add(key, entry)
        self.shared.commit(entry.file_bytes)

    def enforce_budget(self) -> None:
        with self.lock:
            victims = self.index.evict(self.index.used_bytes - self._cfg.capacity_bytes) or []
        self.unlink(victims)

    def make_room(self, nbytes: int, key: ExtentKey) -> None:
        """Reserve `nbytes` of budget and free space, evicting LRU extents; raises OverBudget.

        Waits (up to ROOM_WAIT_S, holding nothing, so it cannot deadlock) while an older copy of
        `key` is being unlinked (lest that unlink remove the new file) and while other running
        stores hold the bytes it needs."""
        with self.lock:
            deadline = time.monotonic() + ROOM_WAIT_S
            while key in self.index.dying_keys and time.monotonic() < deadline:
                self._room.wait(deadline - time.monotonic())  # an older copy of this extent is being unlinked
            victims = self.index.reserve(nbytes)
            while victims is None and self.index.reserved + self.index.dying and time.monotonic() < deadline:
                self._room.wait(deadline - time.monotonic())  # other stores' bytes are in flight
                victims = self.index.reserve(nbytes)
        if victims is None:
            raise OverBudget(f"{nbytes} B does not fit: capacity {self._cfg.capacity_bytes} B, rest pinned")
        self.unlink(victims)
        try:
            self.shared.reserve(nbytes)  # the directory's budget, shared with other processes
        except BaseException:
            self.release(nbytes, shared=False)
            raise
        try:
            self._keep_free(nbytes)
        except BaseException:
            self.release(nbytes)
            raise

    def _keep_free(self, nbytes: int) -> None:
        """Evict until writing `nbytes` leaves `min_free_bytes` on the volume; raises OverBudget."""
        free = free_bytes(self._paths.ns_dir)
        short = 0 if free is None else self._cfg.min_free_bytes + nbytes - free
        if short <= 0:
            return
        with self.lock:
            victims = self.index.evict(short)
        if victims is None:
            raise OverBudget(f"volume free space ({free} B) would drop below {self._cfg.min_free_bytes} B")
        self.unlink(victims)

    def unlink(self, victims: list[tuple[ExtentKey, Entry]]) -> None:
        for key, entry in victims:
            self.remove_file(key)
            self.buried(key, entry)

    def buried(self, key: ExtentKey, entry: Entry) -> None:
        """Victim `key` (taken out of the index by `Index.kill`) is unlinked: count it, wake waiters."""
        self.counted_eviction(entry.file_bytes)
        with self.lock:
            self.index.buried(key, entry.file_bytes)
            self._room.notify_all()

    def counted_eviction(self, nbytes: int) -> None:
        self._counters.add("evictions")
        self._counters.add("evicted_bytes", nbytes)

    def remove_file(self, key: ExtentKey) -> bool:
        try:
            return self.shared.unlink(str(self._paths.extent(key)))
        except OSError as e:
            self._counters.add("io_errors")
            self._faults.report(Op.STORE, e, "unlink")
            return False

    def drop(self, key: ExtentKey) -> None:
        with self.lock:
            self.index.remove(key)
        self.remove_file(key)
        self._counters.add("removed_bad_files")
