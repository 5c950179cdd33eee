"""The byte budget and free-space watermark: reservations, LRU eviction, unlinking victims.

`ProcessBudget` owns the index and the lock that guards it; FileTier takes `budget.lock` for index reads.
Unlinks happen outside the lock; the bytes of a victim count as on disk until it is buried.
The directory-wide budget, shared with every process using the same root, is `shared.SharedBudget`:
`make_room` reserves there after making room here, and every unlink goes through it.

A store's `Reservation` ends in exactly one of: `commit` (published: indexed and counted),
`release` (failed, nothing left on disk), `retract` (published, but the store failed after the
rename: the file is unlinked, or kept indexed and counted if that fails too) or `orphaned` (failed,
and its temp file could not be removed: it stays counted as published until a sweep removes it).
So every byte a store leaves under the root is counted, whatever fails.
"""

from __future__ import annotations

import errno
import threading
import time
from dataclasses import dataclass

from sgl_hicache.config import TierConfig
from sgl_hicache.tier.faults import Counters, FaultLog
from sgl_hicache.tier.file.budget.index import Entry, Index, OverBudget
from sgl_hicache.tier.file.budget.ledger import Ledger
from sgl_hicache.tier.file.budget.shared import NO_GENERATION, SharedBudget
from sgl_hicache.tier.file.integrity import check_files
from sgl_hicache.tier.file.paths import ExtentPaths, free_bytes
from sgl_hicache.tier.file.volume import FreeSpace
from sgl_hicache.tier.keys import ExtentKey
from sgl_hicache.tier.results import Op

ROOM_WAIT_S = 30.0


@dataclass(frozen=True)
class Reservation:
    """Room made for one store of `key`: `nbytes` here and in the root's ledger `generation`."""

    key: ExtentKey
    nbytes: int
    generation: int


