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
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash
import zstandard

from sgl_hicache.config import Compression, Fsync, TierConfig
from sgl_hicache.tier.aliases import write_aliases
from sgl_hicache.tier.directio import O_DIRECT, alloc_aligned, is_aligned, pwritev_exact
from sgl_hicache.tier.format import (
    Alias,
    Chunk,
    Header,
    Seal,
    align_up,
    chunk_spans,
    encode_header,
    header_bound,
    section_lengths,
)
from sgl_hicache.tier.keys import KEY_BYTES, ExtentKey, KVLayout, Namespace, token_digest, tokens_to_bytes
from sgl_hicache.tier.paths import FILE_MODE, ExtentPaths

GROUP_BYTES = 16 << 20  # hashed, then written in one pwritev
_local = threading.local()


class Debris(Exception):
    """A failed write left a file on disk: its temp file, which could not be removed either
    (`published` False), or the published extent, whose directory fsync failed (True). `error` is
    the failure to report."""

    def __init__(self, error: BaseException, published: bool) -> None:
        super().__init__(str(error))
        self.error, self.published = error, published


@dataclass(frozen=True)
class StoreRequest:
    key: ExtentKey
    parent: ExtentKey
    token_count: int
    token_digest: bytes  # keys.token_digest
    tokens: bytes | None  # <u4 token ids to record in the header, or None (a salted tenant's)
    payload: memoryview  # format "B", contiguous
    aliases: tuple[Alias, ...] = ()  # recorded in the meta and published (aliases.py)
    salt_tag: bytes | None = None  # format.Seal.salt of the writer's cache_salt (purge.py)
    group_layers: int = 0  # the payload's layer groups (format v6); 0: page-major
    sections: tuple[int, ...] = ()  # raw bytes of each group's section (empty: one, the payload)

    @classmethod
    def of(
        cls, key: ExtentKey, parent: ExtentKey, tokens: Sequence[int] | np.ndarray, payload: memoryview,
        store_tokens: bool = True, aliases: Sequence[tuple[int, bytes]] = (), salt_tag: bytes | None = None,
        group_layers: int = 0, layout: KVLayout | None = None,
    ) -> StoreRequest:  # fmt: skip
        """The request to store `payload` as `key` with header fields for `tokens` (not checked
        against `key`: the tier does that); `group_layers` > 0: `payload` is layer-grouped, whole
        pages of `layout`'s layers. Raises ValueError for token ids outside u32, for aliases out of
        1..len(tokens), not increasing, or not 16-byte keys, and for a grouped payload that is not
        whole pages of equal layers."""
        data = tokens_to_bytes(tokens)
        count = len(data) // 4
        marks = tuple(Alias(int(o), bytes(k)) for o, k in aliases)
        offsets = [a.offset for a in marks]
        if offsets != sorted(set(offsets)) or any(not 0 < o <= count for o in offsets):
            raise ValueError("alias offsets must increase within 1..token count")
        if any(len(a.path_key) != KEY_BYTES for a in marks):
            raise ValueError("alias path keys are 16 bytes")
        digest = token_digest(tokens)
        sections: tuple[int, ...] = ()
        if group_layers:
            if layout is None or group_layers > layout.num_layers:
                raise ValueError(f"layer groups of {group_layers} layers need the namespace's layout")
            sections = section_lengths(
                payload.nbytes, count, layout.page_size, layout.num_layers, group_layers
            )
        return cls(key, parent, count, digest, data if store_tokens else None, payload, marks, salt_tag,
                   group_layers if len(sections) > 1 else 0, sections if len(sections) > 1 else ())  # fmt: skip


@dataclass(frozen=True)
class Prepared:
    """An extent ready to write: the bytes of each chunk as stored and where they go."""

    req: StoreRequest
    header_len: int
    stored: list[memoryview | bytes]
    offsets: list[int]  # from the payload start, multiples of 4096

    @property
    def stored_len(self) -> int:
        return align_up(self.offsets[-1] + len(self.stored[-1])) if self.stored else 0

    @property
    def file_bytes(self) -> int:
        return self.header_len + self.stored_len


def prepare(req: StoreRequest, cfg: TierConfig) -> Prepared:
    """Split (and compress) the payload, each layer group's section into its own chunks; no I/O, no
    checksums yet. Knows the exact file size."""
    spans = chunk_spans(req.sections or (req.payload.nbytes,), cfg.chunk_bytes)
    pieces = [req.payload[o : o + n] for o, n in spans]
    stored: list[memoryview | bytes] = list(pieces)
    if cfg.compression is Compression.ZSTD:
        stored = [_compressor(cfg.zstd_level).compress(p) for p in pieces]
    offsets, offset = [], 0
    for s in stored:
        offsets.append(offset)
        offset += align_up(len(s))
    return Prepared(req, header_bound(len(req.tokens or b""), len(stored), len(req.aliases)), stored, offsets)


def write_extent(
    prep: Prepared, cfg: TierConfig, ns: Namespace, paths: ExtentPaths, direct: bool, seal: Seal,
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


def sealed_header(prep: Prepared, cfg: TierConfig, ns: Namespace, chunks: list[Chunk], seal: Seal) -> bytes:
    """The extent's header, sealed, for the chunks as stored (files and Mooncake objects alike)."""
    req = prep.req
    header = Header(
        namespace=ns.id, key=req.key, parent=req.parent, layout=ns.layout, compression=cfg.compression,
        token_count=req.token_count, token_digest=req.token_digest, chunk_bytes=cfg.chunk_bytes,
        payload_len=req.payload.nbytes, stored_len=prep.stored_len, created_ns=time.time_ns(),
        header_len=prep.header_len, group_layers=req.group_layers,
    )  # fmt: skip
    return encode_header(header, req.tokens, chunks, seal, req.aliases, req.salt_tag)


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


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache: dict[int, zstandard.ZstdCompressor] = _local.__dict__.setdefault("zstd", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level]


def _sync_dir(directory: Path) -> None:
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
