"""The directory-wide half of the budget (`capacity.Space` calls it): leases from the root's ledger.

After `Space` has made room in this process's own index, `reserve` leases the bytes from the
ledger (ledger.py), which every process sharing the root updates under one lock. When the root is
over budget, victims are taken oldest first across two lists: our index in LRU order (an entry's
`used_at`: publish or last use) and the extents we do not index (other processes' files, by mtime;
a load refreshes its file's mtime, `touch_file`). Unlinking another process's file is safe: for
that process it is a clean miss (its loads MISS and forget the key; its stores re-check the file
before answering "present", nvme.py).

Without a ledger (`NoLocks` at open), every method is a no-op and only the per-process budget holds.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from sgl_hicache.tier.base import Op
from sgl_hicache.tier.index import Entry, OverBudget
from sgl_hicache.tier.keys import ExtentKey
from sgl_hicache.tier.ledger import Ledger, unlink_sized
from sgl_hicache.tier.scan import temp_still_stale
from sgl_hicache.tier.sweep import FOREIGN_RETRY_S, FileStat, Foreign, walk_root

if TYPE_CHECKING:
    from sgl_hicache.tier.capacity import Space


class SharedBudget:
    def __init__(self, space: Space, ledger: Ledger | None, capacity: int) -> None:
        self._space, self.ledger, self._capacity = space, ledger, capacity
        self._foreign = Foreign(self._indexed)
        self._pressed = False  # the last reservation had to evict: keep the foreign list fresh

    def open(self) -> None:
        """Recount the root (one stat per file, under the lock), remove stale temp files of every
        namespace, list the extents we do not index; then enforce the budget."""
        if self.ledger is not None:
            files = self.ledger.resync()
            self._remove_stale_temps(files)
            self._foreign.load(files)
            with contextlib.suppress(OverBudget):  # others' stores in flight fill it: they will end
                self.reserve(0)

    def _remove_stale_temps(self, files: list[FileStat]) -> None:
        """Stale temp files of every namespace under the root (our own: scan.py did), by the
        scan's rule, accounted."""
        for f in files:
            if f.is_temp and temp_still_stale(f.path) and self._guarded_remove(f.path):
                self._space.counters.add("removed_temp_files")

    def _guarded_remove(self, path: str) -> bool:
        try:
            return self.unlink(path)
        except OSError as e:
            self._space.counters.add("io_errors")
            self._space.faults.report(Op.STORE, e, "unlink")
            return False

    def reserve(self, nbytes: int) -> None:
        """Lease `nbytes` of the root's budget, evicting oldest first; raises OverBudget."""
        if self.ledger is None:
            return
        if self._pressed and self._foreign.due():
            self._foreign.load(walk_root(self.ledger.root))  # outside the lock: stat only
        try:
            self._pressed = self.ledger.reserve(nbytes, self._capacity, self._evict)
        except OverBudget:
            if not self._foreign.due(FOREIGN_RETRY_S):
                raise
            self._foreign.load(walk_root(self.ledger.root))  # others published since: list them
            self._pressed = self.ledger.reserve(nbytes, self._capacity, self._evict)

    def commit(self, nbytes: int) -> None:
        """A published store's lease becomes published bytes. Never raises: if the ledger cannot
        be written, the bytes stay leased (counted all the same) until the lease ends."""
        if self.ledger is not None:
            self._never_raise(self.ledger.commit, nbytes)

    def release(self, nbytes: int) -> None:
        if self.ledger is not None:
            self._never_raise(self.ledger.release, nbytes)

    def _never_raise(self, op: Callable[[int], None], nbytes: int) -> None:
        try:
            op(nbytes)
        except OSError as e:  # counted and logged; the ledger only over-counts meanwhile
            self._space.counters.add("io_errors")
            self._space.faults.report(Op.STORE, e, str(self.ledger.path if self.ledger else ""))

    def unlink(self, path: str) -> bool:
        """Unlink one of our extent files, accounted; False if it was gone. Raises OSError."""
        if self.ledger is None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                return False
            return True
        return self.ledger.remove(path)

    def _evict(self, short: int) -> int:
        """Called with the ledger locked: unlink oldest-first victims until `short` bytes are freed."""
        freed = 0
        while freed < short:
            victim = self._next_victim()
            if victim is None:
                break
            freed += victim()
        return freed + (self._unlink_dying(short - freed) if freed < short else 0)

    def _unlink_dying(self, short: int) -> int:
        """Unlink victims that other threads of ours took out of the index and are about to unlink
        (they wait for this lock): their room is ours to count now, as the local budget already
        does. Their own unlink then finds nothing and subtracts nothing."""
        with self._space.lock:
            dying = list(self._space.index.dying_keys)
        freed = 0
        for key in dying:
            if freed >= short:
                break
            freed += self._guarded(str(self._space.paths.extent(key)), None) or 0
        return freed

    def _next_victim(self) -> Callable[[], int] | None:
        with self._space.lock:
            local, other = self._space.index.oldest_unpinned(), self._foreign.peek()
            if local is not None and (other is None or local[1].used_at <= other.mtime):
                self._space.index.kill([local])
                return partial(self._unlink_local, *local)
            if other is not None:
                self._foreign.pop()
                return partial(self._unlink_other, other.path, other.mtime)
        return None

    def _unlink_local(self, key: ExtentKey, entry: Entry) -> int:
        freed = self._guarded(str(self._space.paths.extent(key)), None)
        self._space.buried(key, entry)
        return freed or 0

    def _unlink_other(self, path: str, mtime: float) -> int:
        freed = self._guarded(path, mtime)
        if freed is not None:
            self._space.counted_eviction(freed)
        return freed or 0

    def _guarded(self, path: str, not_newer_than: float | None) -> int | None:
        try:
            return unlink_sized(path, not_newer_than)
        except OSError as e:
            self._space.counters.add("io_errors")
            self._space.faults.report(Op.STORE, e, "unlink")
            return None

    def _indexed(self, path: str) -> bool:
        name = os.path.basename(path)
        if os.path.dirname(os.path.dirname(path)) != str(self._space.paths.ns_dir):
            return False
        with contextlib.suppress(ValueError):
            return ExtentKey(bytes.fromhex(name.split(".")[0])) in self._space.index
        return False
