"""The directory-wide half of the budget (`capacity.ProcessBudget` calls it): leases from the root's ledger.

After `ProcessBudget` has made room in this process's own index, `reserve` leases the bytes from the
ledger (ledger.py), which every process sharing the root updates under one lock. When the root is
over budget, victims are taken oldest first across two lists: our index in LRU order (an entry's
`used_at`: publish or last use) and the extents we do not index (other processes' files, by mtime;
a load refreshes its file's mtime, `touch_file`). Unlinking another process's file is safe: for
that process it is a clean miss (its loads MISS and forget the key; its stores re-check the file
before answering "present", publish.py). Every extent unlinked here takes its aliases with it
(aliases.py: read from the file just before the unlink, removed after the ledger transaction,
outside the lock).

Other processes (`Tier.shared`): `others_seen` turns True for good at the first sign that another
process uses the root: the ledger's (another process's mark, lease or write, ledger.py), or a
listing of the root that finds an extent we do not index or another writer's temp file (at open,
and whenever others' extents are listed again). The tier adds the signs only it sees (file/backend.py).
`refresh` looks for them without a store: an I/O thread runs it at open and every REFRESH_S
(file/backend.py), so a process that never stores learns of another within about that. Without a ledger
(`NoLocks` at open) budget calls are no-ops and only the per-process budget holds; the root is
then listed at open and at most every PRIVATE_RELIST_S by a store or a refresh, until something
foreign is found.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Protocol

from sgl_hicache.tier.faults import Counters, FaultLog, logger
from sgl_hicache.tier.file.aliases import recorded, unlink_aliases
from sgl_hicache.tier.file.budget.filelock import NoLocks
from sgl_hicache.tier.file.budget.index import Entry, Index, OverBudget
from sgl_hicache.tier.file.budget.ledger import Ledger, open_ledger
from sgl_hicache.tier.file.owner import me
from sgl_hicache.tier.file.paths import ExtentPaths, temp_writer
from sgl_hicache.tier.file.sweep import FOREIGN_RETRY_S, FileStat, Foreign, unlink_sized, walk_root
from sgl_hicache.tier.keys import ExtentKey
from sgl_hicache.tier.results import Op

PRIVATE_RELIST_S = 30.0
REFRESH_S = 1.0  # how often an I/O thread looks for other processes (`refresh`)
NO_GENERATION = -1  # what `reserve` returns without a ledger


class LocalBudget(Protocol):
    """What the shared budget needs of this process's own (`capacity.ProcessBudget`)."""

    lock: threading.Lock  # guards `index` and `writing`
    index: Index
    writing: set[ExtentKey]  # keys of our stores in flight (their files are ours, not yet indexed)
    paths: ExtentPaths
    counters: Counters
    faults: FaultLog

    @property
    def capacity_bytes(self) -> int: ...

    def buried(self, key: ExtentKey, entry: Entry) -> None: ...

    def counted_eviction(self, nbytes: int) -> None: ...


