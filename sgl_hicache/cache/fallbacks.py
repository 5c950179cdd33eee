"""What the cache does instead when our logic raised in a call from sglang (see guard.py): sglang's
plain `RadixCache` behaviour on our tree. None of them reads, restores or spills anything, so none
can serve KV that was not verified; each leaves tree and pool consistent from any point the failed
method reached (the tree's own operations are atomic per node). Each of the four guarding a call
from sglang has a last resort (guard.py), for when it raises itself: the `_nothing_*` answers."""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Any

from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    EvictResult,
    InitLoadBackParams,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.radix_cache import RadixCache

from sgl_hicache.cache.guard import internal_error, last_resort
from sgl_hicache.cache.partial_restore import PartialRestores
from sgl_hicache.cache.reads import Readiness

if TYPE_CHECKING:
    from sgl_hicache.cache.partial_restore import RestoreProgress
    from sgl_hicache.cache.spill_radix_cache import SpillRadixCache


def _nothing_matched(cache: SpillRadixCache, _params: MatchPrefixParams) -> MatchResult:
    return cache._no_match()


def _nothing_evicted(_cache: SpillRadixCache, _params: EvictParams) -> EvictResult:
    return EvictResult()


def _nothing_restored(cache: SpillRadixCache, params: InitLoadBackParams) -> tuple[int, Any]:
    anchor = getattr(params.req, "last_node", None)
    return 0, anchor if anchor is not None else cache.root_node


def _nothing_kept(cache: SpillRadixCache) -> None:
    """sglang's own reset (an empty tree; spill is off by then, so no key epoch matters)."""
    RadixCache.reset(cache)
    cache.spilled_tokens = 0


@last_resort(_nothing_matched)
def resident_match(cache: SpillRadixCache, params: MatchPrefixParams) -> MatchResult:
    """The device-resident prefix only (sglang's match stops at spilled nodes on our tree)."""
    return RadixCache.match_prefix(cache, params)


@last_resort(_nothing_evicted)
def evict_by_dropping(cache: SpillRadixCache, params: EvictParams) -> EvictResult:
    """sglang's eviction: LRU leaves dropped, none spilled (a dropped node takes its spilled subtree)."""
    if cache.disable:
        return EvictResult()
    heap = [(cache.eviction_strategy.get_priority(n), n) for n in cache.evictable_leaves]
    heapq.heapify(heap)
    evicted = 0
    while evicted < params.num_tokens and heap:
        _, node = heapq.heappop(heap)
        evicted += len(node.value)
        parent = node.parent
        cache._drop_node(node)
        cache.kv_events.record_remove(node)
        if parent in cache.evictable_leaves:
            heapq.heappush(heap, (cache.eviction_strategy.get_priority(parent), parent))
    return EvictResult(num_tokens_evicted=evicted)


@last_resort(_nothing_restored)
def no_restore(cache: SpillRadixCache, params: InitLoadBackParams) -> tuple[int, Any] | None:
    """Nothing restored: the request recomputes its spilled part; its partial restore is freed."""
    cache.deferred_rid = None
    req = params.req
    try:  # the failed method may have failed right here: that must not fail its fallback too
        cache.partial_restores.drop(getattr(req, "rid", None))
    except Exception:
        internal_error(cache, "init_load_back (freeing a partial restore)")
    anchor = req.last_node if req is not None else None
    return 0, anchor if anchor is not None else cache.root_node


@last_resort(_nothing_kept)
def empty_reset(cache: SpillRadixCache) -> None:
    """An empty tree in a new key epoch (nothing named before is ever found). Partial restores are
    forgotten, not freed: sglang clears the allocator right after a flush, and at start none exist."""
    RadixCache.reset(cache)
    cache.spilled_tokens = 0
    cache.tier_orphans = {}
    cache.partial_restores = PartialRestores(
        cache.token_to_kv_pool_allocator, cache.spill_config.prefetch_ttl_s
    )
    cache.start_epoch()


def not_ready(_cache: Any, *_args: Any) -> Readiness:
    """A restore whose readiness could not be judged recomputes (its verdict is still agreed)."""
    return Readiness.FAILED


def not_restored(_cache: Any, progress: RestoreProgress) -> bool:
    """A restore that failed midway: all or nothing, so nothing (the caller frees its slots)."""
    return False


def spilled_if_marked(_cache: Any, node: Any) -> bool:
    """One node's spill failed: dropped instead, unless it had already become spilled."""
    return node.value is None


def spilled_path_dropped(cache: SpillRadixCache, node: Any, key: Any) -> tuple[int, list[Any]]:
    """An insert could not adopt the spilled nodes on its path: the first of them goes, with its
    subtree, so sglang's insert then finds only resident nodes there (and keeps spilled nodes'
    descendants spilled). Walks with dict lookups only, none of our helpers."""
    while len(key) > 0:
        child = node.children.get(key.child_key(cache.page_size))
        if child is None:
            break
        if child.evicted:
            cache._prune_spilled(child)
            break
        n = child.key.match(key, page_size=cache.page_size)
        if n < len(child.key):  # the path leaves the tree inside a resident node
            break
        node, key = child, key[n:]
    return 0, []


def no_reads(_cache: Any, *_args: Any) -> int:
    """A prefetch whose reads could not start: none are on their way (the restore starts them)."""
    return 0


def attached_nothing(cache: SpillRadixCache) -> None:
    """A warm start that failed partway: an empty tree (the tier's extents stay on disk, unused).
    With TP > 1 the warm-start agreement still runs after it, so every rank then starts empty."""
    RadixCache.reset(cache)
    cache.spilled_tokens = 0
    cache.tier_orphans = {}
