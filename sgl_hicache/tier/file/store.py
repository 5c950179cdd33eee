"""Writing one extent: (zstd,) temp file, chunks checksummed as they go out, header, fsync, rename.

A reader can never see a partial extent: the file is complete (and fdatasync'ed under
Fsync.DATA/FULL) and closed (a close error, as NFS reports write-back errors, fails it too) before
`os.replace` gives it its final name; on any error the temp file is removed and the error
propagates to the job, which reports it as a Completion. A failure that leaves a file behind raises
`Debris` instead, so the caller can account for it: a temp file that could not be removed, or a
file published whose directory fsync (Fsync.FULL) failed afterwards.

Why checksum while writing: hashing holds the GIL, so hashing a whole extent before its first
write would leave the device idle at the start of every burst; hashing one group of chunks, then
writing it (GIL released), overlaps hashing with the other threads' I/O. The header, which holds
the checksums, is written last into room reserved by `header_bound`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import xxhash

from sgl_hicache.config import Fsync, TierConfig
from sgl_hicache.tier.codec import Prepared, sealed_header
from sgl_hicache.tier.directio import O_DIRECT, alloc_aligned, is_aligned, pwritev_exact
from sgl_hicache.tier.file.aliases import write_aliases
from sgl_hicache.tier.file.paths import FILE_MODE, ExtentPaths
from sgl_hicache.tier.format import Chunk, DirectoryMac, align_up
from sgl_hicache.tier.keys import Namespace

GROUP_BYTES = 16 << 20  # hashed, then written in one pwritev
_local = threading.local()


class Debris(Exception):
    """A failed write left a file on disk: its temp file, which could not be removed either
    (`published` False), or the published extent, whose directory fsync failed (True). `error` is
    the failure to report."""

    def __init__(self, error: BaseException, published: bool) -> None:
        super().__init__(str(error))
        self.error, self.published = error, published


def write_extent(
    prep: Prepared, cfg: TierConfig, ns: Namespace, paths: ExtentPaths, direct: bool, seal: DirectoryMac,
    created: Callable[[], None] | None = None,
) -> None:  # fmt: skip
    """Publish `prep` under its final name, sealed with `seal`. `created` is called once the temp
    file exists, before a byte is written: what it raises abandons the write. Raises OSError with
    the temp file removed, or `Debris` when a file is left behind (see the module doc)."""
    tmp, final = paths.temp_for(prep.req.key), paths.extent(prep.req.key)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | (O_DIRECT if direct else 0), FILE_MODE)
    try:
        try:
            if created is not None:
                created()
            chunks = _write_chunks(fd, prep)
            pwritev_exact(fd, [_aligned(sealed_header(prep, cfg, ns, chunks, seal), "header")], 0)
            if cfg.fsync is not Fsync.NONE:
                os.fdatasync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException as e:
        _remove_temp(tmp, e)
        raise
    if cfg.fsync is Fsync.FULL:
        try:
            _sync_dir(final.parent)
        except OSError as e:
            raise Debris(e, published=True) from e
    with contextlib.suppress(OSError):  # the extent is published and valid; only not findable by lookup
        write_aliases(paths, prep.req.key, prep.req.aliases)


def _remove_temp(tmp: Path, error: BaseException) -> None:
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise Debris(error, published=False) from e


def _write_chunks(fd: int, prep: Prepared) -> list[Chunk]:
    chunks = []
    for start, group in _groups(prep):
        views = []
        for i in group:
            data = prep.stored[i]
            chunks.append(Chunk(prep.offsets[i], len(data), xxhash.xxh3_64_intdigest(data)))
            views.append(_aligned(data, "chunk"))
        pwritev_exact(fd, views, prep.header_len + start)
    return chunks


def _groups(prep: Prepared) -> Iterator[tuple[int, list[int]]]:
    """Runs of chunk indices that are contiguous and directly writable (<= GROUP_BYTES); a chunk
    that needs the bounce buffer goes alone (the buffer is reused by the next one)."""
    group: list[int] = []
    size = 0
    for i, data in enumerate(prep.stored):
        direct = _direct_ok(data)
        if group and (not direct or size + len(data) > GROUP_BYTES or not _direct_ok(prep.stored[group[-1]])):
            yield prep.offsets[group[0]], group
            group, size = [], 0
        group.append(i)
        size += len(data)
    if group:
        yield prep.offsets[group[0]], group


def _direct_ok(data: memoryview | bytes) -> bool:
    view = memoryview(data)
    return not view.readonly and is_aligned(view)


def _aligned(data: memoryview | bytes, slot: str) -> memoryview:
    """`data` itself if usable for O_DIRECT, else a copy zero-padded to 4096 in a per-thread buffer."""
    if _direct_ok(data):
        return memoryview(data)
    view = memoryview(data)
    padded = align_up(view.nbytes)
    buf = _scratch(padded, slot)[:padded]
    buf[: view.nbytes] = view
    buf[view.nbytes :] = bytes(padded - view.nbytes)
    return buf


def _scratch(nbytes: int, slot: str) -> memoryview:
    """A per-thread aligned bounce buffer of at least `nbytes` (grown on demand), one per `slot`."""
    bufs: dict[str, memoryview] = _local.__dict__.setdefault("wbufs", {})
    if slot not in bufs or bufs[slot].nbytes < nbytes:
        bufs[slot] = alloc_aligned(align_up(nbytes))
    return bufs[slot]


def _sync_dir(directory: Path) -> None:
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
