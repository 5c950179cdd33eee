"""Cross-server reuse: attach KV that another server sharing the tier directory spilled, for a
prompt this server has never seen, without a restart.

Extent keys depend on where the writer split its tree; path keys do not (tier/keys.py). So every
spill records its path keys at block positions and at its end (`tier.lookup.alias_marks`), and a
request whose prompt runs past what the tree holds starts a lookup by its own path keys
(`Tier.submit_lookup`, on the tier's I/O threads; tier/lookup.py verifies every claim against the
MAC'd header and the request's own tokens). The scheduler thread only starts lookups and, when
`_poll` finds them finished, attaches the verified segments as spilled nodes referencing
(extent, offset, count), exactly like a warm start's, and starts their reads (prefetch). From then
on they are ordinary spilled nodes: a restore reads and verifies them like any other.

Admission: a request whose lookup is still running is skipped for the round (`waiting`, through
the admission hook) for at most the prefetch policy's limit (`prefetch_timeout_s`; `best_effort`:
not at all); admitted before its lookup finished, it simply does not use it. With TP > 1 lookups
are off: their outcome depends on each rank's own file system calls and is not agreed (see
docs/DESIGN.md, "Cross-server reuse").
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, cast

import numpy as np
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from sgl_hicache.cache.spill_state import Extent, ExtentState, SpillRef
from sgl_hicache.config import PrefetchPolicy
from sgl_hicache.tier.base import LookupRequest, LookupResult, Segment
from sgl_hicache.tier.keys import ExtentKey, tenant_of, tokens_to_bytes

if TYPE_CHECKING:
    from sgl_hicache.cache.spill_radix_cache import SpillRadixCache


class CrossServerLookups:
    def __init__(self) -> None:
        self._pending: dict[object, float] = {}  # request id (or a token) -> when its lookup started

    def start(self, cache: SpillRadixCache, key: RadixKey, held: int, rid: str | None) -> bool:
        """Start a lookup of `key` (page-aligned) past its first `held` tokens; never blocks."""
        if cache.spill_io is None or cache.agreement.size > 1 or cache.is_eagle or held >= len(key):
            return False
        tag = rid if rid is not None else object()
        if tag in self._pending:
            return False
        try:
            tokens = np.frombuffer(tokens_to_bytes(key.raw_token_ids()), dtype="<u4")
        except ValueError:  # ids no key can name
            return False
        tenant = tenant_of(key.extra_key, key.cache_salt)
        request = LookupRequest(tokens, held, tenant, cache.epoch or b"", tag=(tag, key))
        self._pending[tag] = time.monotonic()
        cache.spill_io.tier.submit_lookup(request)
        cache.spill_metrics.inc("lookups")
        return True

    def waiting(self, cache: SpillRadixCache, rid: str | None) -> bool:
        """Whether request `rid`'s admission should wait for its lookup (still running, within the
        limit). Never blocks, never polls (the next match polls)."""
        started = self._pending.get(rid) if rid is not None else None
        if started is None or cache.spill_config.prefetch_policy is PrefetchPolicy.BEST_EFFORT:
            return False
        waiting = time.monotonic() - started < cache.spill_config.prefetch_timeout_s
        cache.spill_metrics.inc("lookups_waited", int(waiting))
        return waiting

    def finish(self, cache: SpillRadixCache) -> None:
        """Attach the segments of every finished lookup (scheduler thread; never blocks on I/O)."""
        if cache.spill_io is None:
            return
        for result in cache.spill_io.tier.lookups_finished():
            tag, key = cast(tuple[object, RadixKey], result.request.tag)
            self._pending.pop(tag, None)
            _count(cache, result)
            if result.segments and result.request.epoch == (cache.epoch or b""):
                attach(cache, key, result.segments)

    def clear(self) -> None:
        self._pending.clear()


def _count(cache: SpillRadixCache, result: LookupResult) -> None:
    m = cache.spill_metrics
    m.inc("lookup_fs_calls", result.fs_calls)
    m.inc("lookup_refused", result.refused)
    m.inc("lookup_stale", result.stale)
    m.inc("lookup_found_tokens", result.end - result.request.start)


def attach(cache: SpillRadixCache, key: RadixKey, segments: tuple[Segment, ...]) -> int:
    """Attach `segments` (verified, contiguous) as spilled nodes where `key`'s match ends now, and
    start their reads; returns the tokens attached. Nothing if the tree already holds as much."""
    _, device_len, node, host_len = cache._walk(key)
    pos, page = device_len + host_len, cache.page_size
    tokens, added = key.raw_token_ids(), []
    extents: dict[ExtentKey, Extent] = {}
    for i, seg in enumerate(segments):
        upto = segments[i + 1].start if i + 1 < len(segments) else seg.end
        start = max(pos, seg.start)
        if seg.start > pos or (start - seg.start) % page or (upto - start) % page:
            break
        if upto <= start:
            continue
        if key[start:].child_key(page) in node.children:
            break
        extent = extents.setdefault(seg.key, Extent(seg.key, seg.extent_tokens, ExtentState.ON_TIER))
        node = _new_spilled(node, RadixKey(tokens[start:upto], key.extra_key, cache_salt=key.cache_salt),
                            SpillRef(extent, start - seg.start, upto - start), page)  # fmt: skip
        added.append(node)
        pos = upto
    attached = sum(n.spill.count for n in added)
    cache.spilled_tokens += attached
    cache.spill_metrics.inc("lookup_attached_tokens", attached)
    if added and cache.spill_io is not None:
        cache.spill_io.reads.prefetch([n.spill for n in added])
    return attached


def _new_spilled(parent: TreeNode, key: RadixKey, ref: SpillRef, page_size: int) -> TreeNode:
    node = TreeNode()
    node.parent, node.key, node.value, node.spill = parent, key, None, ref
    parent.children[key.child_key(page_size)] = node
    return node
