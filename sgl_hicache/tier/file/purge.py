"""Finding a cache_salt's extents under a tier root (a purge, and `sgl-hicache fsck --cache-salt`).

The salt is never on disk: since format v5 every extent's MAC'd meta records `DirectoryMac.salt(cache_salt)`
(a digest keyed with the directory's secret) when the request that computed it had a salt
(docs/FORMAT.md). An extent *belongs* to a salt when that tag is its tag. Older files (v3, v4) carry
no tag: one without token ids is some salted or `extra_key` tenant's, which one cannot be told, so
it *may* belong to any salt and a purge removes it (recomputed when needed; never wrong KV). A file
whose header or meta does not verify belongs to nobody: no load, lookup or warm start ever uses it,
and `fsck` reports it as corrupt.

A purge is of the root, not of one server's namespace, but each namespace is purged by one tier
(`purged_namespaces`): a tier purges its own, and the tier of TP rank 0 also every namespace that is
no rank's of its server (other models, older weights, another TP size). The other ranks'
namespaces are theirs: every rank receives the same purge (cache/retain.py) and removes its own
files through its own index, where a sibling's unlink would leave that index naming files that are
gone (and its own purge then finding nothing to forget).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path

from sgl_hicache.tier.file.paths import ExtentPaths
from sgl_hicache.tier.format import (
    EXTENT_SUFFIX,
    FIXED_SIZE,
    DirectoryMac,
    FormatError,
    NewerFormat,
    SaltMark,
    decode_fixed,
    decode_salt,
    version_of,
)
from sgl_hicache.tier.keys import KEY_BYTES, Namespace, NamespaceId

UNREADABLE = SaltMark(None, known=False)
"""An extent file that is there but cannot be read (EIO, EACCES, ...): it may hold any salt's KV."""
NEWER = SaltMark(None, known=False, newer=True)
"""An extent of a newer format version (`NewerFormat`): whose it is cannot be told here, and it is
never removed here (the newer server's own purge does)."""


def salt_mark(path: str, seal: DirectoryMac) -> SaltMark | None:
    """The `SaltMark` of extent file `path`, verified with `seal`; None if it is gone or does not
    verify (then nothing ever uses it as KV); `UNREADABLE` if it is there but cannot be read, so a
    purge removes it and fsck reports it rather than call the salt gone; `NEWER` for a file of a
    newer format version. Never raises."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        return None if e.errno == errno.ENOENT else UNREADABLE
    try:
        fixed = os.pread(fd, FIXED_SIZE, 0)
        header = decode_fixed(fixed, seal)
        meta = os.pread(fd, FIXED_SIZE + header.meta_len, 0)
        return decode_salt(header, meta, version_of(fixed), seal)
    except NewerFormat:
        return NEWER
    except FormatError:
        return None
    except OSError:
        return UNREADABLE
    finally:
        os.close(fd)


def belongs(mark: SaltMark | None, tag: bytes) -> bool:
    """Whether an extent of `mark` holds (or may hold) KV of the salt whose tag is `tag`."""
    return mark is not None and not mark.newer and (mark.tag == tag or not mark.known)


def namespace_dirs(root: Path) -> list[Path]:
    """The namespace directories under `root` (32 hex digits); none if it is gone."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    return [Path(de.path) for de in entries if de.is_dir(follow_symlinks=False) and _is_ns(de.name)]


def purged_namespaces(root: Path, ns: Namespace) -> list[Path]:
    """The namespace directories under `root` that the tier of `ns` purges (see the module doc)."""
    ranks = {replace(ns, tp_rank=rank).id.hex() for rank in range(ns.tp_size)}
    own = ns.id.hex()
    return [d for d in namespace_dirs(root) if d.name == own or (ns.tp_rank == 0 and d.name not in ranks)]


def salt_extents(root: Path, tag: bytes, seal: DirectoryMac) -> Iterator[str]:
    """Paths of every extent file under `root` that belongs to the salt of `tag` (`belongs`)."""
    return (path for path, mark in marked_extents(namespace_dirs(root), seal) if belongs(mark, tag))


def marked_extents(ns_dirs: Iterable[Path], seal: DirectoryMac) -> Iterator[tuple[str, SaltMark | None]]:
    """Every extent file in the namespace directories `ns_dirs` with its `salt_mark`."""
    for ns_dir in ns_dirs:
        root = ns_dir.parent
        paths = ExtentPaths(root, NamespaceId(bytes.fromhex(ns_dir.name)))
        for de in paths.walk():
            if de.name.endswith(EXTENT_SUFFIX):
                yield de.path, salt_mark(de.path, seal)


def _is_ns(name: str) -> bool:
    if len(name) != 2 * KEY_BYTES:
        return False
    try:
        bytes.fromhex(name)
    except ValueError:
        return False
    return True
