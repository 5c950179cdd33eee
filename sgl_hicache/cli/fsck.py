"""`sgl-hicache fsck`: verify every chunk of every extent with the tier's own load code.

Header and meta MACs are verified with the directory's secret when it can be read (run fsck as the
server's user, or root); the summary line says whether they were. A problem is `corrupt` (any
FormatError or short read: what a load would report CORRUPT), `stale-temp` (a crashed writer's
temp file) or `unreadable` (another OSError such as EIO or EACCES). `--repair` removes the first
two kinds, as the tier itself would; unreadable files are kept for the operator to look at. An
extent of a newer format version (a newer sgl_hicache shares the directory) is no problem: listed as
`newer`, never verified nor removed (its writer's version reads it).

`--cache-salt SALT` also lists every extent of that tenant salt (`salt`: its MAC'd tag is the
salt's, tier/file/purge.py) and every older one whose salt cannot be told (`salt?`: format v3/v4 without
token ids): after a purge there must be none. With `--repair` they are removed too (a purge
without a server). It needs the directory's secret (the tag is keyed with it).

Temp files follow the tier's rule (`scan.is_stale_temp`): a writer of this host dead, or no write for
STALE_TEMP_S, never a local pid check of another host's file; re-checked just before removal (a hung
writer may have resumed). After repairs, the root's shared budget is recounted from the files
(`ledger.Ledger.resync`), so servers sharing the root get back the room of what was removed.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from sgl_hicache.cli.tier_files import NsFiles, UsageError, classify, directory_seal, key_of, namespace_dirs
from sgl_hicache.tier.directio import O_DIRECT, ShortIO, alloc_aligned
from sgl_hicache.tier.file.budget.filelock import NoLocks
from sgl_hicache.tier.file.budget.ledger import LEDGER_NAME, close_ledger, open_ledger
from sgl_hicache.tier.file.load import open_extent, read_chunk
from sgl_hicache.tier.file.purge import salt_mark
from sgl_hicache.tier.file.scan import temp_still_stale
from sgl_hicache.tier.format import DirectoryMac, FormatError, NewerFormat, load_pieces
from sgl_hicache.tier.keys import ExtentKey, NamespaceId

VERIFY_THREADS = 4  # each holds one extent's whole payload in memory while verifying it
_local = threading.local()


class Problem(NamedTuple):
    kind: str  # corrupt | stale-temp | unreadable | salt | salt? | newer (no problem: only listed)
    path: str
    detail: str


def verify_extent(de: os.DirEntry[str], ns: NamespaceId, seal: DirectoryMac | None) -> Problem | None:
    """Verify header, meta and every chunk as a full load would (MACs only with a `seal`);
    O_DIRECT where the filesystem allows it, so the device is checked rather than the page cache."""
    key = key_of(de)
    if key is None:
        return Problem("corrupt", de.path, "misnamed or misplaced: loads never find it")
    try:
        try:
            _read_all(de.path, ns, key, bool(O_DIRECT), seal)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            _read_all(de.path, ns, key, False, seal)
    except FileNotFoundError:
        return None  # evicted meanwhile by a server sharing the directory
    except NewerFormat as e:
        return Problem("newer", de.path, str(e))
    except (FormatError, ShortIO) as e:
        return Problem("corrupt", de.path, str(e))
    except OSError as e:
        return Problem("unreadable", de.path, str(e))
    return None


def _read_all(path: str, ns: NamespaceId, key: ExtentKey, direct: bool, seal: DirectoryMac | None) -> None:
    ext = open_extent(path, ns, key, direct, seal)
    try:
        dest = _scratch(ext.header.payload_len)
        for piece in load_pieces(ext.header, ext.header.payload_len):
            read_chunk(ext, piece, dest)
    finally:
        os.close(ext.fd)


def _scratch(nbytes: int) -> memoryview:
    """This thread's destination buffer, grown to the largest payload seen (page-aligned)."""
    buf: memoryview | None = getattr(_local, "dest", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _local.dest = alloc_aligned(nbytes)
    return buf[:nbytes]


def problems_of(files: NsFiles, seal: DirectoryMac | None, pool: ThreadPoolExecutor) -> Iterator[Problem]:
    yield from (p for p in pool.map(lambda de: verify_extent(de, files.ns, seal), files.extents) if p)
    yield from (
        Problem("stale-temp", p, "writer dead on this host, or not written for 10 minutes")
        for p in files.stale_temps
    )


def cmd_fsck(root: Path, repair: bool, cache_salt: str | None = None) -> int:
    """Print one line per problem (`removed` once repaired) and a summary (saying whether MACs
    were verified); 1 if any remain. Raises UsageError for a salt without a readable secret."""
    namespaces = [classify(d, time.time()) for d in namespace_dirs(root)]
    seal, macs = directory_seal(root)
    if cache_salt is not None and seal is None:
        raise UsageError(
            f"--cache-salt needs the directory's secret, and {macs.removeprefix('MACs NOT verified: ')}"
        )
    with ThreadPoolExecutor(VERIFY_THREADS, thread_name_prefix="sgl-hicache-fsck") as pool:
        found = [p for files in namespaces for p in problems_of(files, seal, pool)]
    newer = [p for p in found if p.kind == "newer"]
    problems = [p for p in found if p.kind != "newer"]
    if cache_salt is not None and seal is not None:
        problems += salt_problems(namespaces, seal, cache_salt)
    for p in newer:
        print(f"{p.kind}  {p.path}  ({p.detail})")
    remaining = 0
    for p in problems:
        fixed = repair and _repairable(p) and _remove(p.path)
        remaining += not fixed
        print(f"{'removed ' + p.kind if fixed else p.kind}  {p.path}  ({p.detail})")
    if repair and len(problems) > remaining:
        _recount_budget(root)
    extents = sum(len(f.extents) for f in namespaces)
    removed = f", {len(problems) - remaining} removed" if repair else ""
    kept = f", {len(newer)} of a newer format version (kept)" if newer else ""
    print(
        f"fsck: {extents} extents in {len(namespaces)} namespaces, {len(problems)} problems{removed}{kept}; {macs}"
    )
    return 1 if remaining else 0


def salt_problems(namespaces: list[NsFiles], seal: DirectoryMac, cache_salt: str) -> list[Problem]:
    """The extents of `cache_salt` (and those whose salt cannot be told), as problems."""
    tag, found = seal.salt(cache_salt), []
    for de in (de for files in namespaces for de in files.extents):
        mark = salt_mark(de.path, seal)
        if mark is None or mark.newer:  # a newer version's: listed as such, its own fsck tells
            continue
        if mark.tag == tag:
            found.append(Problem("salt", de.path, "holds KV of that cache_salt"))
        elif not mark.known:
            found.append(Problem("salt?", de.path, "format v3/v4 without token ids: its salt cannot be told"))
    return found


def _repairable(p: Problem) -> bool:
    return p.kind in ("corrupt", "salt", "salt?") or (p.kind == "stale-temp" and temp_still_stale(p.path))


def _recount_budget(root: Path) -> None:
    if not (root / LEDGER_NAME).exists():
        return
    try:
        ledger = open_ledger(root)
    except (NoLocks, OSError) as e:
        print(f"shared budget not recounted: {e}", file=sys.stderr)
        return
    try:
        ledger.resync()
    finally:
        close_ledger(ledger)


def _remove(path: str) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return True
    except OSError as e:
        print(f"cannot remove {path}: {e.strerror}", file=sys.stderr)
        return False
    return True
