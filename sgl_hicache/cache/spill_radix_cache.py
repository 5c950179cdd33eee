"""`SpillRadixCache`: sglang's pure-Python `RadixCache` with the spill seam.

Why `RadixCache` and not the default `UnifiedRadixCache`: in sglang 0.5.23 the unified cache keeps
its tree in a Rust core (nodes are opaque ids), so no Python subclass can mark a node *spilled* or
walk a cold subtree; `RadixCache` is the pure-Python tree that sglang's own FlexKV backend extends
the same way. See docs/DESIGN.md for the alternatives weighed.

Everything sglang's cache does (matching, locking, scheduling, metrics) is inherited unchanged; this
class intercepts only the points the spill tier plugs into:

- `evict` — every device eviction passes here (the allocator's `evict_for_alloc` forwards to it);
  victims' KV is where spill-on-eviction hooks in. Until spill lands, evicted tokens are counted
  as dropped.
- `match_prefix` — a request's prefix match; where a spilled continuation will be reported (as a
  host hit) and its restore started.
- `init_load_back` (inherited no-op today) — called by the scheduler's admission for a request with
  a host hit; where restored KV will be unpacked into freshly allocated slots before prefill.
"""

from __future__ import annotations

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult, MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache

from sgl_hicache.config import SpillConfig
from sgl_hicache.server.metrics import SpillMetrics


class SpillRadixCache(RadixCache):
    def __init__(self, params: CacheInitParams, config: SpillConfig, metrics: SpillMetrics) -> None:
        self.spill_config = config
        self.spill_metrics = metrics
        super().__init__(params)

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        result = super().match_prefix(params)
        self.spill_metrics.match_requests.inc()
        return result

    def evict(self, params: EvictParams) -> EvictResult:
        result = super().evict(params)
        if result.num_tokens_evicted:
            self.spill_metrics.evicted_tokens.inc(result.num_tokens_evicted)
            self.spill_metrics.dropped_tokens.inc(result.num_tokens_evicted)
        return result
