"""One byte budget per tier root, shared by every process using it: a ledger file under a POSIX lock.

`<root>/.budget` holds `published` (bytes of extent files under the root, all namespaces) and one
lease per writer with bytes reserved for its stores in flight (their temp files), keyed by
`owner.Writer.token`. Every change happens with the file locked (`fcntl.lockf`, a POSIX record
lock): reserve (evicting, under the lock, until `published + leases + n <= capacity`), commit (a
published store moves its bytes from its lease to `published`), release (a failed store), retract
(a published file whose store failed after all: unlinked, its lease ended), and every unlink of an
extent (`remove`). Invariant, whatever the interleaving of processes: the bytes of extent and temp
files under the root never exceed `published + sum(leases) <= capacity`. The counts may only drift
upward (a crash between a publish and its commit, two processes publishing the same key, files
removed by hand), which costs room, never the bound; `resync` (at every open, at most every
RESYNC_MIN_S when a reservation finds nothing to evict, and at once when a reservation ends the
lease of a dead writer) recounts from the files, and first removes the temp files of dead writers
(`scan.temp_still_stale`: a writer of this host, boot and pid namespace that is gone, or a file
not written for STALE_TEMP_S), so a SIGKILLed writer's temp files stop counting at the next
reservation that needs their room, not at the next open.

Generations: a lease lives in one ledger file. When the root is removed and re-created, a torn
ledger is rebuilt from the files, or our lease in it is not what we left (another process ended it),
the bytes of our stores in flight are no longer in our lease; `reserve` returns the generation it
leased in, and `commit`/`release`/`retract` take bytes back from our lease only in that same
generation (else they would shrink the lease of another store in flight, whose temp file is on
disk: an under-count). While the root is gone (removed, not re-created yet) there is no ledger to
lease from: `reserve` raises FileNotFoundError, which sends the store to re-create the root and
retry, where it used to lease in a scratch state that counted nowhere; and a store whose root was
re-created between its reservation and its temp file's creation finds out (`current`) before it
writes a byte, and leases again.

The lock, and what happens where it does not work (a per-process budget): filelock.py. A process
opens the ledger once per root (`open_ledger`): closing any descriptor of the file would drop the
process's POSIX lock.

Other processes (`others_seen`, for `Tier.shared`): a transaction that finds the file changed
since our own last one (another process wrote it), or a lease that is not ours; and `look`, which
sees the same without writing, and more, at open and every `shared.REFRESH_S` on an I/O thread, so
that a process that never stores learns of the others too: another process's mark (mark.py),
the ledger locked by another process, or the file rewritten since our last look (its mtime: an
identical rewrite, such as another process's open). A second tier of this process on the root
(`attach`) counts too: its evictions are another writer's, whose transactions are ours.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from sgl_hicache.tier.file.budget.filelock import lockf_until, open_private, probe_locks, read_unless_locked
from sgl_hicache.tier.file.budget.index import OverBudget
from sgl_hicache.tier.file.budget.ledger_state import (
    MAX_LEDGER_BYTES,
    Lease,
    LedgerClient,
    Reserved,
    State,
    leased,
)
from sgl_hicache.tier.file.budget.mark import ProcessMark
from sgl_hicache.tier.file.owner import Liveness, Writer, liveness, me
from sgl_hicache.tier.file.scan import STALE_TEMP_S
from sgl_hicache.tier.file.sweep import FileStat, remove_stale_temp, unlink_sized, walk_root
from sgl_hicache.tier.trust import check_trusted

LEDGER_NAME = ".budget"
RESYNC_MIN_S = 30.0
LOCK_WAIT_S = 5.0  # longer, and the operation fails (a store: IO_ERROR) rather than wait on

logger = logging.getLogger(__name__)


class Ledger:
    """The shared budget of one tier root for this process (thread-safe; see the module doc)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.path = self.root / LEDGER_NAME
        self._fd = open_private(self.path)
        self._device, self._inode = os.fstat(self._fd).st_dev, os.fstat(self._fd).st_ino
        self._mutex = threading.Lock()  # POSIX locks do not exclude the threads of one process
        self._users = 0
        self._closed = False
        self._last_resync = -RESYNC_MIN_S
        self._generation = 0  # bumped whenever the leases in the file are not the ones we wrote
        self._mine = 0  # what our lease in the file holds, as far as we know (this generation)
        self._written: bytes | None = None  # what our last transaction left in the file
        self._looked_mtime: int | None = None  # the file's mtime at our first look since then
        self.others_seen = False  # another process wrote the file, holds a lease in it, or a mark
        self._presence = ProcessMark(self.root)
        try:
            probe_locks(self._fd, self.root)
            try:
                self.others_seen = self._presence.mark()
            except OSError as e:  # unmarked (a transaction retries): nobody can be ruled out
                self._unmarked(e)
        except BaseException:
            self._presence.forget()
            os.close(self._fd)
            raise

    @contextlib.contextmanager
    def locked(self) -> Iterator[State]:
        """The state with the file locked; written back on a normal exit. Once closed, or while the
        root is gone, a scratch state that goes nowhere (see `_transaction`)."""
        with self._transaction() as state:
            yield State() if state is None else state

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[State | None]:
        """The state with the file locked; written back on a normal exit. Waits at most
        LOCK_WAIT_S for the lock (a process or host stuck holding it must not hold our I/O threads,
        which loads need too), then raises TimeoutError (an OSError). None where nothing can be
        accounted: once closed (a store abandoned at close still finishing: our leases became
        published at `detach`), or while the root is gone (its ledger and leases went with it)."""
        deadline = time.monotonic() + LOCK_WAIT_S
        if not self._mutex.acquire(timeout=LOCK_WAIT_S):
            raise TimeoutError(errno.ETIMEDOUT, f"{self.path}: busy in this process for {LOCK_WAIT_S} s")
        try:
            if self._closed or not self._lock_current(deadline):
                yield None
                return
            try:
                self._keep_mark()
                state = self._read()
                yield state
                self._write(state)
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN)
        finally:
            self._mutex.release()

    def _keep_mark(self) -> None:
        """Mark the root whose ledger we hold locked, if we lack the mark (after a reopen, below):
        its file is made here, beside the ledger's, never by a `look` of a root being removed."""
        if not self._presence.marked:
            try:
                if self._presence.mark():
                    self.others_seen = True
            except OSError as e:  # no mark, so nobody can be ruled out; the budget is kept all the same
                self._unmarked(e)

    def _unmarked(self, error: OSError) -> None:
        """Our mark could not be taken: the root counts as shared (logged once per Ledger)."""
        if not self.others_seen:
            logger.warning(
                "spill tier: cannot mark %s (%s): the root is treated as shared", self._presence.path, error
            )
        self.others_seen = True

    def _read(self) -> State:
        data = os.pread(self._fd, MAX_LEDGER_BYTES, 0)
        state = State.decode(data)
        if state is None:  # new, torn or foreign: rebuilt from the files, without the leases it held
            if self._written is not None:  # not what we left: another process wrote it
                self.others_seen = True
            state = State()
            self._new_generation()
            self._resync(state)
        elif self._written is not None and data != self._written:
            self.others_seen = True
        held = state.leases.get(me().token)
        if (0 if held is None else held.nbytes) != self._mine:  # rebuilt or reclaimed by another process
            self._new_generation()
            self._mine = 0 if held is None else held.nbytes
        return state

    def _new_generation(self) -> None:
        self._generation += 1
        self._mine = 0

    def _write(self, state: State) -> None:
        mine = me().token
        self.others_seen = self.others_seen or any(token != mine for token in state.leases)
        data = state.encode()
        os.pwrite(self._fd, data, 0)
        os.ftruncate(self._fd, len(data))
        self._written, self._looked_mtime = data, None

    def _lock_current(self, deadline: float) -> bool:
        """Lock the ledger that is at `path` now: one removed with the root (recreate.py) or
        replaced is reopened, so that every process locks the same file. False (nothing locked)
        if the root is gone; raises TimeoutError past `deadline`."""
        while True:
            if self._fd >= 0:
                lockf_until(self._fd, deadline, self.path, LOCK_WAIT_S)
                try:
                    if os.fstat(self._fd).st_ino == os.stat(self.path, follow_symlinks=False).st_ino:
                        return True
                except FileNotFoundError:
                    pass
                except BaseException:
                    fcntl.lockf(self._fd, fcntl.LOCK_UN)
                    raise
                os.close(self._fd)  # drops our lock on the stale file only
                self._fd = -1
            if not self._same_root():
                return False  # gone, or replaced by a directory we may not write into (recreate.py)
            try:
                self._fd = open_private(self.path)
            except FileNotFoundError:
                return False
            self._new_generation()  # another file: the leases of the one before are not in it
            self._inode, self._written, self._looked_mtime = os.fstat(self._fd).st_ino, None, None
            self._presence.forget()  # marked in the file at the path again (`_keep_mark`)

    def _same_root(self) -> bool:
        try:
            check_trusted(self.root)
            return os.stat(self.root).st_dev == self._device
        except OSError:
            return False

    def look(self, ask: bool) -> None:
        """Take our mark where we lack it and, with `ask`, look for another process without writing
        (see the module doc; an I/O thread's refresh). Never waits: while a transaction of ours
        runs it does nothing (that transaction looks). Raises OSError, EBADMSG for a torn ledger
        (rebuilt by the next transaction)."""
        if not self._mutex.acquire(blocking=False):
            return
        try:
            if self._closed:
                return
            # kept from us by one asking: mark again (a held lock in the way is a sign too)
            if not self._presence.marked and self._presence.opened and self._presence.mark():
                self.others_seen = True
            if (
                ask
                and not self.others_seen
                and ((self._presence.marked and self._presence.others()) or self._changed())
            ):
                self.others_seen = True  # only ever set: `attach` and a transaction set it too
        finally:
            self._mutex.release()

    def _changed(self) -> bool:
        """Whether the ledger shows another process now: locked, rewritten or leased by one."""
        if self._fd < 0:  # the root is gone: nothing to look at until a transaction reopens it
            return False
        read = read_unless_locked(self._fd, MAX_LEDGER_BYTES)
        if read is None:  # in another process's transaction now
            return True
        data, mtime = read
        state = State.decode(data)
        if state is None:  # as for a transaction (`_read`): not a sign, and rebuilt by the next one
            raise OSError(errno.EBADMSG, f"{self.path}: torn or foreign; rebuilt at the next store")
        if self._looked_mtime is None:
            self._looked_mtime = mtime
        rewritten = (self._written is not None and data != self._written) or mtime != self._looked_mtime
        return rewritten or any(token != me().token for token in state.leases)

    def reserve(self, nbytes: int, client: LedgerClient) -> Reserved:
        """Lease `nbytes` within `client.capacity_bytes` (this process's budget, asked of its
        owner: processes sharing the root may be configured differently), calling
        `client.evict(short)` under the lock to unlink extents; raises OverBudget, the ledger
        unchanged but for what was evicted or swept, and FileNotFoundError while the root is gone
        (OSError once closed). Dead writers' leases end first, and their temp files go with them."""
        capacity = client.capacity_bytes
        with self._transaction() as state:
            if state is None:
                raise self._unaccountable()
            short = pressed = state.total + nbytes - capacity
            if short > 0 and self._reclaim(state):
                self._resync(state, client)  # a writer died: its temp files go now, not at the next open
                short = state.total + nbytes - capacity
            if short > 0:
                state.published -= client.evict(short)
                short = state.total + nbytes - capacity
            if short > 0 and time.monotonic() - self._last_resync >= RESYNC_MIN_S:
                self._resync(state, client)
                short = state.total + nbytes - capacity
            if short <= 0:
                self._lease(state, nbytes)
            over = _over(nbytes, capacity, state) if short > 0 else None
            generation = self._generation
        if over is not None:
            raise over
        return Reserved(generation, pressed > 0)

    def current(self, generation: int) -> bool:
        """Whether the ledger leased in as `generation` is still the file at the root's path (one
        stat, no lock). A store checks it once its temp file exists: if the root was removed and
        re-created meanwhile, the new ledger does not hold its lease, and it must not write there."""
        try:
            inode = os.stat(self.path, follow_symlinks=False).st_ino
        except OSError:
            return False
        return generation == self._generation and inode == self._inode

    def commit(self, nbytes: int, generation: int) -> None:
        """A store leased in `generation` is published: its bytes move from our lease to `published`
        (only `published` grows if the lease went with an older ledger: an over-count at worst)."""
        with self._transaction() as state:
            if state is not None:
                self._end_lease(state, nbytes, generation)
                state.published += nbytes

    def release(self, nbytes: int, generation: int) -> None:
        """A store leased in `generation` failed and left nothing: its lease ends."""
        with self._transaction() as state:
            if state is not None:
                self._end_lease(state, nbytes, generation)

    def retract(self, path: str, nbytes: int, generation: int) -> None:
        """Unlink `path`, which a store leased in `generation` published but must not keep (it
        failed after the rename), and end its lease. If the unlink fails, the file stays counted
        (as `commit` counts it) and the OSError is raised."""
        error: OSError | None = None
        with self._transaction() as state:
            try:
                unlink_sized(path)
            except OSError as e:
                error = e
            if state is not None:
                self._end_lease(state, nbytes, generation)
                state.published += 0 if error is None else nbytes
        if error is not None:
            raise error

    def remove(self, path: str) -> bool:
        """Unlink an extent file (or a stale temp file) and take its bytes off `published` (not
        those of a temp file whose writer holds a lease: they are in the lease); False if gone."""
        with self.locked() as state:
            in_lease = leased(path, state)
            freed = unlink_sized(path)
            state.published -= 0 if in_lease else freed or 0
            return freed is not None

    def resync(self, client: LedgerClient | None = None) -> list[FileStat]:
        """Remove stale temp files and recount `published` from the files (under the lock);
        returns the files listed (those removed left out)."""
        with self.locked() as state:
            return self._resync(state, client)

    def snapshot(self) -> State:
        with self.locked() as state:
            return State(state.published, dict(state.leases))

    def _unaccountable(self) -> OSError:
        if self._closed:
            return OSError(errno.ESHUTDOWN, f"{self.path}: this process closed its ledger")
        return FileNotFoundError(errno.ENOENT, f"{self.root}: gone (being re-created)")

    def _end_lease(self, state: State, nbytes: int, generation: int) -> None:
        if generation == self._generation:  # else leased in a ledger that is gone: nothing to take back
            self._lease(state, -nbytes)

    def _lease(self, state: State, delta: int) -> None:
        token = me().token
        lease = state.leases.setdefault(token, Lease(0, 0.0))
        lease.nbytes, lease.updated = max(0, lease.nbytes + delta), time.time()
        self._mine = lease.nbytes
        if lease.nbytes == 0:
            del state.leases[token]

    def _reclaim(self, state: State) -> bool:
        """Leases of writers dead on this host, or not updated for STALE_TEMP_S (any host), end; their
        bytes count as published (their temp files may remain) until a resync recounts them.
        Whether any ended."""
        now, ended = time.time(), False
        for token, lease in list(state.leases.items()):
            writer = Writer.parse(token)
            dead = writer is None or liveness(writer) is Liveness.DEAD
            if dead or now - lease.updated >= STALE_TEMP_S:
                state.published += state.leases.pop(token).nbytes
                ended = True
        return ended

    def _resync(self, state: State, client: LedgerClient | None = None) -> list[FileStat]:
        self._reclaim(state)
        files, removed = [], 0
        for f in walk_root(self.root):
            if f.is_temp and _swept(f.path, client):
                removed += 1
            else:
                files.append(f)
        state.published = sum(f.size for f in files if not leased(f.path, state))
        self._last_resync = time.monotonic()
        if removed and client is not None:
            client.removed_temps(removed)
        return files

    def attach(self) -> None:
        with self._mutex:  # a refresh's look may run now (it only ever sets `others_seen` too)
            self._users += 1
            if self._users > 1:
                self.others_seen = True

    def detach(self) -> bool:
        """One tier fewer; at the last, drop this process's lease and close. True if closed."""
        self._users -= 1
        if self._users > 0:
            return False
        with contextlib.suppress(OSError), self.locked() as state:
            state.published += state.leases.pop(me().token, Lease(0, 0.0)).nbytes
            self._mine = 0
        with self._mutex:
            self._closed = True
            self._presence.forget()
            if self._fd >= 0:
                os.close(self._fd)
            self._fd = -1
        return True


