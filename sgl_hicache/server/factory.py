"""The radix-cache factory sglang calls (via the registry) in each scheduler process."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from sgl_hicache.cache.identity import namespace_for
from sgl_hicache.config import ConfigError, SpillBackend, SpillConfig

if TYPE_CHECKING:
    from sgl_hicache_kernels import KVPoolView
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

    from sgl_hicache.cache.controller import SpillController
    from sgl_hicache.cache.device import Streams
    from sgl_hicache.cache.metrics import SpillMetrics
    from sgl_hicache.server.hints import HintInbox
    from sgl_hicache.tier import IndexedTier, Namespace

logger = logging.getLogger(__name__)


def build_spill_cache(ctx: TreeCacheBuildContext) -> BasePrefixCache:
    from sgl_hicache_kernels import from_sglang_pool

    from sgl_hicache.cache.agreement import for_group
    from sgl_hicache.cache.build import SpillCacheBuild
    from sgl_hicache.cache.metrics import SpillMetrics, sglang_labels
    from sgl_hicache.cache.spill_radix_cache import SpillRadixCache
    from sgl_hicache.server.handoff import import_config
    from sgl_hicache.server.sglang_args import refuse_unserved
    from sgl_hicache.server.sglang_seam import check_seam

    check_seam()  # never build on a broken seam (SeamError ends the scheduler, and the server)
    if ctx.enable_hierarchical_cache:
        raise ConfigError(
            "--radix-cache-backend hicache_spill replaces --enable-hierarchical-cache; pass one of them"
        )
    refuse_unserved(ctx.disable_radix_cache, ctx.server_args.disaggregation_mode)
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.params.is_eagle:
        raise ConfigError("the hicache_spill backend supports dense full-attention models without EAGLE only")
    if getattr(ctx.model_config, "is_multimodal", False):  # image placeholders are 62-bit ids in the key
        raise ConfigError("the hicache_spill backend does not support multimodal models yet")
    config = import_config()
    metrics = SpillMetrics.create(config, sglang_labels(ctx.server_args, ctx.tp_rank))
    view = from_sglang_pool(ctx.params.token_to_kv_pool_allocator.get_kvcache())
    namespace = namespace_for(ctx, view)
    allocator = ctx.params.token_to_kv_pool_allocator
    controller = (
        open_controller(config, namespace, view, metrics, allocator, ctx.tp_rank) if config.enabled else None
    )
    agreement = for_group(ctx.params.tp_cache_group, ctx.tp_size)  # ranks agree on local outcomes
    if config.enabled and not agreement.all_ok(controller is not None) and controller is not None:
        logger.error("sgl_hicache: another TP rank could not open its tier; serving without spill")
        controller.tier.close()
        controller = None
    hints = open_hint_inbox(ctx) if controller is not None else None
    build = SpillCacheBuild(params=ctx.params, config=config, metrics=metrics, controller=controller,
                            namespace_id=namespace.id, hints=hints, agreement=agreement)  # fmt: skip
    return SpillRadixCache(build)


def open_hint_inbox(ctx: TreeCacheBuildContext) -> HintInbox | None:
    """The resume-hint socket in the launcher's private runtime directory, bound by the scheduler of
    TP rank 0 only (the rank that receives requests; the hints reach the other ranks inside sglang's
    request broadcast, `server/hooks.py`); None on other ranks and, logged, without that directory.
    Raises HintSocketError if the directory is not private or the bind fails: the server does not
    start."""
    import os

    from sgl_hicache.server.hints import RUNTIME_DIR_ENV, HintInbox, HintLimits

    if ctx.tp_rank != 0:
        return None
    runtime_dir = os.environ.get(RUNTIME_DIR_ENV)
    if not runtime_dir:
        logger.warning("sgl_hicache: client resume hints are off (no %s: start the server with "
                       "python -m sgl_hicache.launch_server)", RUNTIME_DIR_ENV)  # fmt: skip
        return None
    limits = HintLimits(int(ctx.model_config.vocab_size), int(ctx.model_config.context_len))
    return HintInbox(runtime_dir, limits)


TEST_FAULTS_ENV = "SGL_HICACHE_TEST_FAULTS"
STAGING_FAILED_CLOSE_S = 10.0  # the tier opened for a server that then had no staging: closed within this


TEST_FAULTS_RANKS_ENV = "SGL_HICACHE_TEST_FAULTS_RANKS"


def with_test_faults(tier: IndexedTier, tp_rank: int = 0) -> IndexedTier:
    """Fault injection for tests only: `SGL_HICACHE_TEST_FAULTS='{"latency_s": 1.5}'` (FaultSpec fields)
    wraps the tier in a FaultyTier, and says so loudly; `SGL_HICACHE_TEST_FAULTS_RANKS="1"` limits it
    to those TP ranks. Unset in production."""
    import json
    import os

    from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier

    raw = os.environ.get(TEST_FAULTS_ENV)
    ranks = os.environ.get(TEST_FAULTS_RANKS_ENV)
    if not raw or (ranks and str(tp_rank) not in ranks.split(",")):
        return tier
    spec = FaultSpec(**json.loads(raw))
    logger.warning(
        "sgl_hicache: FAULT INJECTION ACTIVE (%s=%s): the tier is a FaultyTier", TEST_FAULTS_ENV, raw
    )
    return FaultyTier(tier, spec)


def open_controller(
    config: SpillConfig, namespace: Namespace, view: KVPoolView, metrics: SpillMetrics, allocator: Any,
    tp_rank: int = 0, streams: Streams | None = None,
) -> SpillController | None:  # fmt: skip
    """The tier, staging (pinned on a GPU) and the copy streams; None (spill off, evictions drop as
    in sglang) if the tier cannot open. `streams`: the copy streams' stand-in (tests)."""
    from sgl_hicache.cache.controller import SpillController
    from sgl_hicache.cache.restore_policy import RestorePolicy
    from sgl_hicache.cache.staging import StagingPool
    from sgl_hicache.server.room import warn_if_too_small
    from sgl_hicache.tier import open_tier

    try:
        tier = open_tier(config.tier, namespace)
    except OSError as e:
        logger.error(
            "sgl_hicache: cannot open the spill tier in %s (%s); serving without spill",
            config.tier.mooncake.real_client or config.tier.mooncake.master
            if config.tier.backend is SpillBackend.MOONCAKE
            else config.tier.directory,
            e,
        )
        return None
    if config.tier.backend is SpillBackend.FILE:
        warn_if_too_small(config.tier)
    tier = with_test_faults(tier, tp_rank)
    try:
        staging = StagingPool(config.staging_bytes, tier.host_memory)
    except (MemoryError, OSError) as e:
        logger.error("sgl_hicache: no staging memory for the spill tier (%s); serving without spill", e)
        try:
            tier.close(STAGING_FAILED_CLOSE_S)
        except Exception as close_error:  # serving without spill all the same
            logger.error("sgl_hicache: closing the spill tier failed too: %s", close_error)
        return None
    if view.device.type == "cuda":
        staging.pin()
    tier.register_host_memory(staging.arena)  # a Mooncake tier's transfers then go straight from it
    return SpillController(
        tier,
        view,
        staging,
        metrics,
        config.io_timeout_s,
        allocator,
        config.prefetch_ttl_s,
        streams,
        config.layer_groups,
        group_major=config.layerwise_restore,
        restore_reserve=config.restore_reserve,
        restore_wait_s=RestorePolicy.of(config).restore_wait_s,
        take_back_reads=config.take_back_reads,
        restores_in_order=config.restores_in_order,
        restores_take_back=config.restores_take_back,
    )
