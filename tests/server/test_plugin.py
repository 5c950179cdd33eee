"""The plugin is inert where our backend was not selected (issues 24 and 28): sglang runs `register()`
in every process of every server of this environment, so it registers only the backend's name and two
check hooks; the scheduler's hooks and the HTTP route come only to a server started with
`--radix-cache-backend hicache_spill`. No server is started (tests/server/test_hicache_cpu_compat_server.py
and test_end_to_end.py check plain servers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from sgl_hicache.server import hooks, plugin


@pytest.fixture
def registries(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """sglang's hook and backend registries as in a process our plugin has not run in; the real ones
    are put back afterwards. Yields HookRegistry."""
    from sglang.srt.mem_cache import registry
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    monkeypatch.setattr(registry, "_RADIX_CACHE_REGISTRY", {})
    yield HookRegistry


@pytest.fixture
def recorded(registries: Any, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every `HookRegistry.register` (its target) and `apply_hooks` ("apply") call, none carried out.
    The seam's verdict, kept for the process, is taken first, with sglang's own `register`."""
    from sgl_hicache.server.sglang_seam import check_seam

    check_seam()
    calls: list[Any] = []
    monkeypatch.setattr(registries, "register", lambda target, *args, **kwargs: calls.append(target))
    monkeypatch.setattr(registries, "apply_hooks", lambda: calls.append("apply"))
    return calls


def server_args(backend: str | None) -> Any:
    return SimpleNamespace(radix_cache_backend=backend)


def test_register_adds_only_the_backend_name_and_the_check_hooks(registries: Any) -> None:
    from sglang.srt.mem_cache import registry
    from sglang.srt.plugins.hook_registry import HookType

    plugin.register()
    plugin.register()  # a second call adds nothing
    assert registry.registered_radix_cache_backends() == [plugin.BACKEND_NAME]
    assert {target: [(t, h) for t, h, _ in entries] for target, entries in registries._hooks.items()} == {
        plugin.SCHEDULER_TARGET: [(HookType.BEFORE, plugin.hook_scheduler_if_selected)],
        plugin.ROUTES_TARGET: [(HookType.AFTER, plugin.add_routes_if_selected)],
    }
    assert registries._patched == set()  # sglang's load_plugins applies them


@pytest.mark.parametrize("backend", [None, "radix", "hicache_spill2"])
def test_a_scheduler_that_did_not_select_us_gets_no_hook(recorded: list[Any], backend: str | None) -> None:
    assert plugin.hook_scheduler_if_selected(object(), server_args(backend), object()) is None
    assert plugin.hook_scheduler_if_selected(object(), server_args=server_args(backend)) is None
    assert recorded == []


def test_a_scheduler_that_selected_us_gets_its_hooks_before_it_is_built(recorded: list[Any]) -> None:
    assert plugin.hook_scheduler_if_selected(object(), server_args(plugin.BACKEND_NAME), object()) is None
    assert recorded == [*hooks.TARGETS, "apply"]
    recorded.clear()
    plugin.hook_scheduler_if_selected(object(), server_args=server_args(plugin.BACKEND_NAME), port_args=None)
    assert recorded == [*hooks.TARGETS, "apply"]


@pytest.mark.parametrize(("backend", "added"), [(None, False), ("radix", False), (plugin.BACKEND_NAME, True)])
def test_the_route_is_added_only_where_we_were_selected(
    monkeypatch: pytest.MonkeyPatch, backend: str | None, added: bool
) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(hooks, "add_routes", lambda *args, **kwargs: calls.append(args))
    state = SimpleNamespace(tokenizer_manager=SimpleNamespace(server_args=server_args(backend)))
    assert plugin.add_routes_if_selected(None, state) is None
    assert len(calls) == added


def test_a_global_state_without_server_args_is_not_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hooks, "add_routes", lambda *args, **kwargs: pytest.fail("route added"))
    assert plugin.add_routes_if_selected(None, object()) is None
    assert plugin.add_routes_if_selected(None, SimpleNamespace(tokenizer_manager=None)) is None


def test_the_names_the_plugins_check_without_importing_them_are_the_real_ones() -> None:
    from sgl_hicache_cpu import cpu_prefix_attention, hicache_cpu_compat
    from sgl_hicache_cpu import plugin as cpu_plugin

    from sgl_hicache.cache.metrics import BACKEND_NAME

    assert plugin.BACKEND_NAME == BACKEND_NAME
    assert cpu_plugin.COMPAT_ENV == (hicache_cpu_compat.ENV_VAR, hicache_cpu_compat.ENV_VAR_SGLANG_TWIN)
    assert cpu_plugin.PREFIX_ATTENTION_ENV == (
        cpu_prefix_attention.ENV_VAR,
        cpu_prefix_attention.ENV_VAR_SGLANG_TWIN,
    )


LOAD_PLUGINS = """
import json, sys
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.mem_cache.registry import registered_radix_cache_backends
before = set(sys.modules)
load_plugins()
print(json.dumps({"patched": sorted(HookRegistry._patched), "backends": registered_radix_cache_backends(),
                  "imported": sorted(m for m in set(sys.modules) - before if m.startswith("sgl_hicache"))}))
"""


def test_every_sglang_process_gets_only_the_checks() -> None:
    """What `load_plugins()` leaves in any process of a server (main, scheduler, detokenizer) before it
    knows the server's flags: our check hooks applied, nothing of ours imported but the plugin."""
    env = {**os.environ, "SGLANG_PLUGINS": "sgl_hicache"}
    out = subprocess.run(
        [sys.executable, "-c", LOAD_PLUGINS], env=env, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["patched"] == sorted(plugin.CHECK_TARGETS)
    assert found["backends"] == [plugin.BACKEND_NAME]
    assert set(found["imported"]) <= {"sgl_hicache", "sgl_hicache.server", "sgl_hicache.server.plugin"}


def test_the_cpu_profile_plugin_imports_nothing_unasked() -> None:
    """Both plugins of ours in this environment (the runtime's and the CPU profile's, `cpu/`), loaded as
    sglang loads them in every process: without the CPU profile's variables, its plugin imports nothing
    but itself and patches nothing."""
    from sgl_hicache_cpu import plugin as cpu_plugin

    env = {**os.environ, "SGLANG_PLUGINS": "sgl_hicache,sgl_hicache_cpu"}  # not smg's, which patch too
    for name in (*cpu_plugin.COMPAT_ENV, *cpu_plugin.PREFIX_ATTENTION_ENV):
        env.pop(name, None)
    out = subprocess.run(
        [sys.executable, "-c", LOAD_PLUGINS], env=env, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["patched"] == sorted(plugin.CHECK_TARGETS)
    assert set(found["imported"]) <= {
        "sgl_hicache",
        "sgl_hicache.server",
        "sgl_hicache.server.plugin",
        "sgl_hicache_cpu",
        "sgl_hicache_cpu.plugin",
    }
    assert "sgl_hicache_cpu.plugin" in found["imported"]  # the profile's plugin did load
