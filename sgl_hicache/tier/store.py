"""Writing one extent: chunk checksums (and zstd), header, temp file, fsync, atomic rename.

A reader can never see a partial extent: the file is complete (and fdatasync'ed under
Fsync.DATA/FULL) before `os.replace` gives it its final name; on any error the temp file is
removed and the error propagates to the job, which reports it as a Completion.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import xxhash
import zstandard

from sgl_hicache.config import Compression, Fsync, TierConfig
from sgl_hicache.tier.directio import O_DIRECT, alloc_aligned, is_aligned, pwrite_exact
from sgl_hicache.tier.format import Chunk, Header, align_up, encode_header
from sgl_hicache.tier.keys import ExtentKey, Namespace
from sgl_hicache.tier.paths import FILE_MODE, ExtentPaths


@dataclass(frozen=True)
class StoreRequest:
    key: ExtentKey
    parent: ExtentKey
    tokens: bytes  # <u4 token ids
    payload: memoryview  # format "B", contiguous


_local = threading.local()


def _scratch(nbytes: int) -> memoryview:
    """A per-thread aligned bounce buffer of at least `nbytes` (grown on demand)."""
    buf: memoryview | None = getattr(_local, "wbuf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _local.wbuf = alloc_aligned(align_up(nbytes))
    return buf


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache: dict[int, zstandard.ZstdCompressor] = _local.__dict__.setdefault("zstd", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level]


def _raw_pieces(payload: memoryview, chunk_bytes: int) -> list[memoryview]:
    return [payload[off : off + chunk_bytes] for off in range(0, payload.nbytes, chunk_bytes)]


def plan_chunks(req: StoreRequest, cfg: TierConfig) -> tuple[list[Chunk], list[memoryview | bytes]]:
    """The chunk table and the stored bytes of each chunk (compressed ones padded to 4096 offsets)."""
    pieces = _raw_pieces(req.payload, cfg.chunk_bytes)
    stored: list[memoryview | bytes] = list(pieces)
    if cfg.compression is Compression.ZSTD:
        stored = [_compressor(cfg.zstd_level).compress(p) for p in pieces]
    chunks, offset = [], 0
    for s in stored:
        chunks.append(Chunk(offset, len(s), xxhash.xxh3_64_intdigest(s)))
        offset += align_up(len(s))
    return chunks, stored


def build_header(req: StoreRequest, cfg: TierConfig, ns: Namespace, chunks: list[Chunk]) -> bytes:
    stored_len = align_up(chunks[-1].offset + chunks[-1].length) if chunks else 0
    header = Header(
        namespace=ns.id, key=req.key, parent=req.parent, layout=ns.layout,
        compression=cfg.compression, token_count=len(req.tokens) // 4, chunk_bytes=cfg.chunk_bytes,
        payload_len=req.payload.nbytes, stored_len=stored_len, created_ns=time.time_ns(),
    )  # fmt: skip
    return encode_header(header, req.tokens, chunks)


def _write_block(fd: int, data: memoryview | bytes, offset: int) -> None:
    """Write `data` at `offset`, directly if aligned, else through a zero-padded aligned bounce buffer."""
    view = memoryview(data)
    if not view.readonly and is_aligned(view):
        pwrite_exact(fd, view, offset)
        return
    padded = align_up(view.nbytes)
    buf = _scratch(padded)
    buf[: view.nbytes] = view
    buf[view.nbytes : padded] = bytes(padded - view.nbytes)
    pwrite_exact(fd, buf[:padded], offset)


@dataclass(frozen=True)
class Prepared:
    """An extent ready to write: its header bytes, chunk table and the stored bytes of each chunk."""

    key: ExtentKey
    header: bytes
    chunks: list[Chunk]
    stored: list[memoryview | bytes]

    @property
    def file_bytes(self) -> int:
        last = self.chunks[-1] if self.chunks else Chunk(0, 0, 0)
        return len(self.header) + align_up(last.offset + last.length)


def prepare(req: StoreRequest, cfg: TierConfig, ns: Namespace) -> Prepared:
    """Checksum (and compress) the payload and build the header; no I/O."""
    chunks, stored = plan_chunks(req, cfg)
    return Prepared(req.key, build_header(req, cfg, ns, chunks), chunks, stored)


def write_extent(prep: Prepared, paths: ExtentPaths, direct: bool, fsync: Fsync) -> None:
    """Publish `prep` under its final name. Raises OSError; the temp file is then removed."""
    tmp = paths.temp_for(prep.key)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (O_DIRECT if direct else 0)
    fd = os.open(tmp, flags, FILE_MODE)
    try:
        _write_body(fd, prep.header, prep.chunks, prep.stored, fsync)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    _publish(tmp, paths.extent(prep.key), fsync)


def _write_body(
    fd: int, header: bytes, chunks: list[Chunk], stored: list[memoryview | bytes], fsync: Fsync
) -> None:
    for chunk, data in zip(chunks, stored, strict=True):
        _write_block(fd, data, len(header) + chunk.offset)
    _write_block(fd, header, 0)
    if fsync is not Fsync.NONE:
        os.fdatasync(fd)


def _publish(tmp: Path, final: Path, fsync: Fsync) -> None:
    try:
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync is Fsync.FULL:
        dfd = os.open(final.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
