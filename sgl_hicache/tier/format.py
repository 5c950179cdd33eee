"""Extent file format (see docs/FORMAT.md): fixed header, msgpack meta, 4096-aligned payload.

    [0, FIXED_SIZE)            fixed header (struct `_FIXED`, little-endian), own xxh3-64
    [FIXED_SIZE, +meta_len)    msgpack {"t": token ids (<u4 bytes), "c": [[offset, length, xxh3-64], ...]}
    [header_len, ...)          payload chunks; header_len and every chunk offset are multiples of 4096

Chunk i holds raw payload bytes [i * chunk_bytes, (i + 1) * chunk_bytes); its checksum covers the
bytes as stored (compressed or not), so a prefix read verifies only the chunks it touches.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from typing import NamedTuple

import msgpack
import xxhash

from sgl_hicache.config import Compression
from sgl_hicache.tier.keys import KEY_BYTES, ExtentKey, KVDtype, KVLayout, NamespaceId

MAGIC = b"SGLHCEXT"
VERSION = 2  # 2: extent keys are chain_key(parent path, tokens), checked on load
ALIGN = 4096
EXTENT_SUFFIX = ".ext"
TEMP_SUFFIX = ".tmp"

_FIXED = struct.Struct("<8sHHI16s16s16sIIIIBBHIIIQQIQQQ")
FIXED_SIZE = _FIXED.size
_COMPRESSION_CODES = {Compression.NONE: 0, Compression.ZSTD: 1}
_CODE_COMPRESSION = {v: k for k, v in _COMPRESSION_CODES.items()}
_ZERO8 = bytes(8)
_CHUNK_ENTRY_MAX = 1 + 3 * 9  # msgpack fixarray of three uint64


class FormatError(ValueError):
    """The bytes are not a valid extent of this format version and namespace."""


class Mismatch(FormatError):
    """A well-formed extent that is not what was asked for: its parent and tokens do not hash to
    its key, or it holds fewer payload bytes than requested."""


def align_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


@dataclass(frozen=True)
class Chunk:
    """One stored chunk: `offset` from the payload start, `length` stored bytes, `xxh` of them."""

    offset: int
    length: int
    xxh: int


@dataclass(frozen=True)
class Header:
    """Everything in an extent file except the payload."""

    namespace: NamespaceId
    key: ExtentKey
    parent: ExtentKey
    layout: KVLayout
    compression: Compression
    token_count: int
    chunk_bytes: int
    payload_len: int
    stored_len: int
    created_ns: int
    header_len: int = 0
    meta_len: int = 0
    meta_xxh: int = 0

    @property
    def file_size(self) -> int:
        return self.header_len + self.stored_len

    def chunk_count(self, nbytes: int) -> int:
        """Chunks covering the first `nbytes` raw payload bytes."""
        return -(-min(nbytes, self.payload_len) // self.chunk_bytes)


def header_bound(token_bytes: int, n_chunks: int) -> int:
    """A header length (multiple of 4096) that fits any meta for these sizes (msgpack ints <= 9 B)."""
    return align_up(FIXED_SIZE + 16 + token_bytes + 5 + n_chunks * _CHUNK_ENTRY_MAX)


def encode_header(header: Header, tokens: bytes, chunks: list[Chunk]) -> bytes:
    """Fixed header + meta, zero-padded to `header.header_len` (0: the least multiple of 4096)."""
    meta = msgpack.packb({"t": tokens, "c": [[c.offset, c.length, c.xxh] for c in chunks]})
    header_len = header.header_len or align_up(FIXED_SIZE + len(meta))
    if header_len < FIXED_SIZE + len(meta) or header_len % ALIGN:
        raise ValueError(f"header_len {header_len} cannot hold {FIXED_SIZE + len(meta)} header bytes")
    h = replace(header, header_len=header_len, meta_len=len(meta), meta_xxh=xxhash.xxh3_64_intdigest(meta))
    fixed = _pack(h, 0)
    fixed = _pack(h, xxhash.xxh3_64_intdigest(fixed))
    return fixed + meta + bytes(header_len - FIXED_SIZE - len(meta))


def _pack(h: Header, header_xxh: int) -> bytes:
    lay = h.layout
    return _FIXED.pack(
        MAGIC, VERSION, 0, h.header_len, h.namespace, h.key, h.parent,
        lay.num_layers, lay.num_heads, lay.head_dim, lay.page_size, int(lay.dtype),
        _COMPRESSION_CODES[h.compression], 0, h.token_count, h.chunk_bytes,
        h.chunk_count(h.payload_len), h.payload_len, h.stored_len, h.meta_len, h.meta_xxh,
        h.created_ns, header_xxh,
    )  # fmt: skip


class IndexFields(NamedTuple):
    """What the startup scan needs from a fixed header (no dataclasses: 100k files per second)."""

    namespace: bytes
    key: bytes
    parent: bytes
    token_count: int
    payload_len: int
    file_size: int
    created_ns: int


def peek_index(buf: bytes) -> IndexFields:
    """Check magic, version and header checksum of a fixed header; raises FormatError."""
    if len(buf) < FIXED_SIZE:
        raise FormatError(f"truncated header: {len(buf)} < {FIXED_SIZE} bytes")
    f = _FIXED.unpack_from(buf)
    if f[0] != MAGIC or f[1] != VERSION or xxhash.xxh3_64_intdigest(buf[: FIXED_SIZE - 8] + _ZERO8) != f[-1]:
        raise FormatError("bad magic, version or header checksum")
    return IndexFields(f[4], f[5], f[6], f[14], f[17], f[3] + f[18], f[21])


def decode_fixed(buf: bytes | memoryview) -> Header:
    """Decode and verify the fixed header (the first FIXED_SIZE bytes); raises FormatError."""
    if len(buf) < FIXED_SIZE:
        raise FormatError(f"truncated header: {len(buf)} < {FIXED_SIZE} bytes")
    f = _FIXED.unpack(bytes(buf[:FIXED_SIZE]))
    if f[0] != MAGIC:
        raise FormatError("bad magic")
    if f[1] != VERSION:
        raise FormatError(f"unsupported format version {f[1]}")
    if xxhash.xxh3_64_intdigest(bytes(buf[: FIXED_SIZE - 8]) + _ZERO8) != f[-1]:
        raise FormatError("header checksum mismatch")
    if f[12] not in _CODE_COMPRESSION or f[11] not in KVDtype._value2member_map_:
        raise FormatError("unknown compression or dtype code")
    header = Header(
        namespace=NamespaceId(f[4]), key=ExtentKey(f[5]), parent=ExtentKey(f[6]),
        layout=KVLayout(f[7], f[8], f[9], KVDtype(f[11]), f[10]),
        compression=_CODE_COMPRESSION[f[12]], token_count=f[14], chunk_bytes=f[15],
        payload_len=f[17], stored_len=f[18], created_ns=f[21], header_len=f[3], meta_len=f[19], meta_xxh=f[20],
    )  # fmt: skip
    _check_sizes(header, n_chunks=f[16])
    return header


def _check_sizes(h: Header, n_chunks: int) -> None:
    if h.chunk_bytes <= 0 or h.chunk_bytes % ALIGN or h.header_len % ALIGN:
        raise FormatError("header lengths are not 4096-aligned")
    if h.header_len < FIXED_SIZE + h.meta_len or n_chunks != h.chunk_count(h.payload_len):
        raise FormatError("inconsistent header lengths")
    if len(h.key) != KEY_BYTES:
        raise FormatError("bad key length")


def decode_meta(header: Header, buf: bytes | memoryview) -> tuple[bytes, list[Chunk]]:
    """Verify and decode the meta block (bytes [FIXED_SIZE, FIXED_SIZE + meta_len) of the file)."""
    meta = bytes(buf[FIXED_SIZE : FIXED_SIZE + header.meta_len])
    if len(meta) != header.meta_len or xxhash.xxh3_64_intdigest(meta) != header.meta_xxh:
        raise FormatError("meta checksum mismatch or truncated meta")
    obj = msgpack.unpackb(meta)
    tokens, chunks = obj["t"], [Chunk(*c) for c in obj["c"]]
    if len(tokens) != 4 * header.token_count or len(chunks) != header.chunk_count(header.payload_len):
        raise FormatError("meta does not match header")
    for i, c in enumerate(chunks):
        if c.offset % ALIGN or c.offset + c.length > header.stored_len:
            raise FormatError("chunk table out of bounds")
        raw = min(header.chunk_bytes, header.payload_len - i * header.chunk_bytes)
        if header.compression is Compression.NONE and (c.offset, c.length) != (i * header.chunk_bytes, raw):
            raise FormatError("uncompressed chunk table does not match the payload layout")
    return tokens, chunks
