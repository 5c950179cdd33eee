"""What both backends share between a store's bytes and a load's: an extent encoded (split into
chunks, compressed, its header sealed with the directory's MAC key) and decoded (the header's
identity checked, a load planned over the chunks, each chunk verified against its checksum and
decompressed). No I/O here: the file backend (`file/store.py`, `file/load.py`) and the Mooncake
backend (`mooncake/objects.py`) move the bytes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import xxhash
import zstandard

from sgl_hicache.config import Compression, TierConfig
from sgl_hicache.tier.directio import as_view
from sgl_hicache.tier.format import (
    Alias,
    Chunk,
    DirectoryMac,
    FormatError,
    Header,
    Mismatch,
    Piece,
    align_up,
    encode_header,
    header_bound,
    load_pieces,
)
from sgl_hicache.tier.groups import chunk_spans, normal_groups, regroup, section_lengths
from sgl_hicache.tier.keys import (
    KEY_BYTES,
    ExtentKey,
    KVLayout,
    Namespace,
    NamespaceId,
    chain_key_from_digest,
    check_key,
    token_digest,
    tokens_to_bytes,
)
from sgl_hicache.tier.results import Buffer

_local = threading.local()


@dataclass(frozen=True)
class StoreRequest:
    key: ExtentKey
    parent: ExtentKey
    token_count: int
    token_digest: bytes  # keys.token_digest
    tokens: bytes | None  # <u4 token ids to record in the header, or None (a salted tenant's)
    payload: memoryview  # format "B", contiguous
    aliases: tuple[Alias, ...] = ()  # recorded in the meta and published (file/aliases.py)
    salt_tag: bytes | None = None  # format.DirectoryMac.salt of the writer's cache_salt (file/purge.py)
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


def store_request(
    ns: Namespace, mac: DirectoryMac, key: ExtentKey, payload: Buffer, tokens: Sequence[int] | np.ndarray,
    parent: ExtentKey, store_tokens: bool, aliases: Sequence[tuple[int, bytes]], cache_salt: str | None,
    group_layers: int,
) -> StoreRequest:  # fmt: skip
    """`Tier.submit_store`'s arguments as the request a backend stores (its salt tagged with `mac`);
    raises ValueError as `StoreRequest.of` does, and if `key` is not chain_key(namespace, parent,
    tokens) of what it holds."""
    view = as_view(payload, writable=False)
    tag = None if cache_salt is None else mac.salt(cache_salt)
    req = StoreRequest.of(check_key(key), check_key(parent), tokens, view, store_tokens, aliases, tag,
                          group_layers, ns.layout)  # fmt: skip
    if chain_key_from_digest(ns.id, parent, req.token_count, req.token_digest) != key:
        raise ValueError("an extent key must be chain_key(namespace, parent, tokens) of what it holds")
    return req


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


def sealed_header(
    prep: Prepared,
    cfg: TierConfig,
    ns: Namespace,
    chunks: list[Chunk],
    seal: DirectoryMac,
    created_ns: int | None = None,
) -> bytes:
    """The extent's header, sealed, for the chunks as stored (files and Mooncake objects alike);
    `created_ns`: its publish time (now if None; the Mooncake backend names chunks by it)."""
    req = prep.req
    header = Header(
        namespace=ns.id, key=req.key, parent=req.parent, layout=ns.layout, compression=cfg.compression,
        token_count=req.token_count, token_digest=req.token_digest, chunk_bytes=cfg.chunk_bytes,
        payload_len=req.payload.nbytes, stored_len=prep.stored_len,
        created_ns=time.time_ns() if created_ns is None else created_ns,
        header_len=prep.header_len, group_layers=req.group_layers,
    )  # fmt: skip
    return encode_header(header, req.tokens, chunks, seal, req.aliases, req.salt_tag)


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache: dict[int, zstandard.ZstdCompressor] = _local.__dict__.setdefault("zstd", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level]


def check_identity(header: Header, ns: NamespaceId, key: ExtentKey) -> None:
    """The header is of namespace `ns` and key `key` (FormatError), and its parent, token count and
    token digest hash to `key` (Mismatch)."""
    if header.namespace != ns or header.key != key:
        raise FormatError("extent belongs to another namespace or key")
    if chain_key_from_digest(ns, header.parent, header.token_count, header.token_digest) != key:
        raise Mismatch("the extent's parent, token count and token digest do not hash to its key")


class Plan(NamedTuple):
    """How a load of the first `want` payload bytes runs: the chunk `pieces` (`format.load_pieces`)
    and, when the caller wants another layer grouping than the file's (`convert` layers per group,
    `pages` whole pages), the rearrangement done once every piece is verified."""

    pieces: list[Piece]
    convert: int | None = None
    pages: int = 0


def plan_load(h: Header, want: int, group_layers: int | None) -> Plan:
    """The load plan of `want` bytes of `h`'s payload delivered in groups of `group_layers` layers
    (None: the file's own layout). Raises Mismatch for more than the payload holds, ValueError for
    a grouping that cannot be delivered (part of a page, a payload of unequal layers)."""
    pieces = load_pieces(h, want)
    layers = h.layout.num_layers
    if group_layers is None or normal_groups(group_layers, layers) == normal_groups(h.group_layers, layers):
        return Plan(pieces)
    pages = -(-h.token_count // h.layout.page_size)
    if not pages or h.payload_len % (pages * layers) or want % (h.payload_len // pages):
        raise ValueError(f"{want} B of extent {h.key.hex()} cannot be delivered in layer groups")
    return Plan(pieces, group_layers, want // (h.payload_len // pages))


def finish_plan(h: Header, plan: Plan, dest: memoryview, want: int) -> None:
    """After every piece was verified: rearrange `dest[:want]` into the layout the caller asked for."""
    if plan.convert is not None:
        regroup(dest[:want], plan.pages, h.layout.num_layers, h.group_layers, plan.convert)


def verify_chunk(data: memoryview, chunk: Chunk, index: int) -> None:
    if xxhash.xxh3_64_intdigest(data) != chunk.xxh:
        raise FormatError(f"checksum mismatch in chunk {index}")


def decode_chunk(stored: memoryview, compression: Compression, raw_len: int) -> memoryview:
    if compression is Compression.NONE:
        return stored
    try:
        raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=raw_len)
    except zstandard.ZstdError as e:
        raise FormatError(f"zstd: {e}") from None
    if len(raw) != raw_len:
        raise FormatError(f"chunk decompressed to {len(raw)} bytes, expected {raw_len}")
    return memoryview(raw)
