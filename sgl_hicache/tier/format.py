"""Extent file format (see docs/FORMAT.md): fixed header, msgpack meta, 4096-aligned payload.

    [0, FIXED_SIZE)            fixed header (struct `_FIXED`, little-endian), ends with two MACs
    [FIXED_SIZE, +meta_len)    msgpack {"c": [[offset, length, xxh3-64], ...], "t": token ids (<u4
                               bytes; only if the writer allowed it: never for salted tenants),
                               "a": [[offset, path key], ...] (v4: the aliases, see path_lookup.py),
                               "s": the salt tag (v5: `DirectoryMac.salt` of the writer's cache_salt; absent
                               for a request without one)}
    [header_len, ...)          payload chunks; header_len and every chunk offset are multiples of 4096

Authenticity (`DirectoryMac`): `meta_mac` = blake2b-128 keyed with the directory's secret over the meta;
`header_mac` = the same over the fixed header's bytes before it (meta_mac included). Checking
header_mac alone vouches for the fixed header (the startup scan); with meta_mac it vouches for the
meta and so for every chunk checksum: only a holder of the secret could have written the file.

Payload layout (v6, `group_layers`, the fixed header's former reserved u16): 0 (every file before
v6) is page-major; g > 0 cuts the layers into groups of g and stores one section per group, each the
page-major layout of its own layers (sgl_hicache_kernels/layout.py `LayerGroups`). Each section is cut into
chunks of `chunk_bytes` raw bytes (its last chunk may be short), in section order, so every chunk
belongs to one group and is verified alone; its checksum covers the bytes as stored (compressed or
not). A prefix of n pages is a prefix of every section (`load_pieces`): a load reads and verifies
only the chunks it touches, group 0's first.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import msgpack
import numpy as np

from sgl_hicache.config import Compression
from sgl_hicache.tier.groups import chunk_spans, chunk_total, section_lengths
from sgl_hicache.tier.keys import KEY_BYTES, ExtentKey, KVDtype, KVLayout, NamespaceId, token_digest

MAGIC = b"SGLHCEXT"
VERSION = 6  # 6: layer-grouped payloads; 5: the salt tag in the meta ("s"); 4: path-key aliases ("a"); 3: keyed MACs
READABLE_VERSIONS = (
    3,
    4,
    5,
    6,
)  # v3-v5: page-major; v3/v4: no salt tag (a purge removes those without token ids); v3: no aliases
GROUPS_VERSION = 6  # the first version whose payload may be layer-grouped
SALT_TAG_VERSION = 5  # the first version whose files say whether (and whose) cache_salt wrote them
ALIGN = 4096
EXTENT_SUFFIX = ".ext"
TEMP_SUFFIX = ".tmp"
MAC_BYTES = 16

_FIXED = struct.Struct("<8sHHI16s16s16sIIIIBBHIIIQQI16sQ16s16s")
FIXED_SIZE = _FIXED.size
_MACED = FIXED_SIZE - MAC_BYTES  # header_mac covers the fixed header before it
_COMPRESSION_CODES = {Compression.NONE: 0, Compression.ZSTD: 1}
_CODE_COMPRESSION = {v: k for k, v in _COMPRESSION_CODES.items()}
_CHUNK_ENTRY_MAX = 1 + 3 * 9  # msgpack fixarray of three uint64
_ALIAS_ENTRY_MAX = 1 + 5 + 2 + KEY_BYTES  # fixarray of a uint32 and a bin8 of 16 bytes
_META_ERRORS = (ValueError, TypeError, KeyError, AttributeError, msgpack.UnpackException)


class FormatError(ValueError):
    """The bytes are not a valid extent of this format version and namespace."""


class NewerFormat(FormatError):
    """An extent of a format version newer than this code reads: a newer sgl_hicache sharing the
    directory wrote it (a rolling upgrade): its fixed header's MAC verifies (`_check_version`). Not
    corrupt: never used here, and never deleted for it. Catch it before FormatError."""


class Mismatch(FormatError):
    """A well-formed extent that is not what was asked for: its parent, token count and token
    digest do not hash to its key, its token ids do not hash to its digest, or it holds fewer
    payload bytes than requested."""


class DirectoryMac:
    """The MACs of one tier directory: blake2b-128 keyed with its secret (`trust.py`)."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def header(self, fixed: bytes) -> bytes:
        return hashlib.blake2b(
            fixed, digest_size=MAC_BYTES, key=self._secret, person=b"sglhc.header.v3"
        ).digest()

    def meta(self, meta: bytes) -> bytes:
        return hashlib.blake2b(
            meta, digest_size=MAC_BYTES, key=self._secret, person=b"sglhc.meta.v3"
        ).digest()

    def record(self, data: bytes) -> bytes:
        """The MAC of a Mooncake manifest record (mooncake/manifest.py)."""
        return hashlib.blake2b(
            data, digest_size=MAC_BYTES, key=self._secret, person=b"sglhc.record.v1"
        ).digest()

    def salt(self, cache_salt: str) -> bytes:
        """The salt tag of `cache_salt`: a keyed digest, never the salt itself, so a purge finds a
        tenant's extents while the files name no tenant to whoever lacks the secret."""
        return hashlib.blake2b(
            cache_salt.encode("utf-8", "surrogatepass"), digest_size=MAC_BYTES, key=self._secret,
            person=b"sglhc.salt.v5",
        ).digest()  # fmt: skip


