"""The radix-cache factory sglang calls (via the registry) in each scheduler process."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl_hicache.config import ConfigError

if TYPE_CHECKING:
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext


def build_spill_cache(ctx: TreeCacheBuildContext) -> BasePrefixCache:
    from sgl_hicache.cache.spill_radix_cache import SpillRadixCache
    from sgl_hicache.server.handoff import import_config
    from sgl_hicache.server.metrics import SpillMetrics

    if ctx.enable_hierarchical_cache:
        raise ConfigError(
            "--radix-cache-backend hicache_spill replaces --enable-hierarchical-cache; pass one of them"
        )
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm:
        raise ConfigError(
            "the hicache_spill backend supports dense full-attention models only (no SWA/SSM hybrids)"
        )
    config = import_config()
    return SpillRadixCache(ctx.params, config, SpillMetrics.create(config, ctx.tp_rank))