class ProcessBudget:
    def __init__(
        self, cfg: TierConfig, paths: ExtentPaths, counters: Counters, faults: FaultLog, ledger: Ledger | None
    ) -> None:
        self._cfg, self._paths, self._counters, self._faults = cfg, paths, counters, faults
        self.paths, self.counters, self.faults = paths, counters, faults
        self.index = Index(cfg.capacity_bytes)  # the one read of the capacity: the others ask here
        self.writing: set[ExtentKey] = set()  # keys of our stores between make_room and their end
        self.lock = threading.Lock()
        self._room = threading.Condition(self.lock)  # notified when reserved or dying bytes drop
        self.shared = SharedBudget(self, ledger)
        self.free_space = FreeSpace(paths.ns_dir, cfg.min_free_bytes)

    @property
    def capacity_bytes(self) -> int:
        """The tier's byte budget (`TierConfig.capacity_bytes`), as its index bounds it."""
        return self.index.capacity

    def check(self, res: Reservation) -> None:
        """Raise FileNotFoundError if `res` is no longer leased in the root's ledger (the root was
        removed and re-created since): the store then re-creates what is missing and leases again."""
        if not self.shared.still_leased(res.generation):
            raise FileNotFoundError(errno.ENOENT, f"{self.paths.root}: re-created since the reservation")

    def commit(self, res: Reservation, entry: Entry) -> None:
        """A store's file is published: its reservation becomes an index entry, in one step."""
        self._end_local(res, entry)
        self.shared.commit(res.nbytes, res.generation)

    def release(self, res: Reservation) -> None:
        """A store failed and left nothing on disk: its reservation ends, here and in the ledger."""
        self._end_local(res)
        self.shared.release(res.nbytes, res.generation)

    def retract(self, res: Reservation, entry: Entry) -> None:
        """A store failed after its file was published (fsync=full: the directory's fsync after the
        rename). Unlinked under the ledger lock, its lease ended, rather than kept: the store
        reports failure, so the cache keeps no reference to it, and `full` promised a publish that
        survives power loss, which this one may not; a kept file would hold budget that nobody
        asked for and break "a failed store is never visible". If that unlink fails too (counted,
        logged; e.g. the filesystem went read-only after the journal error), the file is kept,
        indexed and counted as published, so the budget holds either way."""
        try:
            self.shared.retract(str(self.paths.extent(res.key)), res.nbytes, res.generation)
        except OSError as e:
            self.shared.unlink_failed(e)
            self._end_local(res, entry)
            return
        self._end_local(res)

    def orphaned(self, res: Reservation) -> None:
        """A store failed and its temp file could not be removed: the file's bytes stay counted, as
        published (what a recount of the files says), until a sweep removes it (stale by age)."""
        self._end_local(res)
        self.shared.commit(res.nbytes, res.generation)

    def _end_local(self, res: Reservation, entry: Entry | None = None) -> None:
        with self.lock:
            self.index.release(res.nbytes)
            self._room.notify_all()
            self.writing.discard(res.key)
            if entry is not None:
                self.index.add(res.key, entry)

    def adopt(self, key: ExtentKey, entry: Entry) -> None:
        """Index `key`, whose file another process (or an earlier one) published, as a store of it
        would have: making room in this process's budget first (its bytes are in the ledger
        already). Not indexed if nothing can be evicted for it (all pinned). Touched if indexed."""
        with self.lock:
            if key in self.index:
                self.index.touch(key)
                return
            index = self.index
            victims = index.evict(
                index.used_bytes + index.reserved + index.dying + entry.file_bytes - index.capacity
            )
            if victims is not None:
                index.add(key, entry)
        self.unlink(victims or [])

    def enforce_budget(self) -> None:
        with self.lock:
            victims = self.index.evict(self.index.used_bytes - self.capacity_bytes) or []
        self.unlink(victims)

    def make_room(self, nbytes: int, key: ExtentKey) -> Reservation:
        """Reserve `nbytes` of budget and free space for a store of `key`, evicting LRU extents;
        raises OverBudget, FileNotFoundError (the root is gone), OSError.

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
            if victims is not None:
                self.writing.add(key)
        if victims is None:
            raise OverBudget(f"{nbytes} B does not fit: capacity {self.capacity_bytes} B, rest pinned")
        self.unlink(victims)
        try:
            generation = self.shared.reserve(nbytes)  # the directory's budget, shared with other processes
        except BaseException:
            self._end_local(Reservation(key, nbytes, NO_GENERATION))
            raise
        res = Reservation(key, nbytes, generation)
        try:
            self._keep_free(nbytes)
        except BaseException:
            self.release(res)
            raise
        return res

    def _keep_free(self, nbytes: int) -> None:
        """Evict until writing `nbytes` leaves `min_free_bytes` on the volume (counted apart from
        the budget's evictions: `free_space_evictions`); raises OverBudget."""
        free = free_bytes(self._paths.ns_dir)
        self.free_space.record(free)
        if free is None or free >= self._cfg.min_free_bytes + nbytes:
            return
        with self.lock:
            victims = self.index.evict(self._cfg.min_free_bytes + nbytes - free)
        if victims is None:
            raise OverBudget(f"volume free space ({free} B) would drop below {self._cfg.min_free_bytes} B")
        self.free_space.forced_eviction(free, nbytes)
        self.unlink(victims, free_space=True)
        self.free_space.refresh()

    def unlink(self, victims: list[tuple[ExtentKey, Entry]], free_space: bool = False) -> None:
        """Unlink evicted `victims`; `free_space`: the volume's free space forced it, not the budget."""
        for key, entry in victims:
            self.remove_file(key)
            self.buried(key, entry, free_space)

    def buried(self, key: ExtentKey, entry: Entry, free_space: bool = False) -> None:
        """Victim `key` (taken out of the index by `Index.kill`) is unlinked: count it, wake waiters."""
        self.counted_eviction(entry.file_bytes, free_space)
        with self.lock:
            self.index.buried(key, entry.file_bytes)
            self._room.notify_all()

    def unlinked(self, key: ExtentKey, nbytes: int) -> None:
        """`key`, marked dying by a drop or purge (../retain.py), is unlinked: no eviction counted."""
        with self.lock:
            self.index.buried(key, nbytes)
            self._room.notify_all()

    def counted_eviction(self, nbytes: int, free_space: bool = False) -> None:
        count, size = (
            ("free_space_evictions", "free_space_evicted_bytes")
            if free_space
            else ("evictions", "evicted_bytes")
        )
        self._counters.add(count)
        self._counters.add(size, nbytes)

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

    def drop_if(self, key: ExtentKey, seen: Entry | None) -> None:
        """`drop` the bad file a load read, unless `key` was published anew since the load began
        (its index entry is no longer `seen`, or a store of it is being written): the file at the
        path is then the new one, not the one found bad."""
        with self.lock:
            if self.index.get(key) is not seen or key in self.writing:
                return
            self.index.remove(key)
        self.remove_file(key)
        self._counters.add("removed_bad_files")

    def check_integrity(self) -> None:
        """The index's accounting holds, and its files are on disk with their sizes (`check_files`)."""
        with self.lock:
            self.index.check()
            files = {key: entry.file_bytes for key, entry in self.index.items()}
        check_files(self._paths, files)
