"""Startup scan: rebuild the index from extent headers (no payload reads), drop debris.

Only the fixed header (first FIXED_SIZE bytes) of each file is read and verified: its MAC (so only
files written with this directory's secret are indexed), namespace, key = file name = the chain key
of its parent, token count and token digest, and size; the meta MAC and payload checksums are
verified on load. Removed: temp files whose writer pid is gone (or older than STALE_TEMP_S), and
extent files that fail any of those checks. Extents enter
the LRU in publish order (header `created_ns`): a restart forgets access order.
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from sgl_hicache.tier.format import EXTENT_SUFFIX, FIXED_SIZE, TEMP_SUFFIX, FormatError, Seal, peek_index
from sgl_hicache.tier.index import Entry
from sgl_hicache.tier.keys import ExtentKey, NamespaceId, chain_key_from_digest
from sgl_hicache.tier.paths import ExtentPaths, temp_owner

STALE_TEMP_S = 3600.0
SCAN_THREADS = 16  # cold scans wait on metadata reads: keep several in flight (more did not help)


@dataclass
class ScanResult:
    entries: list[tuple[int, ExtentKey, Entry]] = field(default_factory=list)
    removed_temp: int = 0
    removed_bad: int = 0


def scan(paths: ExtentPaths, ns: NamespaceId, seal: Seal, threads: int = SCAN_THREADS) -> ScanResult:
    """Scan the namespace directory, one top-level fan-out directory per task, `threads` at once."""
    now = time.time()
    with ThreadPoolExecutor(threads, thread_name_prefix="sgl-hicache-scan") as pool:
        parts = list(pool.map(lambda part: _scan_part(part(), ns, seal, now), paths.parts()))
    result = ScanResult()
    for part in parts:
        result.entries += part.entries
        result.removed_temp += part.removed_temp
        result.removed_bad += part.removed_bad
    result.entries.sort(key=lambda t: t[0])
    return result


def _scan_part(files: list[os.DirEntry[str]], ns: NamespaceId, seal: Seal, now: float) -> ScanResult:
    result = ScanResult()
    for de in files:
        if de.name.endswith(TEMP_SUFFIX):
            result.removed_temp += _remove_if_stale(de, now)
        elif de.name.endswith(EXTENT_SUFFIX):
            _scan_extent(de, ns, seal, result)
    return result


def is_stale_temp(de: os.DirEntry[str], now: float) -> bool:
    """The rule for temp files (also used by `sgl-hicache fsck`): stale if its writer pid is gone or
    it is older than STALE_TEMP_S. Raises FileNotFoundError if it vanished meanwhile."""
    pid = temp_owner(de.name)
    return pid is None or not _alive(pid) or now - de.stat().st_mtime >= STALE_TEMP_S


def _remove_if_stale(de: os.DirEntry[str], now: float) -> int:
    try:
        if not is_stale_temp(de, now):
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


def _scan_extent(de: os.DirEntry[str], ns: NamespaceId, seal: Seal, result: ScanResult) -> None:
    try:
        fd = os.open(de.path, os.O_RDONLY)
        try:
            head, size = os.pread(fd, FIXED_SIZE, 0), os.fstat(fd).st_size
        finally:
            os.close(fd)
        h = peek_index(head, seal)
        if h.namespace != ns or h.key.hex() + EXTENT_SUFFIX != de.name or size < h.file_size:
            raise FormatError("foreign or truncated extent")
        if chain_key_from_digest(ns, ExtentKey(h.parent), h.token_count, h.token_digest) != h.key:
            raise FormatError("the extent's parent, token count and digest do not hash to its key")
    except FileNotFoundError:
        return  # removed meanwhile (another process evicted it)
    except FormatError:
        _unlink(de.path)
        result.removed_bad += 1
        return
    entry = Entry(ExtentKey(h.parent), h.token_count, h.payload_len, size)
    result.entries.append((h.created_ns, ExtentKey(h.key), entry))


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
