"""The sglang seam (`sgl_hicache.server.sglang_seam`): the installed sglang passes; every entry of the
table, broken in turn, is named by `check_seam()`; and a broken seam stops the launcher (exit 2, one
line), a scheduler that selected our backend (before any hook of ours is registered) and the factory
(builds nothing). No server is started."""

from __future__ import annotations

import inspect
import pkgutil
import re
import types
import warnings
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from sgl_hicache.server import hooks, sglang_seam
from sgl_hicache.server.handoff import ENV_CONFIG
from sgl_hicache.server.sglang_seam import CLASS, FUNCTION, SEAM, SeamError, Touch, check_seam

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "DESIGN.md"
CALLED = [t for t in SEAM if t.params is not None]
MEMBERS = [(t, m) for t in SEAM for m in t.members]


def short(value: Any) -> str:
    return value.name.removeprefix("sglang.srt.") if isinstance(value, Touch) else str(value)


@pytest.fixture(autouse=True)
def fresh_verdict() -> Iterator[None]:
    """Each test computes its own verdict (it is cached per process), and leaves none behind."""
    sglang_seam.verdict.cache_clear()
    yield
    sglang_seam.verdict.cache_clear()


def owner(name: str) -> tuple[Any, str]:
    parent, attr = name.rsplit(".", 1)
    return pkgutil.resolve_name(parent), attr


def seam_error() -> str:
    with pytest.raises(SeamError) as info:
        check_seam()
    message = str(info.value)
    assert "\n" not in message and f"supports sglang {sglang_seam.SUPPORTED_VERSION} only" in message
    return message


def break_seam(monkeypatch: pytest.MonkeyPatch) -> str:
    """Remove one hooked method, as a rename in sglang would; returns its name."""
    monkeypatch.delattr(pkgutil.resolve_name("sglang.srt.managers.scheduler.Scheduler"), "_prefetch_kvcache")
    return hooks.PREFETCH_TARGET


def test_the_installed_sglang_passes_and_the_verdict_is_kept() -> None:
    check_seam()
    check_seam()
    assert sglang_seam.verdict.cache_info().misses == 1


def test_another_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sglang_seam, "SUPPORTED_VERSION", "0.0.1")
    message = seam_error()
    installed = metadata.version("sglang")
    assert (
        message
        == f"sgl_hicache supports sglang 0.0.1 only; the installed sglang differs: version {installed}"
    )


@pytest.mark.parametrize("touch", SEAM, ids=short)
def test_a_missing_symbol_is_named(touch: Touch, monkeypatch: pytest.MonkeyPatch) -> None:
    parent, attr = owner(touch.name)
    for klass in parent.__mro__ if isinstance(parent, type) else (parent,):  # inherited ones too
        if attr in vars(klass):
            monkeypatch.delattr(klass, attr)
    assert f"{touch.name}: missing" in seam_error()


def unrelated(*names: str) -> Any:
    def stand_in(*args: Any, **kwargs: Any) -> None:
        return None

    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names]
    stand_in.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return stand_in


@pytest.mark.parametrize("touch", CALLED, ids=short)
def test_another_signature_is_named(touch: Touch, monkeypatch: pytest.MonkeyPatch) -> None:
    parent, attr = owner(touch.name)
    if touch.kind is CLASS:  # a class whose constructor takes something else, members kept
        stand_in = type(
            attr, (), {"__init__": unrelated("self", "unrelated"), **dict.fromkeys(touch.members)}
        )
    else:
        stand_in = unrelated("unrelated") if touch.kind is FUNCTION else unrelated("self", "unrelated")
    monkeypatch.setattr(parent, attr, stand_in)
    assert f"{touch.name}: parameters (" in seam_error()


@pytest.mark.parametrize(("touch", "member"), MEMBERS, ids=short)
def test_a_missing_member_is_named(touch: Touch, member: str, monkeypatch: pytest.MonkeyPatch) -> None:
    parent, attr = owner(touch.name)
    others = {m: None for m in touch.members if m != member}
    stand_in = type(attr, (), others) if touch.kind is CLASS else types.SimpleNamespace(**others)
    monkeypatch.setattr(parent, attr, stand_in)
    assert f"{touch.name}.{member}: missing" in seam_error()


