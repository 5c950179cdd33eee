"""Our out-of-tree CPU platform (`sgl_hicache_cpu.cpu_tp_platform`) and its launch defaults
(`cpu_tp_env`), in process: discovery, selection, targets, and that it answers as sglang's CPU
platform does everywhere but PyNccl. Tests that select a platform restore sglang's afterwards."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator
from typing import Any

import pytest
import sglang.srt.platforms as platforms
import torch
from sgl_hicache_cpu import cpu_tp_env, cpu_tp_platform
from sgl_hicache_cpu.cpu_tp_platform import (
    PLATFORM_NAME,
    QUALNAME,
    CpuTPPlatform,
    PlatformTargetMissing,
    activate,
    check_targets,
)
from sglang.srt.distributed import parallel_state
from sglang.srt.platforms.cpu import CpuSRTPlatform
from sglang.srt.platforms.interface import SRTPlatform
from sglang.srt.plugins import PLATFORM_PLUGINS_GROUP


@pytest.fixture
def cpu_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The environment our launcher gives a `--device cpu --tp-size 2` server."""
    monkeypatch.setenv("SGLANG_PLATFORM", PLATFORM_NAME)
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    return monkeypatch


@pytest.fixture
def as_platform(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """`as_platform(p)` makes `p` sglang's current platform until the test ends."""
    from sglang.kernels import fused_op

    def select(platform: SRTPlatform) -> None:
        monkeypatch.setattr(platforms, "_current_platform", platform)
        fused_op._oot_dispatch_key.cache_clear()

    yield select
    fused_op._oot_dispatch_key.cache_clear()


def test_the_entry_point_is_installed_and_is_activate() -> None:
    eps = importlib.metadata.entry_points(group=PLATFORM_PLUGINS_GROUP)
    assert [ep.name for ep in eps if ep.value.startswith(("sgl_hicache.", "sgl_hicache_cpu."))] == [
        PLATFORM_NAME
    ]
    assert eps[PLATFORM_NAME].load() is activate


def test_selected_through_sglang_when_named(cpu_env: pytest.MonkeyPatch) -> None:
    assert activate() == QUALNAME
    assert type(platforms._resolve_platform()) is CpuTPPlatform


def test_declines_unless_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_PLATFORM", raising=False)
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    assert activate() is None
    assert type(platforms._resolve_platform()) is CpuSRTPlatform  # sglang's own, as without us


def test_declines_without_the_cpu_engine(cpu_env: pytest.MonkeyPatch) -> None:
    cpu_env.setenv("SGLANG_USE_CPU_ENGINE", "0")
    assert activate() is None


def test_declines_on_a_gpu_machine(cpu_env: pytest.MonkeyPatch) -> None:
    cpu_env.setattr(torch.cuda, "is_available", lambda: True)
    assert activate() is None
    with pytest.raises(RuntimeError, match="activate\\(\\) returned None"):
        platforms._resolve_platform()  # sglang refuses a named platform that declines


def test_targets_hold_on_the_installed_sglang() -> None:
    check_targets()


def _no_longer_asks(*args: Any, **kwargs: Any) -> None:
    return None


BREAKAGES = [
    ("sglang.srt.distributed.parallel_state", "init_model_parallel_group", _no_longer_asks,
     "parallel_state.init_model_parallel_group: no longer consults the platform's supports_pynccl"),
    ("sglang.srt.utils.common", "get_device_memory_capacity", _no_longer_asks,
     "common.get_device_memory_capacity: no longer consults the platform's get_device_total_memory"),
    ("sglang.srt.model_executor.cpu_graph_runner", "CPUGraphRunner", None,
     "cpu_graph_runner.CPUGraphRunner: not found"),
    ("sglang.srt.platforms.interface", "SRTPlatform.get_device_total_memory", lambda self: 0,
     "SRTPlatform.get_device_total_memory: signature changed"),
]  # fmt: skip


@pytest.mark.parametrize(("module", "name", "replacement", "message"), BREAKAGES, ids=lambda v: str(v)[:40])
def test_a_broken_target_fails_with_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, module: str, name: str, replacement: Any, message: str
) -> None:
    owner: Any = importlib.import_module(module)
    *path, attribute = name.split(".")
    for part in path:
        owner = getattr(owner, part)
    monkeypatch.setattr(owner, attribute, replacement)
    with pytest.raises(PlatformTargetMissing) as e:
        check_targets()
    assert message in str(e.value) and "\n" not in str(e.value)


def test_load_points_check_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel_state, "init_model_parallel_group", _no_longer_asks)
    platform = CpuTPPlatform()
    for load_point in (platform.init_backend, lambda: platform.apply_server_args_defaults(object())):
        with pytest.raises(PlatformTargetMissing, match="supports_pynccl"):
            load_point()


def test_model_parallel_groups_get_no_pynccl_on_ours_only(
    monkeypatch: pytest.MonkeyPatch, as_platform: Any
) -> None:
    made: list[dict[str, Any]] = []
    monkeypatch.setattr(parallel_state, "GroupCoordinator", lambda **kwargs: made.append(kwargs))
    for platform in (CpuSRTPlatform(), CpuTPPlatform()):
        as_platform(platform)
        parallel_state.init_model_parallel_group([[0, 1]], 0, "gloo", group_name="tp")
    assert [m["use_pynccl"] for m in made] == [True, False]


