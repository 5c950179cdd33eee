"""Trusting a tier directory: nothing in it may come from another user (docs/FORMAT.md, "Trust").

The tier root and each namespace directory must be real directories (not symbolic links), owned by
our effective uid and not writable by group or others; a missing root is created 0700 (its missing
ancestors get the default mode: a world-writable ancestor such as /var/tmp is fine, because the
0700 directory we create in it is ours and is checked). The root holds `.secret`: 32 random bytes,
made once (exclusively: the first of several processes opening a fresh directory wins) and kept
0600, that key every extent header's MAC, so an extent is accepted only if a holder of the secret
wrote it. Checks go through directory file descriptors (O_NOFOLLOW), so a path swapped during the
check is not followed. Anything else raises `UntrustedDirectory`, whose message says how to fix it.

A directory removed while the tier serves (`rm -rf`) is re-created by `reopen_trusted` with the same
checks, and the tier's secret is written back, so what it stores afterwards stays valid after a
restart. Only on the volume it was opened on: after an unmount nothing is created on the volume
below the mount point.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import uuid
from dataclasses import dataclass
from pathlib import Path

SECRET_NAME = ".secret"
SECRET_BYTES = 32
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UntrustedDirectory(OSError):
    """A tier directory or secret that another user could have written or read; one line, with the fix."""


def open_trusted(root: Path, ns_name: str) -> bytes:
    """Create (0700) or check the tier root and its namespace directory `ns_name`, then read the
    root's secret, creating it if missing. Returns the secret. Raises UntrustedDirectory, OSError."""
    if not os.path.lexists(root):
        root.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(root, 0o700)
    fd = open_checked_dir(root, os.geteuid())
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(ns_name, 0o700, dir_fd=fd)
        os.close(open_checked_dir(root / ns_name, os.geteuid(), dir_fd=fd))
        try:
            return read_secret(fd, root, os.geteuid())
        except FileNotFoundError:
            return _create_secret(fd, root)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Reopened:
    """What `reopen_trusted` found: the levels it created, and whether the root's secret is ours."""

    created: tuple[str, ...]  # of "root", "namespace", "secret", in that order
    secret_is_ours: bool  # False: another process made a new secret first; it was kept


def reopen_trusted(root: Path, ns_name: str, secret: bytes, device: int) -> Reopened:
    """Re-create what is missing of a tier directory in use: the root (0700, in its existing parent),
    the namespace directory `ns_name` (0700) and the secret file, holding `secret` (0600, made
    exclusively: a secret another process wrote first is kept and reported). Checks as `open_trusted`.
    Creates nothing unless the root, or else its parent, is on the volume `device` the tier was
    opened on. Raises UntrustedDirectory, OSError (ENODEV: another volume; ENOENT: parent gone)."""
    created: tuple[str, ...] = ("root",) if _mkdir_on(root, device) else ()
    fd = open_checked_dir(root, os.geteuid())
    try:
        if os.fstat(fd).st_dev != device:
            raise _moved(root)
        created += ("namespace",) if _mkdir(ns_name, fd) else ()
        os.close(open_checked_dir(root / ns_name, os.geteuid(), dir_fd=fd))
        try:
            found = read_secret(fd, root, os.geteuid())
        except FileNotFoundError:
            found = _publish_secret(fd, root, secret)
            created += ("secret",) if found == secret else ()
    finally:
        os.close(fd)
    return Reopened(created, found == secret)


def _mkdir_on(root: Path, device: int) -> bool:
    """Create `root` (0700) if missing, in a parent on `device`; whether this call created it."""
    if os.path.lexists(root):
        return False
    if os.stat(root.parent).st_dev != device:
        raise _moved(root)
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        return False
    return True


def _mkdir(name: str, dir_fd: int) -> bool:
    try:
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    except FileExistsError:
        return False
    return True


def _moved(root: Path) -> OSError:
    return OSError(
        errno.ENODEV,
        f"tier directory {root} is no longer on the volume it was opened on (unmounted?): not "
        "re-creating it there; restart the server once the volume is back",
    )


