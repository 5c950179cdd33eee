"""Keys and namespaces: every extent is content-addressed inside exactly one namespace.

An extent's key is a chained hash: `chain_key(ns, parent, tokens) = xxh3-128(ns id ‖ parent key ‖
tokens)`, so a key names a whole prefix (its parent's tokens included), and two namespaces never
produce the same key. A namespace id is derived from everything that makes KV bytes incompatible:
model identity, KV layout and dtype, tensor-parallel rank/size, page size, and a tenant salt (so
tenants cannot probe each other's prefixes by hash).
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
"""The parent of an extent that starts at the beginning of a sequence."""


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
        return NamespaceId(xxhash.xxh3_128_digest(msgpack.packb(["sgl_hicache.ns.v1", *fields])))


def tokens_to_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32, the form hashed and stored in extent headers."""
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
        raise ValueError("token ids must be in 0..2**32-1")
    return arr.astype("<u4").tobytes()


def chain_key(ns: NamespaceId, parent: ExtentKey, tokens: Sequence[int] | np.ndarray) -> ExtentKey:
    """Key of the extent holding `tokens` after the prefix named by `parent` (ROOT_KEY at start)."""
    if len(ns) != KEY_BYTES or len(parent) != KEY_BYTES:
        raise ValueError("namespace id and parent key must be 16 bytes")
    h = xxhash.xxh3_128()
    h.update(ns)
    h.update(parent)
    h.update(tokens_to_bytes(tokens))
    return ExtentKey(h.digest())


def check_key(key: bytes) -> ExtentKey:
    """`key` as an ExtentKey; raises ValueError unless it is 16 bytes."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"an extent key is {KEY_BYTES} bytes, got {key!r:.40}")
    return ExtentKey(key)