def test_answers_as_sglangs_cpu_platform(as_platform: Any) -> None:
    from sglang.kernels import fused_op
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.utils.common import get_cpu_memory_capacity

    ours, theirs = CpuTPPlatform(), CpuSRTPlatform()
    assert ours.is_out_of_tree() and not theirs.is_out_of_tree()
    assert ours.is_cpu() and ours.device_type == theirs.device_type == "cpu"
    assert ours.get_torch_distributed_backend_str() == "gloo"
    assert ours.capabilities == theirs.capabilities and not ours.capabilities.supports_pynccl
    assert ours.get_group_coordinator_device(1) == torch.device("cpu")
    mib = get_cpu_memory_capacity()
    assert ours.get_device_total_memory() == (0 if mib is None else int(mib) << 20)
    forwards = []
    for platform in (theirs, ours):
        as_platform(platform)
        forwards.append([op._resolve_forward_method().__name__ for op in (RMSNorm(64), SiluAndMul())])
        assert fused_op._oot_dispatch_key() is None  # in-tree dispatch steps
    assert forwards[0] == forwards[1]


def test_defaults_turn_custom_all_reduce_off() -> None:
    class Args:
        disable_custom_all_reduce = False

    args = Args()
    CpuTPPlatform().apply_server_args_defaults(args)
    assert args.disable_custom_all_reduce is True


# --- launch defaults (cpu_tp_env) -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--device", "cpu", "--tp-size", "2"], 2),
        (["--device=cpu", "--tensor-parallel-size=4"], 4),
        (["--tp-size", "2", "--tp-size", "3"], 3),
        (["--device", "cpu"], 1),
        (["--tp-size", "two"], 1),
    ],
)
def test_tp_size_from_argv(argv: list[str], expected: int) -> None:
    assert cpu_tp_env.tp_size(argv) == expected


@pytest.mark.parametrize(
    ("cpus", "ranks", "expected"),
    [
        ([0, 1], 2, "0|1"),
        (range(16), 2, "0-7|8-15"),
        (range(5), 3, "0-1|2-3|4"),
        ([0, 1, 2, 5, 6], 2, "0-2|5-6"),
        ([0, 2, 4, 6], 2, "0,2|4,6"),
        ([3], 2, "3|3"),
        ([0, 1, 2], 1, "0-2"),
    ],
)
def test_split_cpus(cpus: list[int], ranks: int, expected: str) -> None:
    assert cpu_tp_env.split_cpus(cpus, ranks) == expected


@pytest.mark.parametrize(
    ("cpus", "n", "expected"),
    [
        ([0, 1], 2, ((0,), (1,))),
        (range(16), 2, (tuple(range(8)), tuple(range(8, 16)))),
        ([2, 0, 1], 2, ((0, 1), (2,))),  # sorted; the larger share first
        (range(7), 3, ((0, 1, 2), (3, 4), (5, 6))),
        ([0, 1], 1, ((0, 1),)),
        ([4], 2, ((4,), (4,))),  # fewer CPUs than shares: they overlap
        ([0, 1], 3, ((0,), (1,), (0,))),
    ],
)
def test_cpu_shares(cpus: list[int], n: int, expected: tuple[tuple[int, ...], ...]) -> None:
    assert cpu_tp_env.cpu_shares(cpus, n) == expected


@pytest.mark.parametrize(("cpus", "n"), [([], 2), ([0, 1], 0)])
def test_cpu_shares_of_nothing_is_an_error(cpus: list[int], n: int) -> None:
    with pytest.raises(ValueError, match=f"cannot split {len(cpus)} CPUs into {n} shares"):
        cpu_tp_env.cpu_shares(cpus, n)


def test_cpu_tp_env_splits_the_given_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_tp_env.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    env = cpu_tp_env.cpu_tp_env(["--device", "cpu", "--tp-size", "2"], {}, cpus=(2, 3))
    assert env["SGLANG_CPU_OMP_THREADS_BIND"] == "2|3"


def test_cpu_tp_env_only_for_cpu_tp_and_never_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_tp_env.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    argv = ["--device", "cpu", "--tp-size", "2"]
    assert cpu_tp_env.cpu_tp_env(argv, {}) == {"SGLANG_PLATFORM": PLATFORM_NAME,
                                               "SGLANG_CPU_OMP_THREADS_BIND": "0-1|2-3"}  # fmt: skip
    assert cpu_tp_env.cpu_tp_env(argv, {"SGLANG_CPU_OMP_THREADS_BIND": "0|3"}) == {
        "SGLANG_PLATFORM": PLATFORM_NAME
    }
    assert cpu_tp_env.cpu_tp_env(["--device", "cpu", "--tp-size", "1"], {}) == {}
    assert cpu_tp_env.cpu_tp_env(["--device", "cuda", "--tp-size", "2"], {}) == {}


def test_env_names_the_platform_entry_point() -> None:
    assert cpu_tp_env.PLATFORM_NAME == cpu_tp_platform.PLATFORM_NAME
