"""One byte budget per tier root, shared by every process using it: a ledger file under a POSIX lock.

`<root>/.budget` holds `published` (bytes of extent files under the root, all namespaces) and one
lease per writer with bytes reserved for its stores in flight (their temp files), keyed by
`owner.Writer.token`. Every change happens with the file locked (`fcntl.lockf`, a POSIX record
lock): reserve (evicting, under the lock, until `published + leases + n <= capacity`), commit (a
published store moves its bytes from its lease to `published`), release (a failed store), and every
unlink of an extent (`remove`). Invariant, whatever the interleaving of processes: the bytes of
extent and temp files under the root never exceed `published + sum(leases) <= capacity`. The
counts may only drift upward (a crash between a publish and its commit, two processes publishing
the same key, files removed by hand), which costs room, never the bound; `resync` (at every open,
and at most every RESYNC_MIN_S when a reservation finds nothing to evict) recounts from the files.

Why `lockf` (POSIX locks), not `flock`: NFSv4 implements byte-range locks in the protocol, and a
lock taken or released makes the Linux NFS client revalidate and flush the file, so the ledger is
coherent across hosts; Linux emulates `flock` on NFS with the same POSIX locks, Lustre offers
`flock` only when mounted with `-o flock`, and CephFS and GPFS implement POSIX locks cluster-wide.
Gotcha of POSIX locks: closing any descriptor of the file drops the process's lock, so a process
opens the ledger once (`open_ledger` shares one `Ledger` among the tiers of one root).

Where the lock does not work (the probe at open fails, e.g. NFS without lockd, or the mount keeps
locks local: `local_lock=posix|all`, `nolock`), `open_ledger` raises NoLocks and the tier keeps a
per-process budget (logged): serving stays correct, but N processes on one such directory may use
N x capacity; the free-space watermark, checked on the volume itself, still bounds them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from sgl_hicache.tier.filelock import lockf_until, open_private, probe_locks
from sgl_hicache.tier.index import OverBudget
from sgl_hicache.tier.owner import Liveness, Writer, liveness, me
from sgl_hicache.tier.paths import temp_writer
from sgl_hicache.tier.scan import STALE_TEMP_S
from sgl_hicache.tier.sweep import FileStat, walk_root
from sgl_hicache.tier.trust import check_trusted

LEDGER_NAME = ".budget"
MAGIC = "sgl-hicache-budget 1"
RESYNC_MIN_S = 30.0
LOCK_WAIT_S = 5.0  # longer, and the operation fails (a store: IO_ERROR) rather than wait on
MAX_LEDGER_BYTES = 64 << 10  # ~1000 leases; a larger file is torn or foreign: recounted


@dataclass
class Lease:
    nbytes: int
    updated: float


@dataclass
class State:
    published: int = 0
    leases: dict[str, Lease] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.published + sum(lease.nbytes for lease in self.leases.values())

    def encode(self) -> bytes:
        lines = [MAGIC, f"published {self.published}"]
        lines += [f"lease {t} {lease.nbytes} {lease.updated:.3f}" for t, lease in sorted(self.leases.items())]
        body = "\n".join(lines) + "\n"
        return (body + f"sum {xxhash.xxh3_64_hexdigest(body.encode())}\n").encode()

    @classmethod
    def decode(cls, data: bytes) -> State | None:
        """The state written by `encode`, or None for anything else (empty, torn, foreign)."""
        text = data.decode("ascii", errors="replace")
        body, _, tail = text.rpartition("sum ")
        lines = body.splitlines()
        if tail.strip() != xxhash.xxh3_64_hexdigest(body.encode()) or lines[:1] != [MAGIC] or len(lines) < 2:
            return None
        try:
            state = cls(int(lines[1].removeprefix("published ")))
            for line in lines[2:]:
                _, token, nbytes, updated = line.split(" ")
                if Writer.parse(token) is not None:
                    state.leases[token] = Lease(int(nbytes), float(updated))
        except ValueError:
            return None
        return state


def unlink_sized(path: str, not_newer_than: float | None = None) -> int | None:
    """Unlink `path`; the bytes it held, or None if it was gone or is kept because it was modified
    after `not_newer_than` (rewritten or used since it was listed). Raises other OSErrors."""
    try:
        st = os.stat(path, follow_symlinks=False)
        if not_newer_than is not None and st.st_mtime > not_newer_than:
            return None
        os.unlink(path)
    except FileNotFoundError:
        return None
    return st.st_size


class Ledger:
    """The shared budget of one tier root for this process (thread-safe; see the module doc)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.path = self.root / LEDGER_NAME
        self._fd = open_private(self.path)
        self._device = os.fstat(self._fd).st_dev
        self._mutex = threading.Lock()  # POSIX locks do not exclude the threads of one process
        self._users = 0
        self._closed = False
        self._last_resync = -RESYNC_MIN_S
        try:
            probe_locks(self._fd, self.root)
        except BaseException:
            os.close(self._fd)
            raise

    @contextlib.contextmanager
    def locked(self) -> Iterator[State]:
        """The state with the file locked; written back on a normal exit. Waits at most
        LOCK_WAIT_S for the lock (a process or host stuck holding it must not hold our I/O threads,
        which loads need too), then raises TimeoutError (an OSError). Once closed (a store abandoned
        at close still finishing), a scratch state that goes nowhere."""
        deadline = time.monotonic() + LOCK_WAIT_S
        if not self._mutex.acquire(timeout=LOCK_WAIT_S):
            raise TimeoutError(errno.ETIMEDOUT, f"{self.path}: busy in this process for {LOCK_WAIT_S} s")
        try:
            if self._closed or not self._lock_current(deadline):
                yield State()  # closed, or the root is gone (being re-created): nothing to account
                return
            try:
                state = State.decode(os.pread(self._fd, MAX_LEDGER_BYTES, 0))
                if state is None:
                    state = State()
                    self._resync(state)
                yield state
                data = state.encode()
                os.pwrite(self._fd, data, 0)
                os.ftruncate(self._fd, len(data))
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN)
        finally:
            self._mutex.release()

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

    def _same_root(self) -> bool:
        try:
            check_trusted(self.root)
            return os.stat(self.root).st_dev == self._device
        except OSError:
            return False

    def reserve(self, nbytes: int, capacity: int, evict: Callable[[int], int]) -> bool:
        """Lease `nbytes` within `capacity` (this process's configured one), calling `evict(short)`
        under the lock to unlink extents (it returns the bytes freed); raises OverBudget, the
        ledger unchanged but for what was evicted. Returns whether anything had to be evicted."""
        with self.locked() as state:
            short = pressed = state.total + nbytes - capacity
            if short > 0:
                self._reclaim(state)
                short = state.total + nbytes - capacity
            if short > 0:
                state.published -= evict(short)
                short = state.total + nbytes - capacity
            if short > 0 and time.monotonic() - self._last_resync >= RESYNC_MIN_S:
                self._resync(state)
                short = state.total + nbytes - capacity
            if short <= 0:
                self._lease(state, nbytes)
            over = _over(nbytes, capacity, state) if short > 0 else None
        if over is not None:
            raise over
        return pressed > 0

    def commit(self, nbytes: int) -> None:
        with self.locked() as state:
            self._lease(state, -nbytes)
            state.published += nbytes

    def release(self, nbytes: int) -> None:
        with self.locked() as state:
            self._lease(state, -nbytes)

    def remove(self, path: str) -> bool:
        """Unlink an extent file (or a stale temp file) and take its bytes off `published` (not
        those of a temp file whose writer holds a lease: they are in the lease); False if gone."""
        with self.locked() as state:
            leased = _leased(path, state)
            freed = unlink_sized(path)
            state.published -= 0 if leased else freed or 0
            return freed is not None

    def resync(self) -> list[FileStat]:
        """Recount `published` from the files (under the lock); returns the files listed."""
        with self.locked() as state:
            return self._resync(state)

    def snapshot(self) -> State:
        with self.locked() as state:
            return State(state.published, dict(state.leases))

    def _lease(self, state: State, delta: int) -> None:
        token = me().token
        lease = state.leases.setdefault(token, Lease(0, 0.0))
        lease.nbytes, lease.updated = max(0, lease.nbytes + delta), time.time()
        if lease.nbytes == 0:
            del state.leases[token]

    def _reclaim(self, state: State) -> None:
        """Leases of writers dead on this host, or not updated for STALE_TEMP_S (any host), end; their
        bytes count as published (their temp files may remain) until a resync recounts them."""
        now = time.time()
        for token, lease in list(state.leases.items()):
            writer = Writer.parse(token)
            dead = writer is None or liveness(writer) is Liveness.DEAD
            if dead or now - lease.updated >= STALE_TEMP_S:
                state.published += state.leases.pop(token).nbytes

    def _resync(self, state: State) -> list[FileStat]:
        self._reclaim(state)
        files = walk_root(self.root)
        state.published = sum(f.size for f in files if not _leased(f.path, state))
        self._last_resync = time.monotonic()
        return files

    def attach(self) -> None:
        self._users += 1

    def detach(self) -> bool:
        """One tier fewer; at the last, drop this process's lease and close. True if closed."""
        self._users -= 1
        if self._users > 0:
            return False
        with contextlib.suppress(OSError), self.locked() as state:
            state.published += state.leases.pop(me().token, Lease(0, 0.0)).nbytes
        with self._mutex:
            self._closed = True
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


def _leased(path: str, state: State) -> bool:
    """A temp file whose writer holds a lease: its bytes are in the lease, not in `published`."""
    writer = temp_writer(os.path.basename(path))
    return writer is not None and writer.token in state.leases


def _over(nbytes: int, capacity: int, state: State) -> OverBudget:
    leased = state.total - state.published
    return OverBudget(
        f"{nbytes} B does not fit the directory's budget {capacity} B: {state.published} B published, "
        f"{leased} B in flight, nothing evictable"
    )
