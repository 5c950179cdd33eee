"""Checks run by the launcher before sglang starts: fail fast with one line, write nothing."""

from __future__ import annotations

import os
from pathlib import Path

from sgl_hicache.config import ConfigError, SpillConfig, flag_named
from sgl_hicache.server.room import check_room
from sgl_hicache.tier.file.volume import human
from sgl_hicache.tier.trust import UntrustedDirectory, check_trusted

PSEUDO_ROOTS = (Path("/proc"), Path("/sys"), Path("/dev"))  # kernel interfaces, whatever is mounted there
REAL_UNDER_PSEUDO = (Path("/dev/shm"),)  # a tmpfs: memory, but a filesystem
PSEUDO_FS = frozenset({
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "pstore",
    "bpf", "configfs", "fusectl", "mqueue", "binfmt_misc", "autofs", "efivarfs", "hugetlbfs", "nsfs",
    "rpc_pipefs", "selinuxfs",
})  # fmt: skip


def check_tier_directory(directory: Path) -> None:
    """The tier directory must be a writable directory, or creatable under a writable one, and, if
    it exists, trusted as the tier would at open (ours, no symlink, not group/other-writable, its
    secret private: `tier.trust`).

    Raises ConfigError naming the flag. Creates nothing: the tier creates the directory when it opens.
    """
    path = Path(directory)
    if not path.is_absolute():
        raise ConfigError(f"--hicache-spill-dir: {path} is not an absolute path")
    existing = nearest_existing(path)
    pseudo = pseudo_filesystem(path, existing)
    if pseudo is not None:
        raise ConfigError(
            f"--hicache-spill-dir: {path} would be on a pseudo filesystem ({pseudo}), not a disk"
        )
    if existing != path and not existing.is_dir():
        raise ConfigError(f"--hicache-spill-dir: {existing} is not a directory, so {path} cannot be created")
    if not existing.is_dir():
        raise ConfigError(f"--hicache-spill-dir: {path} exists and is not a directory")
    _check_names(path, existing)
    try:
        check_trusted(path)
    except UntrustedDirectory as e:
        raise ConfigError(f"--hicache-spill-dir: {e}") from None
    except OSError as e:
        raise ConfigError(f"--hicache-spill-dir: cannot check {path}: {e.strerror}") from None
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise ConfigError(f"--hicache-spill-dir: {existing} is on a read-only filesystem")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "" if existing == path else f" (to create {path})"
        raise ConfigError(f"--hicache-spill-dir: no write permission on {existing}{what}")


def pseudo_filesystem(path: Path, existing: Path) -> str | None:
    """What makes `path` (whose nearest existing ancestor is `existing`) a place for no files: the type
    of a kernel pseudo filesystem it would be on, or the root (/proc, /sys, /dev) it is under; None
    for a real filesystem."""
    real = Path(os.path.realpath(existing)) / path.relative_to(existing)
    fs_type = _mount_type(Path(os.path.realpath(existing)))
    if fs_type in PSEUDO_FS:
        return fs_type
    if any(real.is_relative_to(p) for p in REAL_UNDER_PSEUDO):
        return None
    return next((str(root) for root in PSEUDO_ROOTS if real.is_relative_to(root)), None)


def _mount_type(path: Path) -> str | None:
    """The filesystem type of the mount holding `path` (a resolved path), from /proc/self/mountinfo."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    best, fs_type = -1, None
    for line in lines:
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        mount = Path(fields[4].replace("\\040", " "))
        if path.is_relative_to(mount) and len(mount.parts) > best:
            best, fs_type = len(mount.parts), line.split(" - ", 1)[1].split()[0]
    return fs_type


def _check_names(path: Path, existing: Path) -> None:
    """ConfigError if a directory still to be made under `existing` could never be created."""
    limit = os.pathconf(existing, "PC_NAME_MAX")
    for part in path.relative_to(existing).parts:
        if len(os.fsencode(part)) > limit:
            raise ConfigError(
                f"--hicache-spill-dir: {path} cannot be created: file name too long ({part[:16]}... > {limit} bytes)"
            )


def check_staging(staging_bytes: int, ranks: int = 1) -> None:
    """Staging is host memory, one arena per TP rank allocated at start: `ranks` arenas (the TP
    ranks on this machine, `room.ranks_here`) of more than the machine has can never be allocated."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if staging_bytes * ranks > total:
        flag = flag_named(SpillConfig, "staging_bytes")
        each = f" on each of {ranks} TP ranks ({human(staging_bytes * ranks)})" if ranks > 1 else ""
        raise ConfigError(
            f"{flag}: {human(staging_bytes)}{each} is more than this machine's memory ({human(total)})"
        )


def nearest_existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (where the tier directory would be created); a path
    that cannot be asked about (a name too long) counts as missing."""
    while not os.path.exists(path):
        path = path.parent
    return path


def check_config(config: SpillConfig) -> None:
    """Everything about `config` that depends on this machine (pure checks ran at construction)."""
    if config.enabled:
        check_tier_directory(config.tier.directory)
        check_room(config, nearest_existing(config.tier.directory))  # the model's own floor: sglang_args.py
        check_staging(config.staging_bytes)  # one rank's; TP x it with sglang's flags: sglang_args.py