class SharedBudget:
    def __init__(self, local: LocalBudget, ledger: Ledger | None) -> None:
        self._local, self.ledger = local, ledger
        self._foreign = Foreign(self._indexed)
        self._pressed = False  # the last reservation had to evict: keep the foreign list fresh
        self._others = False
        self._listed_at = time.monotonic()
        self._doomed: list[tuple[str, tuple[bytes, ...]]] = []  # unlinked under the lock: their aliases
        self._doomed_lock = threading.Lock()
        self._refresh_failing = False  # the last refresh failed: counted and logged already

    @property
    def others_seen(self) -> bool:
        """Whether another process was seen using the root (see the module doc). Never blocks."""
        return self._others or (self.ledger is not None and self.ledger.others_seen)

    def saw_others(self) -> None:
        self._others = True

    def refresh(self) -> None:
        """Look for other processes without a store (see the module doc): the ledger's marks and
        changes (`Ledger.look`, which also keeps our own mark), or without a ledger a listing when
        one is due. Runs on an I/O thread; never waits on another process. Never raises: a failure
        (EIO, EACCES, a torn ledger) is counted in `io_errors` and logged once until one succeeds."""
        try:
            if self.ledger is not None:
                self.ledger.look(ask=not self.others_seen)
            elif not self._others and time.monotonic() - self._listed_at >= PRIVATE_RELIST_S:
                self._listed(walk_root(self._local.paths.root))
        except Exception as e:  # OSErrors, and bugs: counted, logged once; the next refresh retries
            if not self._refresh_failing:
                self._local.counters.add("io_errors")
                bug = None if isinstance(e, OSError) else e
                logger.warning("spill tier: looking for other processes on %s failed: %s",
                               self._local.paths.root, e, exc_info=bug)  # fmt: skip
            self._refresh_failing = True
        else:
            self._refresh_failing = False

    def open(self) -> None:
        """Remove stale temp files of every namespace and recount the root (one stat per file,
        under the lock), list the extents we do not index; then enforce the budget."""
        if self.ledger is None:
            self._listed(walk_root(self._local.paths.root))
            return
        self._listed(self.ledger.resync(self))
        with contextlib.suppress(OverBudget):  # others' stores in flight fill it: they will end
            self.reserve(0)

    def _listed(self, files: list[FileStat]) -> None:
        """A fresh listing of the root: the candidates for eviction, and signs of other processes."""
        self._foreign.load(files)
        self._listed_at = time.monotonic()
        if not self._others and any(self._not_ours(f) for f in files):
            self._others = True  # only ever set: a store or load may set it meanwhile

    def _not_ours(self, f: FileStat) -> bool:
        if f.is_temp:
            return temp_writer(f.name) != me()
        with self._local.lock:  # per file: never held for a whole listing
            return not self._indexed(f.path)

    def reserve(self, nbytes: int) -> int:
        """Lease `nbytes` of the root's budget, evicting oldest first; returns the ledger generation
        to give back to commit/release/retract. Raises OverBudget, FileNotFoundError (the root is
        gone: re-create it and retry), OSError."""
        if self.ledger is None:
            if not self.others_seen and time.monotonic() - self._listed_at >= PRIVATE_RELIST_S:
                self._listed(walk_root(self._local.paths.root))
            return NO_GENERATION
        ledger = self.ledger
        if self._pressed and self._foreign.due():
            self._listed(walk_root(ledger.root))  # outside the lock: stat only
        try:
            return self._reserve(ledger, nbytes)
        except OverBudget:
            if not self._foreign.due(FOREIGN_RETRY_S):
                raise
            self._listed(walk_root(ledger.root))  # others published since: list them
            return self._reserve(ledger, nbytes)

    def _reserve(self, ledger: Ledger, nbytes: int) -> int:
        try:
            reserved = ledger.reserve(nbytes, self)
        finally:
            self._unalias_doomed()
        self._pressed = reserved.pressed
        return reserved.generation

    def still_leased(self, generation: int) -> bool:
        """Whether bytes leased as `generation` are still in the root's ledger (`Ledger.current`)."""
        return self.ledger is None or self.ledger.current(generation)

    def commit(self, nbytes: int, generation: int) -> None:
        """A published store's lease becomes published bytes. Never raises: if the ledger cannot
        be written, the bytes stay leased (counted all the same) until the lease ends."""
        if self.ledger is not None:
            self._never_raise(partial(self.ledger.commit, nbytes, generation))

    def release(self, nbytes: int, generation: int) -> None:
        if self.ledger is not None:
            self._never_raise(partial(self.ledger.release, nbytes, generation))

    def retract(self, path: str, nbytes: int, generation: int) -> None:
        """Unlink a file we published whose store failed, ending its lease; raises OSError if the
        file could not be unlinked (it is then counted as published)."""
        if self.ledger is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return
        self.ledger.retract(path, nbytes, generation)

    def _never_raise(self, op: Callable[[], None]) -> None:
        try:
            op()
        except OSError as e:  # counted and logged; the ledger only over-counts meanwhile
            self.unlink_failed(e, str(self.ledger.path if self.ledger else ""))

    def unlink(self, path: str) -> bool:
        """Unlink one of our extent files, accounted, and its aliases; False if it was gone.
        Raises OSError."""
        aliases = recorded(path)
        removed = self._unlink_accounted(path)
        if removed:
            unlink_aliases(path, aliases)
        return removed

    def _unlink_accounted(self, path: str) -> bool:
        if self.ledger is not None:
            return self.ledger.remove(path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        return True

    # -- the ledger's LedgerClient: asked and called during a reservation ---------------------

    @property
    def capacity_bytes(self) -> int:
        """The budget a reservation must fit: this process's (`ProcessBudget.capacity_bytes`)."""
        return self._local.capacity_bytes

    def evict(self, short: int) -> int:
        """Called with the ledger locked: unlink oldest-first victims until `short` bytes are freed."""
        freed = 0
        while freed < short:
            victim = self._next_victim()
            if victim is None:
                break
            freed += victim()
        return freed + (self._unlink_dying(short - freed) if freed < short else 0)

    def removed_temps(self, count: int) -> None:
        self._local.counters.add("removed_temp_files", count)

    def unlink_failed(self, error: OSError, where: str = "unlink") -> None:
        self._local.counters.add("io_errors")
        self._local.faults.report(Op.STORE, error, where)

    # -- victims ------------------------------------------------------------------------------

    def _unlink_dying(self, short: int) -> int:
        """Unlink victims that other threads of ours took out of the index and are about to unlink
        (they wait for this lock): their room is ours to count now, as the local budget already
        does. Their own unlink then finds nothing and subtracts nothing."""
        with self._local.lock:
            dying = list(self._local.index.dying_keys)
        freed = 0
        for key in dying:
            if freed >= short:
                break
            freed += self._guarded(str(self._local.paths.extent(key)), None) or 0
        return freed

    def _next_victim(self) -> Callable[[], int] | None:
        with self._local.lock:
            local, other = self._local.index.oldest_unpinned(), self._foreign.peek()
            if local is not None and (other is None or local[1].used_at <= other.mtime):
                self._local.index.kill([local])
                return partial(self._unlink_local, *local)
            if other is not None:
                self._foreign.pop()
                return partial(self._unlink_other, other.path, other.mtime)
        return None

    def _unlink_local(self, key: ExtentKey, entry: Entry) -> int:
        freed = self._guarded(str(self._local.paths.extent(key)), None)
        self._local.buried(key, entry)
        return freed or 0

    def _unlink_other(self, path: str, mtime: float) -> int:
        freed = self._guarded(path, mtime)
        if freed is not None:
            self._local.counted_eviction(freed)
        return freed or 0

    def _guarded(self, path: str, not_newer_than: float | None) -> int | None:
        """Unlink a victim (under the ledger lock); its aliases are removed after the transaction."""
        aliases = recorded(path)
        try:
            freed = unlink_sized(path, not_newer_than)
        except OSError as e:
            self.unlink_failed(e)
            return None
        if freed is not None and aliases:
            with self._doomed_lock:
                self._doomed.append((path, aliases))
        return freed

    def _unalias_doomed(self) -> None:
        with self._doomed_lock:
            doomed, self._doomed = self._doomed, []
        for path, aliases in doomed:
            unlink_aliases(path, aliases)

    def _indexed(self, path: str) -> bool:
        """Whether `path` is one of our extents (indexed, or being stored); call under the lock."""
        name = os.path.basename(path)
        if os.path.dirname(os.path.dirname(path)) != str(self._local.paths.ns_dir):
            return False
        with contextlib.suppress(ValueError):
            key = ExtentKey(bytes.fromhex(name.split(".")[0]))
            index = self._local.index
            return key in index or key in index.dying_keys or key in self._local.writing
        return False


def open_shared_ledger(root: Path) -> Ledger | None:
    """The root's ledger, or None (logged) where POSIX locks do not work: then this process keeps
    its own budget, and N processes sharing the directory may use N x capacity (ledger.py)."""
    try:
        return open_ledger(root)
    except NoLocks as e:
        logger.warning("spill tier budget is per process, not per directory: %s", e)
        return None
