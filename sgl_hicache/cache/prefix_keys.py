"""Extent keys for radix-tree nodes: a hash of the whole token path, not of node boundaries.

A node's extent is named by the hash of (namespace, tenant, tokens[:end]) and records as its parent
the hash of (namespace, tenant, tokens[:start]) (`PrefixHasher` computes both in one pass). Keys depend only on absolute positions, never on where the
tree happened to split its nodes, so an extent written before a split is still found after it, and
a child's recorded parent equals the key of whatever extent ends where the child starts.
The tenant (sglang's `extra_key` and `cache_salt`, e.g. LoRA id and per-user salt) is hashed first:
two tenants never produce the same key, so no restore can ever cross tenants.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from sgl_hicache.tier import ExtentKey, NamespaceId


def tenant_of(extra_key: str | None, cache_salt: str | None) -> bytes:
    """The tenant tag of a radix key (empty for the default tenant)."""
    if extra_key is None and cache_salt is None:
        return b""
    return f"{extra_key!r}\x00{cache_salt!r}".encode()


class PrefixHasher:
    """Feed a token path left to right; `key()` names the prefix fed so far."""

    def __init__(self, ns: NamespaceId, tenant: bytes) -> None:
        self._h = xxhash.xxh3_128()
        self._h.update(ns)
        self._h.update(len(tenant).to_bytes(4, "little") + tenant)

    def update(self, tokens: Sequence[int] | np.ndarray) -> PrefixHasher:
        self._h.update(np.asarray(tokens, dtype="<u4").tobytes())
        return self

    def key(self) -> ExtentKey:
        return ExtentKey(self._h.digest())

    def copy(self) -> PrefixHasher:
        clone = PrefixHasher.__new__(PrefixHasher)
        clone._h = self._h.copy()
        return clone
