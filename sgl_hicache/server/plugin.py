"""The sglang plugin (entry-point group `sglang.srt.plugins`): registers our radix-cache backend
and our one read-only hook (`sgl_hicache.server.hooks`).

sglang calls `register()` once early in each of its processes (`load_plugins()`, which is guarded
against running twice), so `--radix-cache-backend hicache_spill` resolves in the scheduler.
With `SGL_HICACHE_CPU_HICACHE_COMPAT=1` it also applies `sgl_hicache.platform.hicache_cpu_compat`,
which lets sglang's own HiCache run on CPU (the benchmark's peer).

Before anything, it checks the sglang seam (`sglang_seam.check_seam`) and raises SeamError on a
mismatch, having registered nothing. sglang 0.5.23's `load_plugins` logs that exception and goes on
(it does not stop start-up), so the backend stays unregistered: a server started with
`--radix-cache-backend hicache_spill` stops when its scheduler finds no such backend, and one that
does not ask for it runs unaffected.
"""

from __future__ import annotations

from sgl_hicache.cache.metrics import BACKEND_NAME


def register() -> None:
    from sgl_hicache.server.sglang_seam import check_seam

    check_seam()
    _apply_cpu_hicache_compat()
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    from sgl_hicache.server.factory import build_spill_cache
    from sgl_hicache.server.hooks import register_hooks

    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, build_spill_cache)
        register_hooks()


def _apply_cpu_hicache_compat() -> None:
    from sgl_hicache.platform import hicache_cpu_compat

    if hicache_cpu_compat.enabled_by_env():
        hicache_cpu_compat.apply()
