"""What every process sharing a tier root has on disk, from `stat` alone (no file is read).

The shared budget's ground truth (`ledger.Ledger.resync` sums it) and the candidates for evicting
extents that other processes wrote (`Foreign`, oldest modification first). Cost: one `scandir` per
fan-out directory and one `stat` per file, for every namespace directory under the root. The
ledger unlinks what it accounts through `unlink_sized` and `remove_stale_temp`.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sgl_hicache.tier.file.paths import ExtentPaths
from sgl_hicache.tier.file.scan import temp_still_stale
from sgl_hicache.tier.format import EXTENT_SUFFIX, TEMP_SUFFIX
from sgl_hicache.tier.keys import KEY_BYTES, NamespaceId

FOREIGN_TTL_S = 10.0  # under pressure, other processes' extents are listed again this often ...
FOREIGN_RETRY_S = 1.0  # ... or, when a reservation found nothing to evict, at most this often
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class FileStat:
    path: str
    name: str
    size: int
    mtime: float

    @property
    def is_temp(self) -> bool:
        return self.name.endswith(TEMP_SUFFIX)


def namespace_dirs(root: Path) -> list[Path]:
    """The namespace directories under a tier root (named by 32 hex digits)."""
    try:
        with os.scandir(root) as it:
            return [
                Path(de.path) for de in it
                if len(de.name) == 2 * KEY_BYTES and set(de.name) <= _HEX and de.is_dir(follow_symlinks=False)
            ]  # fmt: skip
    except FileNotFoundError:
        return []


def walk_root(root: Path) -> list[FileStat]:
    """Every extent and temp file under `root` with its size and mtime (files that vanish: skipped)."""
    out: list[FileStat] = []
    for ns_dir in namespace_dirs(root):
        for de in ExtentPaths(root, NamespaceId(bytes.fromhex(ns_dir.name))).walk():
            if not de.name.endswith((EXTENT_SUFFIX, TEMP_SUFFIX)):
                continue
            try:
                st = de.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            out.append(FileStat(de.path, de.name, st.st_size, st.st_mtime))
    return out


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


def remove_stale_temp(path: str) -> bool:
    """Unlink a temp file if `scan.temp_still_stale` (a fresh stat) says so; whether it went.
    Raises OSErrors other than the file being gone."""
    return temp_still_stale(path) and unlink_sized(path) is not None


class Foreign:
    """Extents under the root that this process does not index, oldest mtime first.

    The list is a snapshot (`load`): a file in it may be gone (its unlink then frees nothing) or
    rewritten since (`ledger.unlink_sized` skips a file newer than listed). `indexed(path)` says
    whether a path is one of our own index's files (those are evicted in our LRU order instead);
    call `peek`/`pop` under the lock that guards that index."""

    def __init__(self, indexed: Callable[[str], bool]) -> None:
        self._indexed = indexed
        self._queue: deque[FileStat] = deque()
        self._at = -FOREIGN_TTL_S

    def load(self, files: list[FileStat]) -> None:
        self._queue = deque(sorted((f for f in files if not f.is_temp), key=lambda f: f.mtime))
        self._at = time.monotonic()

    def due(self, age_s: float = FOREIGN_TTL_S) -> bool:
        return time.monotonic() - self._at >= age_s

    def peek(self) -> FileStat | None:
        while self._queue and self._indexed(self._queue[0].path):
            self._queue.popleft()
        return self._queue[0] if self._queue else None

    def pop(self) -> None:
        self._queue.popleft()
