"""Keys and namespaces: the project's one key scheme (docs/FORMAT.md, "Keys").

Two kinds of 16-byte hashes, both inside one namespace:
- a **path key** `PathHasher(...).key()` names a token path from the start of a sequence, for one
  tenant (sglang's `extra_key` / `cache_salt`) and one cache epoch: it depends only on the tokens,
  never on where a radix tree split them;
- an **extent key** `chain_key(ns, parent, tokens)` = xxh3-128(ns id ‖ parent ‖ u32 count ‖
  `token_digest(tokens)`) names the run `tokens` that follows the path whose path key is `parent`:
  it fixes where the run starts (the whole path before it), its length and its tokens. Two
  different ranges never share a key (up to 128-bit hash collisions), so a key can only ever find
  the KV of exactly the range it was made for.

Every extent file records its parent, token count and token digest (the token ids themselves only
for the default tenant); the tier re-derives the key from them (`chain_key_from_digest`) on every
load and refuses a file whose key does not match (`Status.MISMATCH`). A namespace id is derived from
everything that makes KV bytes incompatible: model identity (weights fingerprint included), KV
layout and dtype, tensor-parallel rank/size, page size.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

import msgpack
import numpy as np
import xxhash

ExtentKey = NewType("ExtentKey", bytes)
"""16 bytes; `chain_key` is the only way to make one (`ExtentKey.fromhex` for stored keys)."""

NamespaceId = NewType("NamespaceId", bytes)
"""16 bytes, the fingerprint of a `Namespace`."""

KEY_BYTES = 16
ROOT_KEY = ExtentKey(bytes(KEY_BYTES))
"""An all-zero parent key, for tools and tests that store extents without a path (the cache always
uses path keys: `PathHasher`)."""


class KVDtype(enum.IntEnum):
    """Element type of the KV payload (stored as a one-byte code in the extent header)."""

    FP32 = 1
    FP16 = 2
    BF16 = 3
    FP8_E4M3 = 4
    FP8_E5M2 = 5
    INT8 = 6

    @property
    def itemsize(self) -> int:
        return 4 if self is KVDtype.FP32 else 2 if self in (KVDtype.FP16, KVDtype.BF16) else 1


@dataclass(frozen=True)
class KVLayout:
    """Shape of the KV bytes of one token run, as the kernels write it (page-major)."""

    num_layers: int
    num_heads: int
    head_dim: int
    dtype: KVDtype
    page_size: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "head_dim", "page_size"):
            if not 0 < getattr(self, name) < 2**32:
                raise ValueError(f"{name} must be in 1..2**32-1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Namespace:
    """Everything that makes two KV caches incompatible; its `id` isolates their extents."""

    model: str
    layout: KVLayout
    tp_rank: int = 0
    tp_size: int = 1
    tenant_salt: str = ""

    @property
    def id(self) -> NamespaceId:
        lay = self.layout
        fields = [self.model, lay.num_layers, lay.num_heads, lay.head_dim, int(lay.dtype), lay.page_size]
        fields += [self.tp_rank, self.tp_size, self.tenant_salt]
        return NamespaceId(xxhash.xxh3_128_digest(msgpack.packb(["sgl_hicache.ns.v2", *fields])))


def tokens_to_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32, the form hashed and stored in extent headers."""
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
        raise ValueError("token ids must be in 0..2**32-1")
    return arr.astype("<u4").tobytes()


def token_digest(tokens: Sequence[int] | np.ndarray) -> bytes:
    """xxh3-128 of the token ids as <u4 (16 bytes): what names them in a key and an extent header."""
    return xxhash.xxh3_128_digest(tokens_to_bytes(tokens))


def chain_key(ns: NamespaceId, parent: ExtentKey, tokens: Sequence[int] | np.ndarray) -> ExtentKey:
    """Key of the extent holding `tokens` after the prefix named by `parent` (ROOT_KEY at start)."""
    data = tokens_to_bytes(tokens)
    return chain_key_from_digest(ns, parent, len(data) // 4, xxhash.xxh3_128_digest(data))


def chain_key_from_digest(ns: NamespaceId, parent: ExtentKey, count: int, digest: bytes) -> ExtentKey:
    """`chain_key` from the token count and `token_digest` alone (what an extent header holds)."""
    if len(ns) != KEY_BYTES or len(parent) != KEY_BYTES or len(digest) != KEY_BYTES:
        raise ValueError("namespace id, parent key and token digest must be 16 bytes")
    if not 0 <= count < 2**32:
        raise ValueError(f"token count must be in 0..2**32-1, got {count}")
    return ExtentKey(xxhash.xxh3_128_digest(ns + parent + count.to_bytes(4, "little") + digest))


def check_key(key: bytes) -> ExtentKey:
    """`key` as an ExtentKey; raises ValueError unless it is 16 bytes."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"an extent key is {KEY_BYTES} bytes, got {key!r:.40}")
    return ExtentKey(key)


class PathHasher:
    """Feed a token path left to right; `key()` is the path key of the prefix fed so far.

    Seeded with the namespace, the tenant tag (`tenant_of`) and the cache epoch (empty at start; a
    new random one after every flush, so nothing named before a flush is found after it)."""

    def __init__(self, ns: NamespaceId, tenant: bytes = b"", epoch: bytes = b"") -> None:
        self._h = xxhash.xxh3_128()
        self._h.update(b"sgl_hicache.path.v2" + ns)
        for part in (tenant, epoch):
            self._h.update(len(part).to_bytes(4, "little") + part)

    def update(self, tokens: Sequence[int] | np.ndarray) -> PathHasher:
        self._h.update(tokens_to_bytes(tokens))
        return self

    def key(self) -> ExtentKey:
        return ExtentKey(self._h.digest())

    def copy(self) -> PathHasher:
        clone = PathHasher.__new__(PathHasher)
        clone._h = self._h.copy()
        return clone


def tenant_of(extra_key: str | None, cache_salt: str | None) -> bytes:
    """The tenant tag of a radix key (empty for the default tenant)."""
    if extra_key is None and cache_salt is None:
        return b""
    return f"{extra_key!r}\x00{cache_salt!r}".encode()
