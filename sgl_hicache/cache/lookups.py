"""Cross-server lookups, the I/O half: KV that another server sharing the tier directory spilled,
found for a prompt this server has never seen, without a restart.

Extent keys depend on where the writer split its tree; path keys do not (tier/keys.py). So every
spill records its path keys at block positions and at its end (`tier.path_lookup.alias_marks`), and a
request whose prompt runs past what the tree holds starts a lookup by its own path keys
(`Tier.submit_lookup`, on the tier's I/O threads; tier/path_lookup.py verifies every claim against the
MAC'd header and the request's own tokens). This object only submits lookups and hands their
results over; the cache attaches them (`SpillTree.attach_segments`) at one point of the scheduler
round, before matching, never while a restore or an eviction is under way.

Admission: a request whose lookup is still running is skipped for the round (`waiting`, through
the admission hook) for at most `limit_s`; admitted before its lookup finished, it simply does not
use it. Lookups, and so their waits, are off on a root no other server uses: until the tier has
seen another process there (`Tier.shared`; an I/O thread looks every `tier.shared.REFRESH_S`, so a
server that never stores sees a live peer within about that of either's start), unless the write
policy is write-through (which assumes a shared root); and with TP > 1 (their outcome depends on
each rank's own file system calls and is not agreed). The cache decides (`Matching._start_lookup`).
"""

from __future__ import annotations

import time
from typing import NamedTuple, cast

import numpy as np

from sgl_hicache.tier import Tier
from sgl_hicache.tier.keys import tokens_to_bytes
from sgl_hicache.tier.results import LookupRequest, LookupResult, Segment


class FoundSegments(NamedTuple):
    """A finished lookup: the caller's tag and the verified segments it found (maybe none)."""

    tag: object
    epoch: bytes
    segments: tuple[Segment, ...]


class Lookups:
    def __init__(self) -> None:
        self._pending: dict[object, float] = {}  # request id (or a token) -> when its lookup started

    def start(self, tier: Tier, token_ids: list[int], held: int, tenant: bytes, epoch: bytes,
              rid: str | None, tag: object, cache_salt: str | None = None) -> bool:  # fmt: skip
        """Submit a lookup of `token_ids` (page-aligned) past its first `held` tokens, of `tenant`
        (whose salt is `cache_salt`); never blocks. False when not started (one already runs for
        `rid`, nothing past `held`, ids no key names)."""
        key = rid if rid is not None else object()
        if key in self._pending or held >= len(token_ids):
            return False
        try:
            tokens = np.frombuffer(tokens_to_bytes(token_ids), dtype="<u4")
        except ValueError:  # ids no key can name
            return False
        self._pending[key] = time.monotonic()
        tier.submit_lookup(LookupRequest(tokens, held, tenant, epoch, tag=(key, tag), cache_salt=cache_salt))
        return True

    def waiting(self, rid: str | None, limit_s: float) -> bool:
        """Whether request `rid`'s lookup is still running, started less than `limit_s` ago."""
        started = self._pending.get(rid) if rid is not None else None
        return started is not None and time.monotonic() - started < limit_s

    def finished(self, tier: Tier) -> tuple[list[tuple[FoundSegments, LookupResult]], float]:
        """Every lookup finished since the last call, and the seconds they ran in all (scheduler
        thread; never blocks on I/O)."""
        out, seconds, now = [], 0.0, time.monotonic()
        for result in tier.lookups_finished():
            key, tag = cast(tuple[object, object], result.request.tag)
            started = self._pending.pop(key, None)
            seconds += now - started if started is not None else 0.0
            out.append((FoundSegments(tag, result.request.epoch, result.segments), result))
        return out, seconds

    def clear(self) -> None:
        self._pending.clear()
