"""The sglang plugin (entry-point group `sglang.srt.plugins`): registers our radix-cache backend.

sglang calls `register()` early in each of its processes (`load_plugins()`), so
`--radix-cache-backend hicache_spill` resolves in the scheduler. Registering is idempotent.
"""

from __future__ import annotations

from sgl_hicache.server.metrics import BACKEND_NAME


def register() -> None:
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    from sgl_hicache.cache.factory import build_spill_cache

    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, build_spill_cache)