def check_trusted(root: Path) -> None:
    """What `open_trusted` would refuse of an existing root and secret, creating nothing."""
    if not os.path.lexists(root):
        return
    fd = open_checked_dir(root, os.geteuid())
    try:
        with contextlib.suppress(FileNotFoundError):
            read_secret(fd, root, os.geteuid())
    finally:
        os.close(fd)


def open_checked_dir(path: Path, owner: int, dir_fd: int | None = None) -> int:
    """An O_RDONLY descriptor of directory `path` (relative to `dir_fd` by its name, if given),
    after checking it is no symlink, is owned by `owner` and not group/other-writable."""
    name = path.name if dir_fd is not None else path
    _check_dir(os.lstat(name, dir_fd=dir_fd), path, owner)  # first: a clear message, even if unreadable
    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    try:
        _check_dir(os.fstat(fd), path, owner)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_dir(st: os.stat_result, path: Path, owner: int) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise UntrustedDirectory(
            f"tier directory {path} is a symbolic link: configure the directory it points to instead"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise UntrustedDirectory(f"tier directory {path} is not a directory")
    if st.st_uid != owner:
        raise UntrustedDirectory(
            f"tier directory {path} is owned by uid {st.st_uid}, not uid {owner} (this server): another "
            f"user could plant extents in it; use a directory of your own, or `chown {owner} {path}` "
            f"and `chmod 700 {path}` if its content is yours"
        )
    if st.st_mode & 0o022:
        raise UntrustedDirectory(
            f"tier directory {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}): "
            f"another user could plant extents in it; `chmod 700 {path}`"
        )


def read_secret(root_fd: int, root: Path, owner: int) -> bytes:
    """The secret of the root open as `root_fd`, which must be a 32-byte regular file owned by
    `owner`, mode 0600 or stricter. Raises FileNotFoundError if there is none, UntrustedDirectory."""
    path = root / SECRET_NAME
    if stat.S_ISLNK(os.lstat(SECRET_NAME, dir_fd=root_fd).st_mode):
        raise UntrustedDirectory(f"{path} is a symbolic link: remove it (a new secret is made at start)")
    fd = os.open(SECRET_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
    try:
        st = os.fstat(fd)
        _check_secret(st, path, owner)
        data = os.read(fd, SECRET_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != SECRET_BYTES:
        raise UntrustedDirectory(
            f"{path} holds {len(data)} bytes, not a {SECRET_BYTES}-byte secret: remove it "
            "(a new one is made at start; extents signed with the old one are then dropped)"
        )
    return data


def _check_secret(st: os.stat_result, path: Path, owner: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise UntrustedDirectory(f"{path} is not a regular file: remove it (a new secret is made at start)")
    if st.st_uid != owner:
        raise UntrustedDirectory(
            f"{path} is owned by uid {st.st_uid}, not uid {owner} (this server): remove it (a new secret "
            f"is made at start; extents signed with the old one are then dropped) or `chown {owner} {path}`"
        )
    if st.st_mode & 0o077:
        raise UntrustedDirectory(
            f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: it keys the MAC of every extent, so only its "
            f"owner may read it; `chmod 600 {path}`"
        )


def _create_secret(root_fd: int, root: Path) -> bytes:
    return _publish_secret(root_fd, root, secrets.token_bytes(SECRET_BYTES))


def _publish_secret(root_fd: int, root: Path, secret: bytes) -> bytes:
    """Write `secret` to a temp file and link it in place: the link fails if another process
    made one first, and readers never see a partial secret. Returns the secret that won."""
    tmp = f"{SECRET_NAME}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    fd = os.open(
        tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=root_fd
    )
    try:
        try:
            if os.write(fd, secret) != SECRET_BYTES:
                raise OSError(f"short write creating {root / SECRET_NAME}")
            os.fsync(fd)
        finally:
            os.close(fd)
        with contextlib.suppress(FileExistsError):
            os.link(tmp, SECRET_NAME, src_dir_fd=root_fd, dst_dir_fd=root_fd, follow_symlinks=False)
    finally:
        os.unlink(tmp, dir_fd=root_fd)
    os.fsync(root_fd)  # a lost secret would drop every extent signed with it
    return read_secret(root_fd, root, os.geteuid())
