"""The sglang plugin (entry-point group `sglang.srt.plugins`).

sglang runs `register()` early in every process of every server started in this environment (main
and HTTP, scheduler, detokenizer, ...), before that process knows the server's flags, and whether or
not the server selected our backend. So `register()` registers nothing of ours, only:

- our backend's name in sglang's radix-cache registry, so `--radix-cache-backend hicache_spill`
  resolves; its factory imports the cache when a scheduler calls it (`server/factory.py`);
- two check hooks, which compare the server's `radix_cache_backend` with that name and otherwise
  return at once, having imported nothing:
  - `Scheduler.__init__`, BEFORE: in a scheduler that selected us, checks the sglang seam
    (`sglang_seam.check_seam`: a SeamError ends the scheduler, and sglang stops the server), then
    registers and applies the scheduler's hooks (`hooks.register_scheduler_hooks`). Before, not
    after: every patch is in place before the Scheduler is built, so nothing it builds (its request
    dispatcher, our cache) can hold an unpatched method.
  - `http_server.set_global_state`, AFTER: in the HTTP process of such a server, adds
    `POST /hicache/prefetch` (`hooks.add_routes`). sglang calls it once every scheduler is built,
    i.e. has passed the seam check;

The CPU profile (`cpu/`, distribution `sgl-hicache-cpu`) has a plugin of its own for its patches.

Our launcher registers the one hook left (`hooks.register_exit_hook`, removal of the hint socket's
runtime directory): it is the process that makes that directory. Importing this module imports no
other module of ours (tests/test_import_graph.py).
"""

from __future__ import annotations

from typing import Any

from sgl_hicache import BACKEND_NAME

SCHEDULER_TARGET = "sglang.srt.managers.scheduler.Scheduler.__init__"
ROUTES_TARGET = "sglang.srt.entrypoints.http_server.set_global_state"
CHECK_TARGETS = (SCHEDULER_TARGET, ROUTES_TARGET)


def register() -> None:
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, build_spill_cache)
        HookRegistry.register(SCHEDULER_TARGET, hook_scheduler_if_selected, HookType.BEFORE)
        HookRegistry.register(ROUTES_TARGET, add_routes_if_selected, HookType.AFTER)


def selected(server_args: Any) -> bool:
    return getattr(server_args, "radix_cache_backend", None) == BACKEND_NAME


def build_spill_cache(context: Any) -> Any:
    from sgl_hicache.server import factory

    return factory.build_spill_cache(context)


def hook_scheduler_if_selected(scheduler: Any, server_args: Any = None, *args: Any, **kwargs: Any) -> None:
    if selected(server_args):
        from sgl_hicache.server import hooks
        from sgl_hicache.server.sglang_seam import check_seam

        check_seam()
        hooks.register_scheduler_hooks()


def add_routes_if_selected(result: Any, global_state: Any = None, *args: Any, **kwargs: Any) -> None:
    if selected(getattr(getattr(global_state, "tokenizer_manager", None), "server_args", None)):
        from sgl_hicache.server import hooks

        hooks.add_routes(result, global_state, *args, **kwargs)
