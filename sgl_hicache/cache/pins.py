"""Pinned conversations (`POST /hicache/pin`): which prefixes eviction spills whatever their length,
and which extents the tier keeps until a deadline, within a share of the tier budget.

A pin names a token prefix of one tenant (`tenant_of(extra_key, cache_salt)`) and a deadline
(`time.monotonic()`). A tree node is *covered* when its tokens lie on that prefix (its path from the
root is a prefix of the pin's tokens, or the pin's tokens a prefix of its path): eviction spills it
rather than drop it, and the tier keeps the extent holding it until the deadline (`Tier.retain`).

Two bounds keep pins within `pin_share` of the tier budget (`SpillConfig`), both in bytes of
extent files (`file_bytes`: header, padding and KV, what the tier's budget counts) of every TP rank
together (the budget is the directory's, shared by the ranks):
- **admission** (`admit`, on the scheduler that takes hints): the new pin's tokens plus those of
  the pins in force must fit, else the hint is refused with the numbers;
- **retention** (`retain`): an extent is kept only while the extents kept so far plus it fit (an
  extent may hold more than the pinned tokens, when a node runs past the pin's end); one that does
  not fit is spilled all the same and left to the tier's LRU (counted: `pin_over_budget`).
Re-pinning the same prefix can only extend its deadline (a client that guessed another's prefix
must not end that pin), and is charged in full at admission: whether the budget admits a pin never
depends on what exactly others pinned. At most `MAX_PINS` pins are in force (eviction checks them
all). Not thread-safe: the scheduler thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from sgl_hicache_kernels import LayerGroups, packed_nbytes

from sgl_hicache.tier.format import file_bound
from sgl_hicache.tier.keys import ExtentKey, token_digest
from sgl_hicache.tier.path_lookup import block_tokens

MAX_TTL_S = 7 * 24 * 3600.0
MAX_PINS = 1024


@dataclass
class Pin:
    tenant: bytes
    salt: str | None  # the cache_salt within `tenant` (a purge ends its pins)
    tokens: np.ndarray  # int64
    until: float  # time.monotonic() deadline
    nbytes: int  # extent file bytes of its tokens, all TP ranks (`file_bytes`)


def file_bytes(
    tokens: int, packed: int, chunk_bytes: int, page_size: int, sections: Sequence[int] = ()
) -> int:
    """The bytes on one rank's tier of the extent file holding `tokens` tokens of `packed` KV bytes
    (in `sections`, one per layer group; default one), at most (uncompressed, with token ids and
    every alias a writer records: lookup.alias_marks)."""
    return file_bound(packed, tokens, chunk_bytes, tokens // block_tokens(page_size) + 2, sections or None)


def tier_bytes(layout: LayerGroups, chunk_bytes: int, page_size: int, ranks: int) -> Callable[[int], int]:
    """`Pins`' `bytes_of`: the `file_bytes` of n tokens of the KV laid out in `layout`'s layer groups
    on each of `ranks` TP ranks."""

    def bytes_of(n: int) -> int:
        sections = [hi - lo for lo, hi in (layout.section(g, n) for g in range(layout.count))]
        return file_bytes(n, packed_nbytes(layout.view, n), chunk_bytes, page_size, sections) * ranks

    return bytes_of


class Pins:
    def __init__(self, budget_bytes: int, bytes_of: Callable[[int], int]) -> None:
        """`budget_bytes`: what pins may hold; `bytes_of(n)`: the bytes n tokens take on the tier
        (`file_bytes`), all ranks."""
        self.budget_bytes = budget_bytes
        self._bytes_of = bytes_of
        self._pins: dict[tuple[bytes, bytes], Pin] = {}
        self._kept: dict[ExtentKey, tuple[float, int]] = {}  # retained extent -> (deadline, bytes)

    def __len__(self) -> int:
        self.expire()
        return len(self._pins)

    @property
    def pinned_bytes(self) -> int:
        self.expire()
        return sum(p.nbytes for p in self._pins.values())

    @property
    def kept_bytes(self) -> int:
        self.expire()
        return sum(nbytes for _, nbytes in self._kept.values())

    def admit(self, tenant: bytes, salt: str | None, tokens: Sequence[int], ttl_s: float) -> str | None:
        """Why a pin of `tokens` for `ttl_s` would exceed the budget (one line, without what others
        pinned), or None (then it is added, as `add` does)."""
        if not len(tokens):
            return "a pin must cover at least one whole page of tokens"
        if len(self) >= MAX_PINS:
            return f"{MAX_PINS} pins are in force on this server: no more until some end"
        need = self._bytes_of(len(tokens))
        if self.pinned_bytes + need > self.budget_bytes:
            return (  # how much others pinned is not said: hints never tell what is cached
                f"pinning {len(tokens)} tokens ({need} B of extent files) would exceed the pin budget of "
                f"{self.budget_bytes} B (pin_share of the tier budget) with the pins in force"
            )
        self.add(tenant, salt, tokens, ttl_s)
        return None

    def add(self, tenant: bytes, salt: str | None, tokens: Sequence[int], ttl_s: float) -> Pin:
        """Pin `tokens` of `tenant` for `ttl_s` seconds from now (replacing a pin of the same prefix)."""
        arr = np.asarray(tokens, dtype=np.int64)
        name = (tenant, token_digest(arr))
        old = self._pins.get(name)
        until = max(time.monotonic() + ttl_s, old.until if old is not None else 0.0)
        pin = Pin(tenant, salt, arr, until, self._bytes_of(len(arr)))
        self._pins[name] = pin
        return pin

    def expire(self) -> None:
        now = time.monotonic()
        for name in [k for k, p in self._pins.items() if p.until <= now]:
            del self._pins[name]
        for key in [k for k, (until, _) in self._kept.items() if until <= now]:
            del self._kept[key]

    def covering(self, tenant: bytes, before: Sequence[Sequence[int]], tokens: Sequence[int]) -> Pin | None:
        """The pin (latest deadline) covering a node of `tenant` whose own tokens are `tokens`, after
        the tokens of its ancestors `before` (top down); None if none does."""
        if not self._pins:
            return None
        self.expire()
        start = sum(len(part) for part in before)
        own = np.asarray(tokens, dtype=np.int64)
        best: Pin | None = None
        for pin in self._pins.values():
            if pin.tenant != tenant or start >= len(pin.tokens) or not len(own):
                continue
            m = min(len(own), len(pin.tokens) - start)
            if not np.array_equal(own[:m], pin.tokens[start : start + m]):
                continue
            if _path_equal(before, pin.tokens[:start]) and (best is None or pin.until > best.until):
                best = pin
        return best

    def retain(self, key: ExtentKey, tokens: int, until: float) -> bool:
        """Whether extent `key` (of `tokens` tokens) may be kept until `until` within the budget
        (recorded if so; an extent kept already just takes the later deadline)."""
        self.expire()
        held = self._kept.get(key)
        nbytes = self._bytes_of(tokens)
        if held is None and self.kept_bytes + nbytes > self.budget_bytes:
            return False
        self._kept[key] = (max(until, held[0] if held else until), nbytes)
        return True

    def deadline(self, key: ExtentKey) -> float:
        return self._kept[key][0]

    def forget(self, tenant: bytes | None = None, salt: str | None = None,
               tokens: Sequence[int] | None = None) -> None:  # fmt: skip
        """Remove the pins that a drop of `tokens` of `tenant` ends (those on its prefix or
        continuing it), or every pin of a `salt` (a purge; `tenant` then ignored)."""
        for name, pin in list(self._pins.items()):
            if salt is not None:
                gone = pin.salt == salt
            else:
                n = min(len(pin.tokens), len(tokens or ()))
                gone = pin.tenant == tenant and np.array_equal(pin.tokens[:n], np.asarray(tokens)[:n])
            if gone:
                del self._pins[name]

    def forget_extents(self, keys: Sequence[ExtentKey]) -> None:
        for key in keys:
            self._kept.pop(key, None)


def _path_equal(before: Sequence[Sequence[int]], expected: np.ndarray) -> bool:
    pos = 0
    for part in before:
        arr = np.asarray(part, dtype=np.int64)
        if not np.array_equal(arr, expected[pos : pos + len(arr)]):
            return False
        pos += len(arr)
    return pos == len(expected)