def align_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


@dataclass(frozen=True)
class Chunk:
    """One stored chunk: `offset` from the payload start, `length` stored bytes, `xxh` of them."""

    offset: int
    length: int
    xxh: int


class Alias(NamedTuple):
    """The extent's first `offset` tokens end where the path named by `path_key` ends (keys.py):
    the writer's path key of its tokens up to there, recorded (MAC'd) so that a reader who computes
    the same key from its own tokens knows where in this extent its prompt continues."""

    offset: int
    path_key: bytes


@dataclass(frozen=True)
class Header:
    """Everything in an extent file except the payload."""

    namespace: NamespaceId
    key: ExtentKey
    parent: ExtentKey
    layout: KVLayout
    compression: Compression
    token_count: int
    token_digest: bytes  # keys.token_digest of the extent's tokens
    chunk_bytes: int
    payload_len: int
    stored_len: int
    created_ns: int
    header_len: int = 0
    meta_len: int = 0
    meta_mac: bytes = bytes(MAC_BYTES)
    group_layers: int = 0  # v6: layers per group of the payload; 0 (every older file): page-major

    @property
    def file_size(self) -> int:
        return self.header_len + self.stored_len

    @property
    def sections(self) -> tuple[int, ...]:
        """Raw bytes of each layer group's section of the payload (one: page-major). Raises
        FormatError for a grouped payload that does not split into equal layer-pages."""
        lay = self.layout
        try:
            return section_lengths(
                self.payload_len, self.token_count, lay.page_size, lay.num_layers, self.group_layers
            )
        except ValueError as e:
            raise FormatError(str(e)) from None

    def raw_chunks(self) -> list[tuple[int, int]]:
        """(raw payload offset, raw length) of every chunk, in chunk-table order."""
        return chunk_spans(self.sections, self.chunk_bytes)

    def chunk_count(self, nbytes: int) -> int:
        """Chunks a load of the first `nbytes` payload bytes reads (`load_pieces`)."""
        return len(load_pieces(self, nbytes))


class Piece(NamedTuple):
    """What a load of a prefix takes of one chunk: chunk number `chunk` (raw bytes [raw_off, raw_off
    + raw_len) of the payload), its first `need` bytes, which go to `dest_off` in the destination."""

    chunk: int
    raw_off: int
    raw_len: int
    need: int
    dest_off: int


