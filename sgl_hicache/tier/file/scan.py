"""Startup scan: rebuild the index from extent headers (no payload reads), drop debris.

Only the fixed header (first FIXED_SIZE bytes) of each file is read and verified: its MAC (so only
files written with this directory's secret are indexed), namespace, key = file name = the chain key
of its parent, token count and token digest, and size; the meta MAC and payload checksums are
verified on load. Removed: stale temp files (`is_stale_temp`), and extent files that fail any of
those checks, but for files of a newer format version (a newer sgl_hicache shares the directory:
kept for it, counted in `newer`). Extents enter
the LRU in publish order (header `created_ns`): a restart forgets access order.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from sgl_hicache.tier.file.budget.index import Entry
from sgl_hicache.tier.file.owner import Liveness, liveness
from sgl_hicache.tier.file.paths import ExtentPaths, temp_writer
from sgl_hicache.tier.format import (
    EXTENT_SUFFIX,
    FIXED_SIZE,
    TEMP_SUFFIX,
    DirectoryMac,
    FormatError,
    NewerFormat,
    peek_index,
)
from sgl_hicache.tier.keys import ExtentKey, NamespaceId, chain_key_from_digest

STALE_TEMP_S = 600.0  # a temp file untouched this long has a dead or hung writer (see is_stale_temp)
SCAN_THREADS = 16  # cold scans wait on metadata reads: keep several in flight (more did not help)


@dataclass
class ScanResult:
    entries: list[tuple[int, ExtentKey, Entry]] = field(default_factory=list)
    removed_temp: int = 0
    removed_bad: int = 0
    newer: int = 0  # extent files of a newer format version: not indexed, kept


def scan(paths: ExtentPaths, ns: NamespaceId, seal: DirectoryMac, threads: int = SCAN_THREADS) -> ScanResult:
    """Scan the namespace directory, one top-level fan-out directory per task, `threads` at once."""
    now = time.time()
    with ThreadPoolExecutor(threads, thread_name_prefix="sgl-hicache-scan") as pool:
        parts = list(pool.map(lambda part: _scan_part(part(), ns, seal, now), paths.parts()))
    result = ScanResult()
    for part in parts:
        result.entries += part.entries
        result.removed_temp += part.removed_temp
        result.removed_bad += part.removed_bad
        result.newer += part.newer
    result.entries.sort(key=lambda t: t[0])
    return result


def _scan_part(files: list[os.DirEntry[str]], ns: NamespaceId, seal: DirectoryMac, now: float) -> ScanResult:
    result = ScanResult()
    for de in files:
        if de.name.endswith(TEMP_SUFFIX):
            result.removed_temp += _remove_if_stale(de, now)
        elif de.name.endswith(EXTENT_SUFFIX):
            _scan_extent(de, ns, seal, result)
    return result


def is_stale_temp(de: os.DirEntry[str], now: float) -> bool:
    """The rule for temp files (also used by `sgl-hicache fsck --repair`): stale if its writer is of
    this host, boot and pid namespace and dead (pid gone, or reused: `owner.liveness`), or if the
    file was not written for STALE_TEMP_S, whoever wrote it. Never by a local pid check alone for
    another host's file: a live writer rewrites its temp file at least every GROUP_BYTES (16 MiB),
    so ten minutes without a write is a writer dead or hung (hosts' clocks must agree to within a
    few minutes: the mtime is set by the file server). Raises FileNotFoundError if it vanished."""
    return _stale(de.name, lambda: de.stat().st_mtime, now)


def temp_still_stale(path: str) -> bool:
    """`is_stale_temp` again, from a fresh stat, just before removing (the writer may have resumed);
    False if the file is gone."""
    try:
        return _stale(os.path.basename(path), lambda: os.stat(path).st_mtime, time.time())
    except FileNotFoundError:
        return False


def _stale(name: str, mtime: Callable[[], float], now: float) -> bool:
    writer = temp_writer(name)
    if writer is not None and liveness(writer) is Liveness.DEAD:
        return True
    return now - mtime() >= STALE_TEMP_S


def _remove_if_stale(de: os.DirEntry[str], now: float) -> int:
    try:
        if not is_stale_temp(de, now):
            return 0
        os.unlink(de.path)
        return 1
    except FileNotFoundError:
        return 0


def _scan_extent(de: os.DirEntry[str], ns: NamespaceId, seal: DirectoryMac, result: ScanResult) -> None:
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
    except NewerFormat:
        result.newer += 1
        return
    except FormatError:
        _unlink(de.path)
        result.removed_bad += 1
        return
    entry = Entry(ExtentKey(h.parent), h.token_count, h.payload_len, size, h.created_ns / 1e9)
    result.entries.append((h.created_ns, ExtentKey(h.key), entry))


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
