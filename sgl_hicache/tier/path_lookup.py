"""Lookups: find extents another writer spilled for a prompt this process has never seen.

Runs on the tier's I/O threads (`Tier.submit_lookup`), never on the caller's. Given a prompt's
tokens, its tenant and epoch (which seed path keys, keys.py) and how far the caller already holds it
(`start`), a lookup:

1. computes the prompt's path keys at block positions past `start` (multiples of `block` tokens)
   and binary-searches the farthest one that has an alias (file/aliases.py): about log2(blocks) readlinks
   (a source that reads many aliases in one call, a store, reads them all at once first: one call);
2. verifies that claim (extent K, offset o): the extent opens and verifies like a load (header and
   meta MACs, key = chain_key of its parent, count and digest, size), its parent is the prompt's own
   path key at s = position - o (so it starts at s), and its MAC'd aliases hold, at offset o, the
   prompt's own path key at that position (so its first o tokens are the prompt's tokens [s, s + o),
   after the same prefix). The verified end grows to the farthest recorded alias that also matches;
   for the default tenant the stored token ids must equal the prompt's too;
3. walks back: the alias named by the prompt's path key at s (the end alias of the extent before)
   gives the previous extent, verified the same way, until one starts at or before `start`
   (at most `max_steps` extents).

Any claim that fails a check is refused (counted; the whole lookup then finds nothing): the result
never names a token range that is not, by the writer's MAC'd record and the key scheme, exactly the
prompt's. A missing file (evicted or deleted by its writer) is a clean miss, and the dangling alias
that named it is removed (`aliases.remove_dangling`). When the farthest claim is such a miss, the
lookup goes on below the start of the extent it named (the alias there, the end of the extent
before; if there is none, a binary search of the blocks below it), at most STALE_RETRIES times, so
a stale farthest alias does not hide live extents before it. Cost per prompt: at most
(1 + STALE_RETRIES) x (log2(blocks) + 2) + max_steps readlinks and 4 calls (open, pread, fstat,
close) per extent verified, counted in `LookupResult.fs_calls`.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np

from sgl_hicache.tier.format import Alias, FormatError, NewerFormat
from sgl_hicache.tier.keys import ExtentKey, NamespaceId, PathHasher
from sgl_hicache.tier.results import LookupRequest, LookupResult, Segment

BLOCK_TOKENS = 64
"""Writers record a path key every `block_tokens(page_size)` tokens of the sequence (from its
start) and at each extent's end; readers probe the same positions. Part of the directory's format:
every writer of a namespace uses the same value (the page size is part of the namespace)."""


STALE_RETRIES = 2
"""How many times a lookup whose farthest claim names a missing extent looks again below it."""
READ_AHEAD_MAX = 1024
"""A source that reads many aliases in one call (a store) reads every block position's at once,
up to this many (a prompt of 64K tokens at the default spacing); the search then runs on them."""


def block_tokens(page_size: int) -> int:
    """The alias spacing for a page size: the least multiple of it that is >= BLOCK_TOKENS."""
    return page_size * -(-BLOCK_TOKENS // page_size)


_TARGET = re.compile(r"([0-9a-f]{32})\.([0-9]{1,10})")


def parse_claim(target: str) -> tuple[ExtentKey, int] | None:
    """An alias's target "<extent key hex>.<offset>" as (key, offset); None for anything else."""
    m = _TARGET.fullmatch(target)
    return None if m is None else (ExtentKey(bytes.fromhex(m[1])), int(m[2]))


class Claimed(NamedTuple):
    """An extent's verified header, as a lookup checks a claim against it."""

    parent: bytes
    token_count: int
    aliases: tuple[Alias, ...]
    tokens: bytes | None


