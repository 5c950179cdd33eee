"""Startup scan: rebuild the index from extent headers (no payload reads), drop debris.

Only the fixed header (first 4096 bytes) of each file is read and verified; payload and meta
checksums are verified on load. Removed: temp files whose writer pid is gone (or older than
STALE_TEMP_S), and extent files whose header is bad, foreign, or whose size is short. Extents enter
the LRU in publish order (header `created_ns`): a restart forgets access order.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field

from sgl_hicache.tier.format import ALIGN, EXTENT_SUFFIX, TEMP_SUFFIX, FormatError, decode_fixed
from sgl_hicache.tier.index import Entry
from sgl_hicache.tier.keys import ExtentKey, NamespaceId
from sgl_hicache.tier.paths import ExtentPaths, temp_owner

STALE_TEMP_S = 3600.0


@dataclass
class ScanResult:
    entries: list[tuple[int, ExtentKey, Entry]] = field(default_factory=list)
    removed_temp: int = 0
    removed_bad: int = 0


def scan(paths: ExtentPaths, ns: NamespaceId) -> ScanResult:
    result = ScanResult()
    now = time.time()
    for de in paths.walk():
        if de.name.endswith(TEMP_SUFFIX):
            result.removed_temp += _remove_if_stale(de, now)
        elif de.name.endswith(EXTENT_SUFFIX):
            _scan_extent(de, ns, result)
    result.entries.sort(key=lambda t: t[0])
    return result


def _remove_if_stale(de: os.DirEntry[str], now: float) -> int:
    pid = temp_owner(de.name)
    try:
        if pid is not None and _alive(pid) and now - de.stat().st_mtime < STALE_TEMP_S:
            return 0
        os.unlink(de.path)
        return 1
    except FileNotFoundError:
        return 0


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _scan_extent(de: os.DirEntry[str], ns: NamespaceId, result: ScanResult) -> None:
    try:
        st = de.stat()
        with open(de.path, "rb", buffering=0) as f:
            head = f.read(ALIGN)
        header = decode_fixed(head)
        if header.namespace != ns or header.key.hex() + EXTENT_SUFFIX != de.name:
            raise FormatError("foreign extent")
        if st.st_size < header.file_size:
            raise FormatError("truncated")
    except FileNotFoundError:
        return  # removed meanwhile (another process evicted it)
    except FormatError:
        _unlink(de.path)
        result.removed_bad += 1
        return
    entry = Entry(header.parent, header.token_count, header.payload_len, st.st_size)
    result.entries.append((header.created_ns, header.key, entry))


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