@pytest.mark.parametrize("touch", [t for t in SEAM if t.refers], ids=short)
def test_code_that_no_longer_calls_what_we_rely_on_is_named(
    touch: Touch, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent, attr = owner(touch.name)
    original = inspect.unwrap(getattr(parent, attr))
    stand_in = unrelated()
    stand_in.__signature__ = inspect.signature(original)
    monkeypatch.setattr(parent, attr, stand_in)
    assert f"{touch.name}: no longer uses {touch.refers[0]}" in seam_error()


def test_every_hook_target_is_in_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sgl_hicache.server import plugin

    registered: list[str] = []
    monkeypatch.setattr(HookRegistry, "register", lambda target, *args: registered.append(target))
    monkeypatch.setattr(HookRegistry, "apply_hooks", lambda: None)
    hooks.register_scheduler_hooks()
    assert sorted(registered) == sorted(hooks.TARGETS)
    constructors = {f"{t.name}.__init__" for t in SEAM if t.kind is CLASS and t.params is not None}
    launcher = {hooks.EXIT_TARGET, hooks.SIGTERM_TARGET}
    assert {*hooks.TARGETS, *launcher, *plugin.CHECK_TARGETS} <= {t.name for t in SEAM} | constructors


def test_every_entry_is_explained_in_the_design() -> None:
    text = DESIGN.read_text()
    section = text[text.index("## sglang touch points") : text.index("## Known limits")]
    missing = [t.name for t in SEAM if f"`{t.name}`" not in section]
    assert not missing, f"docs/DESIGN.md 'sglang touch points' lacks {missing}"


@pytest.fixture
def launcher_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The variables `main` sets and its warning filter are restored; sglang can never start."""
    from sgl_hicache import launch_server

    for name in (ENV_CONFIG, "PYTHONWARNINGS", "SGLANG_USE_CPU_ENGINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(launch_server, "run_sglang", lambda argv: pytest.fail("sglang started"))
    with warnings.catch_warnings():
        yield


@pytest.mark.usefixtures("launcher_env")
def test_the_launcher_exits_2_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from sgl_hicache.launch_server import main

    broken = break_seam(monkeypatch)
    tier = tmp_path / "tier"
    assert (
        main(
            [
                "--model-path",
                "sgl-hicache-test/no-such-model",
                "--enable-hicache-spill",
                "--hicache-spill-dir",
                str(tier),
            ]
        )
        == 2
    )
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "python -m sgl_hicache.launch_server: error: sgl_hicache supports"
    )
    assert f"{broken}: missing" in lines[0]
    assert not tier.exists()


def test_a_scheduler_that_selected_us_stops_before_a_hook_of_ours_is_registered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sgl_hicache.server import plugin

    calls: list[Any] = []
    monkeypatch.setattr(HookRegistry, "register", lambda *args: calls.append(args))
    monkeypatch.setattr(HookRegistry, "apply_hooks", lambda: calls.append("apply"))
    broken = break_seam(monkeypatch)
    selected = types.SimpleNamespace(radix_cache_backend=plugin.BACKEND_NAME)
    with pytest.raises(SeamError, match=re.escape(broken)):
        plugin.hook_scheduler_if_selected(None, selected, None)
    assert calls == []


def test_sglang_goes_on_after_a_plugin_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why `register()` does not check the seam, and the selected scheduler and the factory do: sglang
    0.5.23's `load_plugins` logs a plugin's exception and goes on, so it would stop nothing there."""
    import sglang.srt.plugins as plugins

    def raising() -> None:
        raise SeamError("broken")

    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    monkeypatch.setattr(plugins, "load_plugins_by_group", lambda *a, **k: {"sgl_hicache": (raising, None)})
    monkeypatch.setattr(plugins.HookRegistry, "apply_hooks", lambda: None)
    plugins.load_plugins()  # does not raise


def test_the_factory_builds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from sgl_hicache.server.factory import build_spill_cache

    broken = break_seam(monkeypatch)
    with pytest.raises(SeamError, match=re.escape(broken)):
        build_spill_cache(None)  # type: ignore[arg-type]  # never read: the seam is checked first
