"""The patches of sglang we make, all through sglang's own plugin hook registry (no file edited),
both AFTER hooks that call sglang's original first and change none of its state:

1. `SchedulerInternalStateController.get_internal_state` (sglang 0.5.23,
   `sglang/srt/managers/scheduler_components/internal_state.py`): adds a `"hicache_spill"` entry
   (counters, staging, tier stats, an integrity verdict) to the scheduler's internal state. Why: it
   is the only read-back channel from the scheduler process to HTTP (`GET /server_info` →
   `internal_states`) that sglang offers without new request types.
2. `Scheduler._prefetch_kvcache` (`sglang/srt/managers/scheduler.py`), which sglang calls for every
   request as it enters the waiting queue (its own storage prefetch, a no-op unless HiCache storage
   is on): starts reading the request's spilled prefix from the tier, so the I/O overlaps the
   request's queueing and other requests' compute. Why: it is sglang's arrival point for exactly this.
3. `Scheduler.ingest_requests` (each scheduler loop iteration): afterwards, the scheduler thread
   answers waiting client resume hints (`hints.py`). Why: hints must run on the scheduler thread.
4. `http_server.set_global_state` (the HTTP process, once at start): afterwards, adds
   `POST /hicache/prefetch` to sglang's FastAPI app (`http_routes.py`).
`tests/server/test_concurrent_clients.py` and `tests/server/test_spill_resume.py` prove they still
hold for the pinned version.
"""

from __future__ import annotations

from typing import Any

TARGET = "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state"
PREFETCH_TARGET = "sglang.srt.managers.scheduler.Scheduler._prefetch_kvcache"
HINTS_TARGET = "sglang.srt.managers.scheduler.Scheduler.ingest_requests"
ROUTES_TARGET = "sglang.srt.entrypoints.http_server.set_global_state"
STATE_KEY = "hicache_spill"


def add_spill_state(result: Any, controller: Any, *args: Any, **kwargs: Any) -> Any:
    from sgl_hicache.cache.spill_radix_cache import SpillRadixCache

    cache = controller.scheduler.tree_cache
    if isinstance(cache, SpillRadixCache) and isinstance(result.internal_state, dict):
        result.internal_state[STATE_KEY] = cache.report(idle=controller.scheduler.is_fully_idle())
    return result


def prefetch_at_arrival(result: Any, scheduler: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    from sgl_hicache.cache.spill_radix_cache import SpillRadixCache

    cache = scheduler.tree_cache
    if isinstance(cache, SpillRadixCache):
        cache.prefetch(req.origin_input_ids, req.extra_key, req.cache_salt)
    return result


def take_hints(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    from sgl_hicache.cache.spill_radix_cache import SpillRadixCache

    cache = scheduler.tree_cache
    if isinstance(cache, SpillRadixCache):
        cache.take_hints()
    return result


def add_routes(result: Any, *args: Any, **kwargs: Any) -> Any:
    from sglang.srt.entrypoints.http_server import app

    from sgl_hicache.server.http_routes import add_prefetch_route

    add_prefetch_route(app)
    return result


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, add_spill_state, HookType.AFTER)
    HookRegistry.register(PREFETCH_TARGET, prefetch_at_arrival, HookType.AFTER)
    HookRegistry.register(HINTS_TARGET, take_hints, HookType.AFTER)
    HookRegistry.register(ROUTES_TARGET, add_routes, HookType.AFTER)
