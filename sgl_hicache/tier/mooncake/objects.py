"""One extent as Mooncake objects: written chunks first and header last, read and verified like a file.

The bytes are an extent file's (docs/FORMAT.md), cut at its seams: the header object is the file's
first `header_len` bytes (fixed header, MAC'd meta, padding), chunk object i is the file's chunk i as
stored (without its padding). So a load checks exactly what a file load checks, with the same code
(format.py, codec.py): header MAC and meta MAC (sealed with the tier directory's secret), namespace,
key re-derived from the header's parent, token count and digest, the salt tag its meta records
against the salt directory it was found in (client.py: a purge by salt must reach every object the
tier serves for that salt), exact lengths (the header object is `header_len` bytes, each chunk
object its recorded length) and every chunk's xxh3-64 before its bytes count.

Publishing is the header's write, after every chunk's: a reader that finds the header and not a
chunk (evicted since by the master, removed by another client) reports a clean miss. Chunk names
carry the publish's `created_ns` (client.py), so a reader never meets another publish's chunk under
the header it verified. A store finds its key present only if a header that verifies and all its
chunks are there; else it writes them all again.

Store calls (each one call of the store, whatever the number of objects): a store is at most four:
read the header (absent: go on), one batch write of every chunk (`write_many_from`, straight from
the caller's payload: an uncompressed chunk is never copied by us), the header, one batch write of
the aliases; a present extent costs a batch existence check of its chunks instead of the writes.
Loads (load.py) are read a batch at a time: the headers of the batch's loads in one batch read
(`open_headers`: `get_many_into`; a header larger than `HEADER_READ_BYTES` is read again alone at
its size), then their chunks (`read_pieces`, up to `LOAD_BATCH_BYTES` a call): in one more call
for a batch that needs no layer-group order (a restore that is not layer-wise) or of page-major
extents, in one a layer group for a layer-wise restore's, whatever the number of extents. Each
reply is checked and each object verified on its own, so one object's failure is its extent's
only. Whole chunks go straight into the caller's destination and are verified in place (a
transfer the store gave up on may still write there: `written_late`; its load's completion then
says `dest_unsafe`); only a compressed chunk, or the part of a chunk a prefix load needs, passes
through a per-thread scratch buffer (scratch.py: registered with the store, as RDMA needs; spoiled
where such a transfer may write it), as do the headers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import xxhash

from sgl_hicache.config import Compression, TierConfig
from sgl_hicache.tier.codec import (
    Prepared,
    StoreRequest,
    check_identity,
    decode_chunk,
    sealed_header,
    verify_chunk,
)
from sgl_hicache.tier.format import (
    Alias,
    Chunk,
    DirectoryMac,
    FormatError,
    Header,
    NewerFormat,
    Piece,
    decode_aliases,
    decode_fixed,
    decode_meta,
    decode_salt,
    version_of,
)
from sgl_hicache.tier.keys import ExtentKey, Namespace, NamespaceId
from sgl_hicache.tier.mooncake.client import INVALID_PARAMS, Names, Reply, StoreClient
from sgl_hicache.tier.mooncake.scratch import SCRATCH_KEEP_BYTES, Scratch, late_writes

HEADER_READ_BYTES = 64 << 10
"""A header is read into a buffer this large in one call (most headers fit); a larger one is
refused by the store and read again at its size."""
LOAD_BATCH_BYTES = 64 << 20
"""One batch read reads into at most this many bytes (at least one object): a layer group's chunks
across a batch's loads go in one call up to it (load.py), a larger group in several, each verified
prefix reported as it lands; headers (`open_headers`) count HEADER_READ_BYTES each."""
T = TypeVar("T")


class Gone(FileNotFoundError):
    """An object of the extent is not in the store: a clean miss."""


class StoreFailed(OSError):
    """The store refused or did not answer (`reply.code`)."""

    def __init__(self, what: str, reply: Reply) -> None:
        super().__init__(f"mooncake {what}: code {reply.code}")
        self.reply = reply


def _checked(reply: Reply, what: str) -> Reply:
    if reply.gone:
        raise Gone(f"mooncake {what}: not in the store")
    if not reply.ok:
        raise StoreFailed(what, reply)
    return reply


class _PublishClock:
    """`created_ns` of each publish: the time, strictly increasing in this process (chunk names)."""

    def __init__(self) -> None:
        self._lock, self._last = threading.Lock(), 0

    def next(self) -> int:
        with self._lock:
            self._last = max(time.time_ns(), self._last + 1)
            return self._last


_clock = _PublishClock()


def write_objects(client: StoreClient, names: Names, prep: Prepared, cfg: TierConfig, ns: Namespace,
                  seal: DirectoryMac) -> int:  # fmt: skip
    """Put every chunk (one batch), then the sealed header (the publish); the bytes put. Raises
    StoreFailed."""
    req, pub = prep.req, _clock.next()
    views = [memoryview(data).cast("B") for data in prep.stored]
    chunks = [Chunk(prep.offsets[i], v.nbytes, xxhash.xxh3_64_intdigest(v)) for i, v in enumerate(views)]
    chunk_names = [names.chunk(req.key, req.salt_tag, pub, i) for i in range(len(views))]
    for reply in client.write_many_from(chunk_names, views):
        _checked(reply, "chunk write")
    sealed = sealed_header(prep, cfg, ns, chunks, seal, created_ns=pub)
    _checked(client.write(names.header(req.key, req.salt_tag), sealed), "header write")
    return sum(c.length for c in chunks) + len(sealed)


def publish_aliases(client: StoreClient, names: Names, req: StoreRequest) -> None:
    """Best effort, like alias links (one batch): a failed one only makes the extent unfindable there."""
    value = req.key.hex()
    client.write_many([names.alias(a.path_key, req.salt_tag) for a in req.aliases],
                      [f"{value}.{a.offset}".encode() for a in req.aliases])  # fmt: skip


class Opened(NamedTuple):
    """An extent's header read from the store and verified (not its chunks yet); `raw`: the header
    object's bytes as read, to tell later whether the key was re-published since (`header_is`);
    `salt`: the salt tag its meta records (and whose directory it was found in)."""

    header: Header
    tokens: bytes | None
    chunks: list[Chunk]
    aliases: tuple[Alias, ...]
    raw: bytes
    salt: bytes | None

    def chunk_names(self, names: Names) -> list[str]:
        h = self.header
        return [names.chunk(h.key, self.salt, h.created_ns, i) for i in range(len(self.chunks))]


def open_header(client: StoreClient, names: Names, ns: NamespaceId, key: ExtentKey, salt: bytes | None,
                seal: DirectoryMac, scratch: Scratch) -> Opened:  # fmt: skip
    """Read and verify `key`'s header object in the directory of `salt`. Raises Gone, StoreFailed,
    FormatError (Mismatch; NewerFormat)."""
    name = names.header(key, salt)
    with scratch.use(HEADER_READ_BYTES) as buf:
        reply = client.get_into(name, buf)
        scratch.spoil_if_late([reply])
        if reply.code != INVALID_PARAMS:
            return _verified(buf, reply, ns, key, salt, seal)
    return _open_large(client, name, ns, key, salt, seal, scratch)


def open_headers(client: StoreClient, names: Names, ns: NamespaceId, wanted: Sequence[tuple[ExtentKey, bytes | None]],
                 seal: DirectoryMac, scratch: Scratch) -> list[Opened | Exception]:  # fmt: skip
    """`open_header` of each (key, salt) of `wanted` in one batch read (of up to SCRATCH_KEEP_BYTES
    and LOAD_BATCH_BYTES: 64 headers; more take more), each reply checked and verified on its own:
    per pair its header or what `open_header` would have raised for it (one extent's missing or bad
    header leaves the others as they are)."""
    per_call = max(1, min(LOAD_BATCH_BYTES, SCRATCH_KEEP_BYTES) // HEADER_READ_BYTES)
    out: list[Opened | Exception] = []
    for at in range(0, len(wanted), per_call):
        out += _open_some(client, names, ns, wanted[at : at + per_call], seal, scratch)
    return out


def _open_some(client: StoreClient, names: Names, ns: NamespaceId, wanted: Sequence[tuple[ExtentKey, bytes | None]],
               seal: DirectoryMac, scratch: Scratch) -> list[Opened | Exception]:  # fmt: skip
    """A header larger than HEADER_READ_BYTES is read again on its own once the others were
    verified (the scratch buffer's use that holds them ended)."""
    header_names = [names.header(key, salt) for key, salt in wanted]
    with scratch.use(len(wanted) * HEADER_READ_BYTES) as buf:
        slots = [buf[i * HEADER_READ_BYTES : (i + 1) * HEADER_READ_BYTES] for i in range(len(wanted))]
        replies = client.get_many_into(header_names, slots)
        scratch.spoil_if_late(replies)
        out = [
            None if reply.code == INVALID_PARAMS else _attempt(_verified, slot, reply, ns, key, salt, seal)
            for (key, salt), slot, reply in zip(wanted, slots, replies, strict=True)
        ]
    return [
        _attempt(_open_large, client, name, ns, key, salt, seal, scratch) if got is None else got
        for (key, salt), name, got in zip(wanted, header_names, out, strict=True)
    ]


def _open_large(client: StoreClient, name: str, ns: NamespaceId, key: ExtentKey, salt: bytes | None,
                seal: DirectoryMac, scratch: Scratch) -> Opened:  # fmt: skip
    """A header larger than HEADER_READ_BYTES (the store refused that buffer): read at its size."""
    with scratch.use(_checked(client.size(name), "header size").n) as buf:
        reply = client.get_into(name, buf)
        scratch.spoil_if_late([reply])
        return _verified(buf, reply, ns, key, salt, seal)


def _verified(buf: memoryview, reply: Reply, ns: NamespaceId, key: ExtentKey, salt: bytes | None,
              seal: DirectoryMac) -> Opened:  # fmt: skip
    return verify_header(buf[: _checked(reply, "header get").n], ns, key, salt, seal)


def _attempt(fn: Callable[..., T], *args: Any) -> T | Exception:
    """`fn(*args)`, or what it raised: one object's failure, kept apart from the others' of a call."""
    try:
        return fn(*args)
    except Exception as e:
        return e


def verify_header(raw: memoryview | bytes, ns: NamespaceId, key: ExtentKey, salt: bytes | None,
                  seal: DirectoryMac) -> Opened:  # fmt: skip
    """A header object's bytes as read from the directory of `salt`, verified (raises FormatError)."""
    header = decode_fixed(raw, seal)
    tokens, chunks = decode_meta(header, raw, seal)
    aliases = decode_aliases(header, raw, seal)
    check_identity(header, ns, key)
    if len(raw) != header.header_len:
        raise FormatError(f"header object of {len(raw)} bytes, its header says {header.header_len}")
    if decode_salt(header, raw, version_of(raw), seal).tag != salt:
        raise FormatError("the header's salt tag is not its directory's")
    return Opened(header, tokens, chunks, aliases, bytes(raw), salt)


def header_is(client: StoreClient, names: Names, key: ExtentKey, salt: bytes | None, seen: bytes) -> bool:
    """Whether `key`'s header object is still exactly `seen`: False if it was replaced (another
    client re-published the key), removed, or the store did not answer (nothing is proven then)."""
    return client.get(names.header(key, salt)) == seen


def present(client: StoreClient, names: Names, ns: NamespaceId, key: ExtentKey, salt: bytes | None,
            seal: DirectoryMac, scratch: Scratch) -> bool:  # fmt: skip
    """Whether a header of `key` that verifies (ours) and every chunk it names are in the store, or a
    header of a newer format version (a newer server's, which this version never overwrites).
    Raises StoreFailed."""
    try:
        ext = open_header(client, names, ns, key, salt, seal, scratch)
    except NewerFormat:  # a newer server's extent of this key: never overwritten by this version
        return True
    except (Gone, FormatError):
        return False
    return all(x == 1 for x in client.exist(ext.chunk_names(names)))


def remove_extent(client: StoreClient, names: Names, ns: NamespaceId, key: ExtentKey, salt: bytes | None,
                  seal: DirectoryMac, scratch: Scratch) -> bool:  # fmt: skip
    """Remove `key`'s header and the chunks it names (one batch: a reader that finds the header and
    not a chunk misses); whether the header was there."""
    try:
        chunks = open_header(client, names, ns, key, salt, seal, scratch).chunk_names(names)
    except (Gone, FormatError, StoreFailed):
        chunks = []
    return client.remove_many([names.header(key, salt), *chunks])[0].ok


class PieceRead(NamedTuple):
    """One piece of a load to read: its chunk object's `name`, the extent `ext` whose header
    records the chunk, and the load's destination `dest` (the piece goes at its `dest_off`);
    `direct`: whether the store can copy into `dest` itself (`StoreClient.addressable`)."""

    name: str
    ext: Opened
    piece: Piece
    dest: memoryview
    direct: bool = True

    @property
    def length(self) -> int:
        """The chunk object's bytes, as its header records them."""
        return self.ext.chunks[self.piece.chunk].length

    @property
    def whole(self) -> bool:
        """Whether the chunk is read straight into `dest`: it lands there as stored, and the store
        can copy there."""
        stored = self.ext.header.compression is Compression.NONE and self.piece.need == self.piece.raw_len
        return stored and self.direct


def read_pieces(client: StoreClient, reads: Sequence[PieceRead], scratch: Scratch) -> list[Exception | None]:
    """The pieces of `reads` (of any loads) in one call, each reply checked and each chunk verified
    on its own before its decoded bytes are placed: per piece None (verified and in place) or what
    failed it (Gone, StoreFailed, FormatError; one piece's failure leaves the others as they are). A
    piece is read whole into its `dest` where it lands there as stored, else into its own part of
    the scratch buffer and decoded from there (the buffer's use ends once every piece is placed)."""
    with scratch.use(sum(r.length for r in reads if not r.whole)) as spare:
        targets, at = [], 0
        for r in reads:
            if r.whole:
                targets.append(r.dest[r.piece.dest_off : r.piece.dest_off + r.length])
            else:
                targets.append(spare[at : at + r.length])
                at += r.length
        replies = client.get_many_into([r.name for r in reads], targets)
        # a whole chunk's transfer writes its `dest` only (`written_late`), not the scratch buffer
        scratch.spoil_if_late([reply for r, reply in zip(reads, replies, strict=True) if not r.whole])
        return [
            _attempt(_place, r, target, reply)
            for r, target, reply in zip(reads, targets, replies, strict=True)
        ]


def written_late(r: PieceRead, error: Exception | None) -> bool:
    """Whether `read_pieces`' outcome `error` for `r` leaves `r.dest` open to a late write: its
    chunk was read straight there (whole) by a transfer the store gave up on (`late_writes`)."""
    return r.whole and isinstance(error, StoreFailed) and late_writes([error.reply])


def _place(r: PieceRead, target: memoryview, reply: Reply) -> None:
    p, chunk = r.piece, r.ext.chunks[r.piece.chunk]
    _check_length(reply, r.name, chunk.length)
    verify_chunk(target, chunk, p.chunk)
    if not r.whole:
        r.dest[p.dest_off : p.dest_off + p.need] = decode_chunk(target, r.ext.header.compression, p.raw_len)[
            : p.need
        ]


def _check_length(reply: Reply, name: str, length: int) -> None:
    if reply.code == INVALID_PARAMS:  # the object is larger than its recorded length
        raise FormatError(f"chunk object {name} is larger than its recorded {length} bytes")
    if _checked(reply, "chunk get").n != length:
        raise FormatError(f"chunk object {name} has {reply.n} bytes, its header says {length}")
