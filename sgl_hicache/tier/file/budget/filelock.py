"""The file lock under the root's ledger (ledger.py): open it privately, probe that POSIX locks work
and are shared between hosts, take it with a deadline.

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
import stat
import time
from pathlib import Path

from sgl_hicache.tier.trust import UntrustedDirectory


class NoLocks(Exception):
    """POSIX locks do not work (or are local only) on the tier's filesystem; one line."""


def lockf_until(fd: int, deadline: float, path: Path, wait_s: float) -> None:
    """Take the POSIX lock on `fd`, polling (1 to 20 ms apart) until `deadline`; TimeoutError then."""
    pause = 0.001
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        if time.monotonic() >= deadline:
            raise TimeoutError(errno.ETIMEDOUT, f"{path}: locked by another process for {wait_s} s")
        time.sleep(pause)
        pause = min(2 * pause, 0.02)


def read_unless_locked(fd: int, limit: int) -> tuple[bytes, int] | None:
    """The file's first `limit` bytes and its mtime (ns), read under a shared lock taken without
    waiting; None if another process holds the lock now. Call with no lock of this process on the
    file (it is released whole afterwards). Raises OSError."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        return None
    try:
        return os.pread(fd, limit, 0), os.fstat(fd).st_mtime_ns
    finally:
        fcntl.lockf(fd, fcntl.LOCK_UN)


def open_private(path: Path) -> int:
    """Open (creating, 0600) the ledger or the presence file (mark.py); it must be a regular
    file of ours, closed to others."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        raise UntrustedDirectory(f"{path}: not a private regular file of uid {os.geteuid()}; remove it")
    return fd


def probe_locks(fd: int, root: Path) -> None:
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.lockf(fd, fcntl.LOCK_UN)
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES):  # held by another process: locks work
            raise NoLocks(f"{root}: POSIX locks fail here ({e.strerror})") from None
    local = local_only_locks(root)
    if local:
        raise NoLocks(f"{root}: mounted with {local}: locks are not shared between hosts")


def local_only_locks(root: Path) -> str | None:
    """The mount option that keeps locks on this host (NFS `local_lock=posix|all`, `nolock`), if any."""
    best, fstype, opts = "", "", ""
    real = os.path.realpath(root)
    with contextlib.suppress(OSError), open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            mnt = fields[1].replace("\\040", " ") if len(fields) >= 4 else ""
            if mnt and (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, fstype, opts = mnt, fields[2], fields[3]
    if not fstype.startswith("nfs"):
        return None
    found = [o for o in opts.split(",") if o in ("nolock", "local_lock=posix", "local_lock=all")]
    return found[0] if found else None
