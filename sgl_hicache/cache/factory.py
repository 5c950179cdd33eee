"""The radix-cache factory sglang calls (via the registry) in each scheduler process."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from sgl_hicache.config import ConfigError, SpillConfig

if TYPE_CHECKING:
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

    from sgl_hicache.cache.spill_io import SpillIO
    from sgl_hicache.kernels import KVPoolView
    from sgl_hicache.server.hints import HintInbox
    from sgl_hicache.server.metrics import SpillMetrics
    from sgl_hicache.tier import Namespace, Tier

logger = logging.getLogger(__name__)

_KV_DTYPES = {
    torch.float32: "FP32", torch.float16: "FP16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "FP8_E4M3", torch.float8_e5m2: "FP8_E5M2", torch.int8: "INT8",
}  # fmt: skip


def build_spill_cache(ctx: TreeCacheBuildContext) -> BasePrefixCache:
    from sgl_hicache.cache.spill_radix_cache import SpillRadixCache
    from sgl_hicache.kernels import from_sglang_pool
    from sgl_hicache.server.handoff import import_config
    from sgl_hicache.server.metrics import SpillMetrics

    if ctx.enable_hierarchical_cache:
        raise ConfigError(
            "--radix-cache-backend hicache_spill replaces --enable-hierarchical-cache; pass one of them"
        )
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.params.is_eagle:
        raise ConfigError("the hicache_spill backend supports dense full-attention models without EAGLE only")
    config = import_config()
    metrics = SpillMetrics.create(config, ctx.tp_rank)
    view = from_sglang_pool(ctx.params.token_to_kv_pool_allocator.get_kvcache())
    namespace = namespace_for(ctx, view)
    io = open_spill_io(config, namespace, view, metrics) if config.enabled else None
    hints = open_hint_inbox(ctx) if io is not None else None
    return SpillRadixCache(ctx.params, config, metrics, io, namespace.id, hints)


def open_hint_inbox(ctx: TreeCacheBuildContext) -> HintInbox | None:
    """The resume-hint socket, on a single-rank scheduler only; None (hints off, logged) otherwise."""
    import zmq

    from sgl_hicache.server.hints import HintInbox

    if ctx.tp_size != 1:
        logger.warning("sgl_hicache: client resume hints are off with tensor parallelism > 1")
        return None
    try:
        return HintInbox(ctx.server_args.port)
    except zmq.ZMQError as e:
        logger.error("sgl_hicache: cannot open the resume-hint socket (%s); /hicache/prefetch is off", e)
        return None


def namespace_for(ctx: TreeCacheBuildContext, view: KVPoolView) -> Namespace:
    from sgl_hicache.tier import KVDtype, KVLayout, Namespace

    args = ctx.server_args
    layout = KVLayout(num_layers=len(view.layers), num_heads=view.heads, head_dim=view.head_dim,
                      dtype=KVDtype[_KV_DTYPES[view.dtype]], page_size=view.page_size)  # fmt: skip
    # The tier's KVLayout has no MHA/MLA kind nor a separate V head size: both go into the identity.
    model = f"{args.model_path}@{args.revision or ''}|{view.kind.value}|v{view.v_head_dim or view.head_dim}"
    return Namespace(model=model, layout=layout, tp_rank=ctx.tp_rank, tp_size=ctx.tp_size)


TEST_FAULTS_ENV = "SGL_HICACHE_TEST_FAULTS"


def with_test_faults(tier: Tier) -> Tier:
    """Fault injection for tests only: `SGL_HICACHE_TEST_FAULTS='{"latency_s": 1.5}'` (FaultSpec fields)
    wraps the tier in a FaultyTier, and says so loudly. Unset in production."""
    import json
    import os

    from sgl_hicache.tier.faulty import FaultSpec, FaultyTier

    raw = os.environ.get(TEST_FAULTS_ENV)
    if not raw:
        return tier
    spec = FaultSpec(**json.loads(raw))
    logger.warning(
        "sgl_hicache: FAULT INJECTION ACTIVE (%s=%s): the tier is a FaultyTier", TEST_FAULTS_ENV, raw
    )
    return FaultyTier(tier, spec)


def open_spill_io(
    config: SpillConfig, namespace: Namespace, view: KVPoolView, metrics: SpillMetrics
) -> SpillIO | None:
    """The tier and staging; None (spill off, evictions drop as in sglang) if the tier cannot open."""
    from sgl_hicache.cache.spill_io import SpillIO
    from sgl_hicache.cache.staging import StagingPool
    from sgl_hicache.tier import open_tier

    try:
        tier = open_tier(config.tier, namespace)
    except OSError as e:
        logger.error(
            "sgl_hicache: cannot open the spill tier in %s (%s); serving without spill",
            config.tier.directory,
            e,
        )
        return None
    tier = with_test_faults(tier)
    timeout = max(config.prefetch_timeout_s, 10.0)
    return SpillIO(tier, view, StagingPool(config.staging_bytes), metrics, timeout, config.prefetch_ttl_s)