class ExtentSource(Protocol):
    """Where a lookup reads aliases and headers: a tier directory (`FileSource`) or a store."""

    def alias(self, path_key: bytes) -> tuple[ExtentKey, int] | None:
        """The claim published under `path_key` (extent, offset), or None."""

    def aliases(self, path_keys: list[bytes]) -> list[tuple[ExtentKey, int] | None] | None:
        """The claims of many path keys read at once, where that is one call (a store's batch
        read); None where reading them one by one (`alias`) costs the same (a directory)."""

    def header(self, key: ExtentKey) -> Claimed:
        """`key`'s header verified like a load's (MACs, namespace, key re-derived from its fields);
        FileNotFoundError if it is gone, FormatError or OSError if it cannot be used."""

    def remove_dangling(self, path_key: bytes, key: ExtentKey) -> None:
        """`path_key`'s alias named `key`, which is gone: remove it if it still does."""


class _Walk:
    """One lookup's state: the prompt's path keys (computed once each) and the calls made."""

    def __init__(self, req: LookupRequest, source: ExtentSource, ns: NamespaceId, page: int) -> None:
        self.req, self.source, self.ns, self.page = req, source, ns, page
        self.calls = self.refused = self.stale = 0
        self.last_stale = False  # the last claim verified named a missing extent
        self._hashers: dict[int, PathHasher] = {}
        self._claims: dict[int, tuple[ExtentKey, int] | None] = {}  # read ahead (`read_ahead`)

    def key_at(self, pos: int) -> bytes:
        """The prompt's path key of its first `pos` tokens (hashed on from the nearest known one)."""
        if pos not in self._hashers:
            base = max((p for p in self._hashers if p <= pos), default=0)
            start = (
                self._hashers[base]
                if base in self._hashers
                else PathHasher(self.ns, self.req.tenant, self.req.epoch)
            )
            self._hashers[pos] = start.copy().update(self.req.tokens[base:pos])
        return self._hashers[pos].key()

    def alias(self, pos: int) -> tuple[ExtentKey, int] | None:
        if pos in self._claims:
            return self._claims[pos]
        self.calls += 1
        return self.source.alias(self.key_at(pos))

    def read_ahead(self, positions: list[int]) -> None:
        """Read the aliases at `positions` in one call, where the source can (`ExtentSource.aliases`)."""
        if not 1 < len(positions) <= READ_AHEAD_MAX:
            return
        claims = self.source.aliases([self.key_at(p) for p in positions])
        if claims is not None and len(claims) == len(positions):
            self.calls += 1
            self._claims.update(zip(positions, claims, strict=True))

    def verify(self, claim: tuple[ExtentKey, int], pos: int) -> Segment | None:
        key, offset = claim
        start = pos - offset
        self.last_stale = False
        if start < 0 or start % self.page or offset <= 0:
            self.refused += 1
            return None
        self.calls += 4
        try:
            ext = self.source.header(key)
        except FileNotFoundError:
            self.stale, self.last_stale, self.calls = self.stale + 1, True, self.calls + 3
            self.source.remove_dangling(self.key_at(pos), key)
            return None
        except NewerFormat:  # a newer server's extent: not for this version, not a forgery
            return None
        except (FormatError, OSError):
            self.refused += 1
            return None
        end = self._verified_end(ext.parent, ext.aliases, ext.tokens, start, pos, offset)
        if end is None:
            self.refused += 1
            return None
        return Segment(key, ext.token_count, start, end)

    def _verified_end(self, parent: bytes, aliases: tuple[Alias, ...], tokens: bytes | None, start: int, pos: int,
                      offset: int) -> int | None:  # fmt: skip
        prompt = self.req.tokens
        if parent != self.key_at(start) or (offset, self.key_at(pos)) not in aliases:
            return None
        # Also a check on its own: a recorded key equals the prompt's only where both name the same
        # path, so a claim with a wrong start matches none of them.
        end = max((start + a.offset for a in aliases if start + a.offset <= len(prompt)
                   and a.offset >= offset and self.key_at(start + a.offset) == a.path_key), default=start)  # fmt: skip
        if end <= start:
            return None
        if tokens is not None:
            stored = np.frombuffer(tokens, dtype="<u4")[: end - start]
            if not np.array_equal(stored, prompt[start:end]):
                return None
        return end


