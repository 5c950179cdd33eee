"""The one patch of sglang we make, through sglang's own plugin hook registry (no file edited).

Patched: `SchedulerInternalStateController.get_internal_state` (sglang 0.5.23,
`sglang/srt/managers/scheduler_components/internal_state.py`), with an AFTER hook that adds a
`"hicache_spill"` entry (our counters, staging, tier stats and an integrity check) to the scheduler's
internal state. Why: it is the only read-back channel from the scheduler process to HTTP
(`GET /server_info` → `internal_states`) that sglang offers without adding request types, and
operators and tests need to see the spill cache's state. Read-only: nothing of sglang's state changes.
`tests/server/test_internal_state_hook.py` proves it still holds for the pinned version.
"""

from __future__ import annotations

from typing import Any

TARGET = "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state"
STATE_KEY = "hicache_spill"


def add_spill_state(result: Any, controller: Any, *args: Any, **kwargs: Any) -> Any:
    from sgl_hicache.cache.spill_radix_cache import SpillRadixCache

    cache = controller.scheduler.tree_cache
    if isinstance(cache, SpillRadixCache) and isinstance(result.internal_state, dict):
        result.internal_state[STATE_KEY] = cache.report()
    return result


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, add_spill_state, HookType.AFTER)
