"""One extent as Mooncake objects: written chunks first and header last, read and verified like a file.

The bytes are an extent file's (docs/FORMAT.md), cut at its seams: the header object is the file's
first `header_len` bytes (fixed header, MAC'd meta, padding), chunk object i is the file's chunk i as
stored. So a load checks exactly what a file load checks, with the same code (format.py, codec.py):
header MAC and meta MAC (sealed with the tier directory's secret), namespace, key re-derived from
the header's parent, token count and digest, exact lengths (the header object is `header_len`
bytes, each chunk object its recorded length) and every chunk's xxh3-64 before its bytes count.

Publishing is the header's write, after every chunk's: a reader that finds the header and not a
chunk (evicted since by the master, removed by another client) reports a clean miss. A store finds
its key present only if a header that verifies and all its chunks are there; else it writes them
all again (each write replaces its object: client.py).

Zero copy: an uncompressed chunk goes to the store straight from the caller's payload (`upsert_from`)
and a whole chunk comes back straight into the caller's destination (`get_into`), verified in
place; only a compressed chunk, or the part of a chunk a prefix load needs, passes through a
per-thread scratch buffer (registered with the store, as RDMA needs).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import xxhash

from sgl_hicache.config import Compression, TierConfig
from sgl_hicache.tier.codec import (
    Prepared,
    StoreRequest,
    check_identity,
    decode_chunk,
    finish_plan,
    plan_load,
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
    align_up,
    decode_aliases,
    decode_fixed,
    decode_meta,
)
from sgl_hicache.tier.keys import ExtentKey, Namespace, NamespaceId
from sgl_hicache.tier.mooncake.client import Names, Reply, StoreClient


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


class Scratch:
    """Per-thread byte buffers, each registered with the store once (`register`) when made."""

    def __init__(self, register: Callable[[memoryview], object]) -> None:
        self._local = threading.local()
        self._register = register

    def get(self, nbytes: int) -> memoryview:
        from sgl_hicache.tier.directio import alloc_aligned

        buf: memoryview | None = getattr(self._local, "buf", None)
        if buf is None or buf.nbytes < nbytes:
            buf = self._local.buf = alloc_aligned(align_up(max(nbytes, 1)))
            self._register(buf)
        return buf[:nbytes]


def write_objects(client: StoreClient, names: Names, prep: Prepared, cfg: TierConfig, ns: Namespace,
                  seal: DirectoryMac) -> int:  # fmt: skip
    """Put every chunk, then the sealed header (the publish); the bytes put. Raises StoreFailed."""
    req, chunks = prep.req, []
    for i, data in enumerate(prep.stored):
        view = memoryview(data).cast("B")
        chunks.append(Chunk(prep.offsets[i], view.nbytes, xxhash.xxh3_64_intdigest(view)))
        _checked(client.write_from(names.chunk(req.key, i), view), "chunk write")
    sealed = sealed_header(prep, cfg, ns, chunks, seal)
    _checked(client.write(names.header(req.key), sealed), "header write")
    return sum(c.length for c in chunks) + len(sealed)


def publish_aliases(client: StoreClient, names: Names, req: StoreRequest) -> None:
    """Best effort, like alias links: a failed one only makes the extent unfindable there."""
    for a in req.aliases:
        client.write(names.alias(a.path_key), f"{req.key.hex()}.{a.offset}".encode())


def remove_extent(client: StoreClient, names: Names, ns: NamespaceId, key: ExtentKey, seal: DirectoryMac,
                  scratch: Scratch) -> bool:  # fmt: skip
    """Remove `key`'s header (a reader then misses), then the chunks it names; whether the header
    was there."""
    try:
        n_chunks = len(open_header(client, names, ns, key, seal, scratch).chunks)
    except (Gone, FormatError, StoreFailed):
        n_chunks = 0
    removed = client.remove(names.header(key)).ok
    for i in range(n_chunks):
        client.remove(names.chunk(key, i))
    return removed


def present(client: StoreClient, names: Names, ns: NamespaceId, key: ExtentKey, seal: DirectoryMac,
            scratch: Scratch) -> bool:  # fmt: skip
    """Whether a header of `key` that verifies (ours) and every chunk it names are in the store, or a
    header of a newer format version (a newer server's, which this version never overwrites).
    Raises StoreFailed."""
    try:
        ext = open_header(client, names, ns, key, seal, scratch)
    except NewerFormat:  # a newer server's extent of this key: never overwritten by this version
        return True
    except (Gone, FormatError):
        return False
    found = client.exist([names.chunk(key, i) for i in range(len(ext.chunks))])
    return all(x == 1 for x in found)


class Opened:
    """An extent's header read from the store and verified (not its chunks yet); `raw`: the header
    object's bytes as read, to tell later whether the key was re-published since (`header_is`)."""

    def __init__(self, header: Header, tokens: bytes | None, chunks: list[Chunk], aliases: tuple[Alias, ...],
                 raw: bytes) -> None:  # fmt: skip
        self.header, self.tokens, self.chunks, self.aliases, self.raw = header, tokens, chunks, aliases, raw


def open_header(client: StoreClient, names: Names, ns: NamespaceId, key: ExtentKey, seal: DirectoryMac,
                scratch: Scratch) -> Opened:  # fmt: skip
    """Read and verify `key`'s header object. Raises Gone, StoreFailed, FormatError (Mismatch)."""
    name = names.header(key)
    size = _checked(client.size(name), "header size").n
    buf = scratch.get(size)
    got = _checked(client.get_into(name, buf), "header get").n
    if got != size:
        raise Gone(f"mooncake header get: {got} of {size} bytes (replaced meanwhile)")
    header = decode_fixed(buf, seal)
    tokens, chunks = decode_meta(header, buf, seal)
    aliases = decode_aliases(header, buf, seal)
    check_identity(header, ns, key)
    if size != header.header_len:
        raise FormatError(f"header object of {size} bytes, its header says {header.header_len}")
    return Opened(header, tokens, chunks, aliases, bytes(buf))


def header_is(client: StoreClient, names: Names, key: ExtentKey, seen: bytes) -> bool:
    """Whether `key`'s header object is still exactly `seen`: False if it was replaced (another
    client re-published the key), removed, or the store did not answer (nothing is proven then)."""
    return client.get(names.header(key)) == seen


def read_chunks(client: StoreClient, names: Names, ext: Opened, dest: memoryview, want: int, scratch: Scratch,
                landed: Callable[[int], None], group_layers: int | None = None) -> None:  # fmt: skip
    """Read and verify the chunks covering the first `want` payload bytes into `dest`, in order
    (layer group by layer group: codec.py's plan, delivered in groups of `group_layers` layers, None:
    the extent's own), reporting each verified prefix of `dest` to `landed` (at the end only, for a
    load that rearranges its bytes). Raises Gone, StoreFailed, FormatError; ValueError for a
    grouping that cannot be delivered."""
    h = ext.header
    plan = plan_load(h, want, group_layers)
    for piece in plan.pieces:
        end = _read_chunk(client, names.chunk(h.key, piece.chunk), ext, piece, dest, scratch)
        if plan.convert is None:
            landed(end)
    finish_plan(h, plan, dest, want)
    landed(want)


def _read_chunk(client: StoreClient, name: str, ext: Opened, piece: Piece, dest: memoryview,
                scratch: Scratch) -> int:  # fmt: skip
    """`piece` of its chunk into `dest`; returns the end of the bytes landed so far."""
    h, chunk = ext.header, ext.chunks[piece.chunk]
    whole = h.compression is Compression.NONE and piece.need == piece.raw_len
    at = piece.dest_off
    target = dest[at : at + chunk.length] if whole else scratch.get(chunk.length)
    got = _get_exact(client, name, target, chunk.length)
    verify_chunk(got, chunk, piece.chunk)
    if not whole:
        dest[at : at + piece.need] = decode_chunk(got, h.compression, piece.raw_len)[: piece.need]
    return at + piece.need


def _get_exact(client: StoreClient, name: str, target: memoryview, length: int) -> memoryview:
    reply = client.get_into(name, target)
    if reply.code == -600:  # INVALID_PARAMS: the object is larger than its recorded length
        raise FormatError(f"chunk object {name} is larger than its recorded {length} bytes")
    if _checked(reply, "chunk get").n != length:
        raise FormatError(f"chunk object {name} has {reply.n} bytes, its header says {length}")
    return target