def run_lookup_in(req: LookupRequest, source: ExtentSource, ns: NamespaceId, page_size: int) -> LookupResult:
    """The lookup itself over `source` (blocking: run it on an I/O thread)."""
    t0 = time.perf_counter()
    walk = _Walk(req, source, ns, page_size)
    segments = _segments(walk, block_tokens(page_size))
    return LookupResult(req, segments, walk.calls, walk.refused, walk.stale, time.perf_counter() - t0)


def _segments(walk: _Walk, block: int) -> tuple[Segment, ...]:
    req = walk.req
    blocks = list(range((req.start // block + 1) * block, len(req.tokens) + 1, block))
    walk.read_ahead(blocks)
    found, retries = _farthest(walk, blocks), STALE_RETRIES
    out: list[Segment] = []
    for _ in range(req.max_steps):
        if found is None:
            return ()
        seg = walk.verify(found[1], found[0])
        if seg is None and walk.last_stale and not out and retries > 0:
            retries -= 1  # the farthest claim names a missing extent: look below where it started
            found = _below(walk, blocks, found[0] - found[1][1])
            continue
        if seg is None:
            return ()
        out.append(seg)
        if seg.start <= req.start:
            return tuple(reversed(out))
        claim = walk.alias(seg.start)
        found = None if claim is None else (seg.start, claim)
    return ()


def _farthest(walk: _Walk, blocks: list[int]) -> tuple[int, tuple[ExtentKey, int]] | None:
    """The farthest block position with an alias, by binary search (aliases are dense up to where
    spills end), and its claim."""
    lo, hi, found = 0, len(blocks) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        claim = walk.alias(blocks[mid])
        if claim is not None:
            found, lo = (blocks[mid], claim), mid + 1
        else:
            hi = mid - 1
    return found


def _below(walk: _Walk, blocks: list[int], start: int) -> tuple[int, tuple[ExtentKey, int]] | None:
    """A claim ending at or before `start` (where a missing extent started): the alias at `start`
    (the end of the extent before it), else the farthest block below it with one."""
    if start <= walk.req.start:
        return None
    claim = walk.alias(start)
    if claim is not None:
        return start, claim
    return _farthest(walk, [b for b in blocks if b < start])


@dataclass
class LookupQueue:
    """Finished lookups, waiting for the caller's poll."""

    _lock: threading.Lock = field(default_factory=threading.Lock)
    _done: list[LookupResult] = field(default_factory=list)

    def post(self, result: LookupResult) -> None:
        with self._lock:
            self._done.append(result)

    def drain(self) -> list[LookupResult]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def job(self, req: LookupRequest, run: Callable[[LookupRequest], LookupResult]) -> Callable[[], None]:
        """An I/O job that runs `run(req)` and posts its result (an empty one if it raised)."""

        def go() -> None:
            try:
                result = run(req)
            except Exception:  # a bug: never lose the result (the caller waits for it)
                logging.getLogger("sgl_hicache.tier").exception("spill tier lookup failed")
                result = LookupResult(req)
            self.post(result)

        return go


def alias_marks(
    hasher: PathHasher, start: int, tokens: np.ndarray, page_size: int
) -> list[tuple[int, bytes]]:
    """The aliases a writer records for an extent of `tokens` that starts at sequence position
    `start`, `hasher` being at that position: (offset, path key) at every `block_tokens` multiple
    inside the extent and at its end. `hasher` is not changed."""
    block, n = block_tokens(page_size), len(tokens)
    cuts = [p - start for p in range((start // block + 1) * block, start + n, block)] + [n]
    marks: list[tuple[int, bytes]] = []
    h, done = hasher.copy(), 0
    for cut in cuts:
        h.update(tokens[done:cut])
        marks.append((cut, h.key()))
        done = cut
    return marks
