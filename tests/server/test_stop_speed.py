"""SIGTERM stops a running server as fast as SIGINT does (issue 38, item 11), shown without a
server: SIGINT stops sglang's HTTP server at once, then the launcher kills the rest; SIGTERM makes
sglang drain (in-flight requests finish), send its schedulers a `ShutdownReq` and wait for them to
exit. What made that slower on an idle server is checked here, deterministically: sglang's watchdog
looked at its SIGTERM flag every 5 s (our launcher's hook 12 looks every 0.1 s), and a scheduler
ending on that path spent seconds in the interpreter's final garbage collection (hook 7 freezes the
heap first, `gc.freeze`: the process is exiting, the OS takes its memory back). The end to end:
tests/server/test_shutdown.py."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Coroutine
from types import SimpleNamespace
from typing import Any

import pytest

from sgl_hicache.server import hooks

WATCHDOG = "sglang.srt.managers.tokenizer_manager.TokenizerManager.sigterm_watchdog"


def launcher_hooks(monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple[Any, Any]]:
    """What our launcher registers in its own process (target -> (hook, type)), nothing applied."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    registered: dict[str, tuple[Any, Any]] = {}
    monkeypatch.setattr(
        HookRegistry, "register", lambda target, hook, kind: registered.update({target: (hook, kind)})
    )
    monkeypatch.setattr(HookRegistry, "apply_hooks", lambda: None)
    hooks.register_exit_hook()
    return registered


def drain_delays(
    monkeypatch: pytest.MonkeyPatch, watchdog: Callable[[Any], Coroutine[Any, Any, Any]]
) -> list[float]:
    """Run `watchdog` (sglang's, hooked or not) on an idle tokenizer manager whose SIGTERM flag is
    set while it first sleeps; the delays it slept until it sent the ShutdownReq, which it must."""
    from sglang.srt.managers import tokenizer_manager
    from sglang.srt.managers.io_struct import ShutdownReq

    delays: list[float] = []
    sent: list[Any] = []
    manager = SimpleNamespace(
        gracefully_exit=False, rid_to_state={}, server_status=tokenizer_manager.ServerStatus.Up,
        _subprocess_watchdog=None, _dispatch_to_scheduler=sent.append, _server_stop_hook=lambda: None,
        asyncio_tasks=set(),
    )  # fmt: skip

    async def sleep(delay: float, result: Any = None) -> Any:
        delays.append(delay)
        manager.gracefully_exit = True  # SIGTERM arrives while the watchdog waits
        return result

    monkeypatch.setattr(asyncio, "sleep", sleep)
    monkeypatch.setattr(tokenizer_manager, "collect_scheduler_processes", lambda: [])
    monkeypatch.setattr(tokenizer_manager, "kill_process_tree", lambda *args, **kwargs: None)
    asyncio.run(watchdog(manager))
    assert [type(r) for r in sent] == [ShutdownReq]
    return delays


def test_sglangs_drain_starts_within_a_tenth_of_a_second_of_sigterm(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.plugins.hook_registry import _wrap_fn

    original = TokenizerManager.sigterm_watchdog
    assert 5 in drain_delays(monkeypatch, original), "sglang's own watchdog looks every 5 s"
    registered = launcher_hooks(monkeypatch)
    assert WATCHDOG in registered, "our launcher does not hook sglang's SIGTERM watchdog"
    hooked = _wrap_fn(original, *registered[WATCHDOG])
    delays = drain_delays(monkeypatch, hooked)
    assert delays and max(delays) <= 0.1, delays


def test_a_scheduler_ending_on_the_graceful_path_freezes_its_heap() -> None:
    """Hook 7 (`Scheduler.release_host_resources`, called only when a ShutdownReq ended the loop):
    the interpreter's final collection then skips the heap (seconds on a loaded machine)."""
    gc.unfreeze()
    try:
        hooks.close_tier_first(SimpleNamespace(tree_cache=None))
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