def load_pieces(h: Header, want: int) -> list[Piece]:
    """The chunks a load of the first `want` bytes of `h`'s payload (in its own layout) reads, in
    order, and where their bytes go. Page-major: a byte prefix. Grouped: `want` is m whole pages
    (`want / payload_len` of the pages); the destination holds the m-page prefix of each section,
    back to back (the layout of m tokens), group 0 first. Raises Mismatch for more than the
    payload, ValueError for a grouped load of part of a page."""
    if want > h.payload_len:
        raise Mismatch(f"extent holds {h.payload_len} payload bytes, {want} requested")
    sections, spans = h.sections, h.raw_chunks()
    if len(sections) == 1:
        return [Piece(i, off, n, min(n, want - off), off) for i, (off, n) in enumerate(spans) if off < want]
    pages = -(-h.token_count // h.layout.page_size)
    page = h.payload_len // pages
    if want % page:
        raise ValueError(f"a grouped extent loads whole pages of {page} B, not {want} B")
    share, pieces, i, sec_start, dest = want // page, [], 0, 0, 0
    for length in sections:
        need_sec = length // pages * share
        while i < len(spans) and spans[i][0] < sec_start + length:
            off, n = spans[i]
            inside = off - sec_start
            if inside < need_sec:
                pieces.append(Piece(i, off, n, min(n, need_sec - inside), dest + inside))
            i += 1
        sec_start += length
        dest += need_sec
    return pieces


def header_bound(token_bytes: int, n_chunks: int, n_aliases: int = 0) -> int:
    """A header length (multiple of 4096) that fits any meta for these sizes (msgpack ints <= 9 B)."""
    aliases = 8 + n_aliases * _ALIAS_ENTRY_MAX
    salt = 2 + 2 + MAC_BYTES
    return align_up(FIXED_SIZE + 16 + token_bytes + 5 + n_chunks * _CHUNK_ENTRY_MAX + aliases + salt)


def file_bound(payload_len: int, token_count: int, chunk_bytes: int, n_aliases: int,
               sections: Sequence[int] | None = None) -> int:  # fmt: skip
    """The bytes of an uncompressed extent file of these sizes with its token ids (the most its
    header may take: `header_bound`; each chunk padded to 4096; `sections`: the raw bytes of each
    layer group's section, default one). A compressed one is usually smaller."""
    spans = chunk_spans(sections or (payload_len,), chunk_bytes)
    return header_bound(4 * token_count, len(spans), n_aliases) + sum(align_up(n) for _, n in spans)


def encode_header(
    header: Header, tokens: bytes | None, chunks: list[Chunk], seal: DirectoryMac, aliases: Sequence[Alias] = (),
    salt_tag: bytes | None = None,
) -> bytes:  # fmt: skip
    """Fixed header + meta (token ids only if `tokens` is given; `aliases` if any; `salt_tag`, of
    `DirectoryMac.salt`, if the writer had a cache_salt), sealed, zero-padded to `header.header_len` (0: the
    least multiple of 4096)."""
    obj: dict[str, object] = {"c": [[c.offset, c.length, c.xxh] for c in chunks]}
    if tokens is not None:
        obj["t"] = tokens
    if aliases:
        obj["a"] = [[a.offset, a.path_key] for a in aliases]
    if salt_tag is not None:
        obj["s"] = salt_tag
    meta = msgpack.packb(obj)
    header_len = header.header_len or align_up(FIXED_SIZE + len(meta))
    if header_len < FIXED_SIZE + len(meta) or header_len % ALIGN:
        raise ValueError(f"header_len {header_len} cannot hold {FIXED_SIZE + len(meta)} header bytes")
    h = replace(header, header_len=header_len, meta_len=len(meta), meta_mac=seal.meta(meta))
    fixed = _pack(h)[:_MACED]
    return fixed + seal.header(fixed) + meta + bytes(header_len - FIXED_SIZE - len(meta))


def _pack(h: Header) -> bytes:
    lay = h.layout
    return _FIXED.pack(
        MAGIC, VERSION, 0, h.header_len, h.namespace, h.key, h.parent,
        lay.num_layers, lay.num_heads, lay.head_dim, lay.page_size, int(lay.dtype),
        _COMPRESSION_CODES[h.compression], h.group_layers, h.token_count, h.chunk_bytes,
        len(h.raw_chunks()), h.payload_len, h.stored_len, h.meta_len, h.token_digest,
        h.created_ns, h.meta_mac, bytes(MAC_BYTES),
    )  # fmt: skip


class IndexFields(NamedTuple):
    """What the startup scan needs from a fixed header (no dataclasses: 100k files per second)."""

    namespace: bytes
    key: bytes
    parent: bytes
    token_count: int
    token_digest: bytes
    payload_len: int
    file_size: int
    created_ns: int


def peek_index(buf: bytes, seal: DirectoryMac) -> IndexFields:
    """Check magic, version and header MAC of a fixed header; raises FormatError."""
    if len(buf) < FIXED_SIZE:
        raise FormatError(f"truncated header: {len(buf)} < {FIXED_SIZE} bytes")
    f = _FIXED.unpack_from(buf)
    _check_version(f[0], f[1], seal.header(buf[:_MACED]) == f[-1])
    return IndexFields(f[4], f[5], f[6], f[14], f[20], f[17], f[3] + f[18], f[21])


def decode_fixed(buf: bytes | memoryview, seal: DirectoryMac | None) -> Header:
    """Decode and verify the fixed header (the first FIXED_SIZE bytes); raises FormatError.
    `seal` None skips the MAC: only for tools that cannot read the directory's secret."""
    if len(buf) < FIXED_SIZE:
        raise FormatError(f"truncated header: {len(buf)} < {FIXED_SIZE} bytes")
    fixed = bytes(buf[:FIXED_SIZE])
    f = _FIXED.unpack(fixed)
    _check_version(f[0], f[1], seal is None or seal.header(fixed[:_MACED]) == f[-1])
    if f[12] not in _CODE_COMPRESSION or f[11] not in KVDtype._value2member_map_:
        raise FormatError("unknown compression or dtype code")
    try:
        layout = KVLayout(f[7], f[8], f[9], KVDtype(f[11]), f[10])
    except ValueError as e:
        raise FormatError(f"bad layout: {e}") from None
    header = Header(
        namespace=NamespaceId(f[4]), key=ExtentKey(f[5]), parent=ExtentKey(f[6]), layout=layout,
        compression=_CODE_COMPRESSION[f[12]], token_count=f[14], token_digest=f[20], chunk_bytes=f[15],
        payload_len=f[17], stored_len=f[18], created_ns=f[21], header_len=f[3], meta_len=f[19], meta_mac=f[22],
        group_layers=f[13] if f[1] >= GROUPS_VERSION else 0,  # reserved (0) before v6
    )  # fmt: skip
    _check_sizes(header, n_chunks=f[16])
    return header


def _check_version(magic: bytes, version: int, sealed: bool) -> None:
    """Check magic, version and (`sealed`: whether the header MAC verified) the MAC of a fixed
    header. Raises NewerFormat for a sealed header of a version above every readable one (a later
    version keeps this fixed header and its MAC: docs/FORMAT.md, so that a flipped version bit is
    corruption, not a newer file), FormatError for anything else that is not a readable header."""
    if magic != MAGIC:
        raise FormatError("bad magic")
    if version not in READABLE_VERSIONS and version < READABLE_VERSIONS[-1]:
        raise FormatError(f"unsupported format version {version}")
    if not sealed:
        raise FormatError("header MAC mismatch: not written with this directory's secret")
    if version > READABLE_VERSIONS[-1]:
        raise NewerFormat(f"format version {version}, newer than this sgl_hicache reads: kept for its writer")


def _check_sizes(h: Header, n_chunks: int) -> None:
    if h.chunk_bytes <= 0 or h.chunk_bytes % ALIGN or h.header_len % ALIGN:
        raise FormatError("header lengths are not 4096-aligned")
    if h.group_layers > h.layout.num_layers:
        raise FormatError(f"layer groups of {h.group_layers} of {h.layout.num_layers} layers")
    if h.group_layers and -(-h.layout.num_layers // h.group_layers) > 1 << 16:
        raise FormatError(f"{h.layout.num_layers} layers in groups of {h.group_layers}: too many groups")
    if h.header_len < FIXED_SIZE + h.meta_len or n_chunks != chunk_total(h.sections, h.chunk_bytes):
        raise FormatError("inconsistent header lengths")


def decode_meta(
    header: Header, buf: bytes | memoryview, seal: DirectoryMac | None
) -> tuple[bytes | None, list[Chunk]]:
    """Verify and decode the meta block (bytes [FIXED_SIZE, FIXED_SIZE + meta_len) of the file):
    the token ids (None if not stored) and the chunk table. Raises FormatError; Mismatch if the
    stored token ids do not hash to the header's digest. `seal` None: see `decode_fixed`."""
    obj = _meta_obj(header, buf, seal)
    try:
        tokens, chunks = obj.get("t"), [Chunk(*map(int, c)) for c in obj["c"]]
    except _META_ERRORS as e:
        raise FormatError(f"undecodable meta: {e}") from None
    if tokens is not None and (not isinstance(tokens, bytes) or len(tokens) != 4 * header.token_count):
        raise FormatError("meta token ids do not match the header's count")
    spans = header.raw_chunks()
    if len(chunks) != len(spans):
        raise FormatError("meta does not match header")
    stored = 0  # an uncompressed chunk is stored at the 4096-aligned end of the one before
    for c, (_, raw) in zip(chunks, spans, strict=True):
        if c.offset % ALIGN or c.offset + c.length > header.stored_len:
            raise FormatError("chunk table out of bounds")
        if header.compression is Compression.NONE and (c.offset, c.length) != (stored, raw):
            raise FormatError("uncompressed chunk table does not match the payload layout")
        stored += align_up(raw)
    if tokens is not None and token_digest(np.frombuffer(tokens, dtype="<u4")) != header.token_digest:
        raise Mismatch("the extent's token ids do not hash to its token digest")
    return tokens, chunks


def decode_aliases(header: Header, buf: bytes | memoryview, seal: DirectoryMac | None) -> tuple[Alias, ...]:
    """The meta's aliases (none in a v3 file), verified like `decode_meta`: MAC'd, each offset in
    1..token_count, each key 16 bytes, offsets strictly increasing. Raises FormatError."""
    obj = _meta_obj(header, buf, seal)
    try:
        aliases = tuple(Alias(int(o), bytes(k)) for o, k in obj.get("a", ()))
    except _META_ERRORS as e:
        raise FormatError(f"undecodable aliases: {e}") from None
    offsets = [a.offset for a in aliases]
    if any(len(a.path_key) != KEY_BYTES or not 0 < a.offset <= header.token_count for a in aliases):
        raise FormatError("alias out of bounds")
    if offsets != sorted(set(offsets)):
        raise FormatError("alias offsets are not increasing")
    return aliases


def _meta_obj(header: Header, buf: bytes | memoryview, seal: DirectoryMac | None) -> dict[str, Any]:
    meta = bytes(buf[FIXED_SIZE : FIXED_SIZE + header.meta_len])
    if len(meta) != header.meta_len:
        raise FormatError("truncated meta")
    if seal is not None and seal.meta(meta) != header.meta_mac:
        raise FormatError("meta MAC mismatch")
    try:
        obj = msgpack.unpackb(meta)
    except _META_ERRORS as e:
        raise FormatError(f"undecodable meta: {e}") from None
    if not isinstance(obj, dict):
        raise FormatError("meta is not a map")
    return obj


class SaltMark(NamedTuple):
    """Whose cache_salt wrote an extent, as far as its (MAC'd) meta says: `tag` (`DirectoryMac.salt`), or
    None with `known` True (v5: written without a cache_salt), or None with `known` False (v3/v4
    without token ids: some salted or `extra_key` tenant's, which one cannot be told). `newer`: a
    file of a newer format version (`NewerFormat`), which only its writer's version may remove."""

    tag: bytes | None
    known: bool
    newer: bool = False


def decode_salt(header: Header, buf: bytes | memoryview, version: int, seal: DirectoryMac | None) -> SaltMark:
    """The extent's `SaltMark` from its meta, verified like `decode_meta`; raises FormatError."""
    obj = _meta_obj(header, buf, seal)
    tag = obj.get("s")
    if tag is not None and (not isinstance(tag, bytes) or len(tag) != MAC_BYTES):
        raise FormatError("bad salt tag")
    if version >= SALT_TAG_VERSION or tag is not None:
        return SaltMark(tag, True)
    return SaltMark(None, "t" in obj)  # older: token ids are stored for the default tenant only


def version_of(buf: bytes | memoryview) -> int:
    """The format version of a fixed header already decoded by `decode_fixed`."""
    return int(_FIXED.unpack_from(buf)[1])