_open: dict[tuple[int, int, int], Ledger] = {}
_open_lock = threading.Lock()


def open_ledger(root: Path) -> Ledger:
    """This process's Ledger of `root` (one per process and root: see the module doc on POSIX
    locks). Raises NoLocks, UntrustedDirectory, OSError. Pair with `close_ledger`."""
    st = os.stat(root)
    ident = (os.getpid(), st.st_dev, st.st_ino)
    with _open_lock:
        ledger = _open.get(ident)
        if ledger is None:
            ledger = _open[ident] = Ledger(root)
        ledger.attach()
        return ledger


def close_ledger(ledger: Ledger) -> None:
    with _open_lock:
        if ledger.detach():
            for ident, other in list(_open.items()):
                if other is ledger:
                    del _open[ident]


def _swept(path: str, client: LedgerClient | None) -> bool:
    try:
        return remove_stale_temp(path)
    except OSError as e:  # it stays counted; the next sweep tries again
        if client is not None:
            client.unlink_failed(e)
        return False


def _over(nbytes: int, capacity: int, state: State) -> OverBudget:
    leased = state.total - state.published
    return OverBudget(
        f"{nbytes} B does not fit the directory's budget {capacity} B: {state.published} B published, "
        f"{leased} B in flight, nothing evictable"
    )
