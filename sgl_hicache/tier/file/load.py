"""Reading one extent: open and verify the header, then read and verify the chunks of a prefix.

Before any payload byte is read, the header and meta MACs prove the file was written with this
directory's secret (so the chunk checksums are ours too) and the key is re-derived from the
header's parent, token count and token digest. Every chunk is checked against its xxh3-64 before
its bytes count as loaded; any mismatch, short read (truncation), bad MAC or header, foreign
namespace or key raises (FormatError / ShortIO), which the job reports as CORRUPT (a key that does
not match: Mismatch, MISMATCH). Chunks are independent so a large extent is read by several threads.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from sgl_hicache.config import Compression
from sgl_hicache.tier.codec import Plan, check_identity, decode_chunk, verify_chunk
from sgl_hicache.tier.directio import O_DIRECT, alloc_aligned, is_aligned, pread_exact
from sgl_hicache.tier.file.budget.index import Entry
from sgl_hicache.tier.format import (
    ALIGN,
    Alias,
    Chunk,
    DirectoryMac,
    FormatError,
    Header,
    Piece,
    align_up,
    decode_aliases,
    decode_fixed,
    decode_meta,
)
from sgl_hicache.tier.keys import ExtentKey, NamespaceId
from sgl_hicache.tier.progress import LoadProgress
from sgl_hicache.tier.results import Ticket

_local = threading.local()


def _scratch(nbytes: int) -> memoryview:
    buf: memoryview | None = getattr(_local, "rbuf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _local.rbuf = alloc_aligned(align_up(nbytes))
    return buf[:nbytes]


@dataclass(frozen=True)
class OpenExtent:
    """An open extent file whose header and chunk table were verified. Owner closes `fd`."""

    fd: int
    direct: bool
    header: Header
    tokens: bytes | None  # <u4 token ids, None if the writer did not store them
    chunks: list[Chunk]
    aliases: tuple[Alias, ...] = ()  # the writer's path keys inside the extent (v4; path_lookup.py)


def open_extent(
    path: os.PathLike[str] | str, ns: NamespaceId, key: ExtentKey, direct: bool, seal: DirectoryMac | None
) -> OpenExtent:
    """Open and verify (MACs unless `seal` is None: tools without the secret only); raises
    FileNotFoundError (miss), Mismatch (not what `key` names), FormatError/ShortIO (corrupt), OSError."""
    fd = os.open(path, os.O_RDONLY | (O_DIRECT if direct else 0))
    try:
        header, tokens, chunks, aliases = _read_header(fd, direct, seal)
        check_identity(header, ns, key)
        if os.fstat(fd).st_size < header.file_size:
            raise FormatError(f"truncated extent: {os.fstat(fd).st_size} < {header.file_size} bytes")
    except BaseException:
        os.close(fd)
        raise
    return OpenExtent(fd, direct, header, tokens, chunks, aliases)


def _read_header(
    fd: int, direct: bool, seal: DirectoryMac | None
) -> tuple[Header, bytes | None, list[Chunk], tuple[Alias, ...]]:
    first = _scratch(ALIGN)
    pread_exact(fd, first, 0)
    header = decode_fixed(first, seal)
    buf = first
    if header.header_len != ALIGN:
        buf = alloc_aligned(header.header_len)
        pread_exact(fd, buf, 0)
    tokens, chunks = decode_meta(header, buf, seal)
    return header, tokens, chunks, decode_aliases(header, buf, seal)


def read_chunk(ext: OpenExtent, piece: Piece, dest: memoryview) -> int:
    """Load `piece` (its chunk's first `need` bytes) into `dest` at its place, verified; returns
    the bytes loaded."""
    h, chunk = ext.header, ext.chunks[piece.chunk]
    file_off = h.header_len + chunk.offset
    target = dest[piece.dest_off : piece.dest_off + chunk.length]
    in_place = h.compression is Compression.NONE and piece.need == piece.raw_len
    if in_place and (not ext.direct or is_aligned(target)):
        pread_exact(ext.fd, target, file_off)
        verify_chunk(target, chunk, piece.chunk)
        return piece.need
    buf = _scratch(align_up(chunk.length) if ext.direct else chunk.length)
    pread_exact(ext.fd, buf, file_off)
    stored = buf[: chunk.length]
    verify_chunk(stored, chunk, piece.chunk)
    raw = decode_chunk(stored, h.compression, piece.raw_len)
    dest[piece.dest_off : piece.dest_off + piece.need] = raw[: piece.need]
    return piece.need


class LoadState(LoadProgress):
    """A load in flight whose header was verified: one job per piece (`LoadProgress`: pieces finish
    in any order, the first error wins, `landed` is the verified prefix)."""

    def __init__(self, ticket: Ticket, key: ExtentKey, ext: OpenExtent, dest: memoryview, want: int,
                 seen: Entry | None, plan: Plan) -> None:  # fmt: skip
        super().__init__(plan, want)
        self.ticket, self.key, self.ext, self.dest = ticket, key, ext, dest
        self.seen = seen  # the key's index entry when the load began (`FileTier._fail`)
