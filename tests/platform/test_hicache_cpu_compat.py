"""The CPU patches for sglang's own HiCache (`sgl_hicache_cpu.hicache_cpu_compat`), in process.

Every test that applies the patches restores sglang and torch afterwards (`restore_targets`), so the
rest of the session sees the unpatched libraries.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from sgl_hicache_cpu import hicache_cpu_compat as compat
from sgl_hicache_cpu.hicache_cpu_compat import CompatTargetMissing, transfer_kv_direct
from sgl_hicache_cpu.page_first_direct import (
    transfer_kv_all_layer_direct_lf_pf,
    transfer_kv_per_layer_direct_pf_lf,
)

LAYERS, HEADS, HEAD_DIM = 2, 2, 16


@pytest.fixture
def restore_targets(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Undo whatever `apply()` does to the patched symbols when the test ends."""
    from sglang.srt.mem_cache.pool_host import base, mha

    monkeypatch.setattr(base.HostKVCache, "__init__", base.HostKVCache.__init__)
    for owner, name in (
        (mha, "transfer_kv_direct"),
        (mha, "transfer_kv_per_layer_direct_pf_lf"),
        (mha, "transfer_kv_all_layer_direct_lf_pf"),
        (torch.cpu.Stream, "synchronize"),
        (torch.cpu.Stream, "query"),
    ):
        if name in vars(owner):
            monkeypatch.setattr(owner, name, vars(owner)[name])
        else:  # absent: recorded as absent, so teardown deletes what apply() adds
            monkeypatch.setattr(owner, name, None, raising=False)
            monkeypatch.delattr(owner, name)
    yield


def ref_transfer(
    src_layers: list[torch.Tensor],
    dst_layers: list[torch.Tensor],
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
) -> None:
    for src, dst in zip(src_layers, dst_layers, strict=True):
        for s, d in zip(src_idx.tolist(), dst_idx.tolist(), strict=True):
            dst[d] = src[s]


def layers(
    rows: int, dtype: torch.dtype, seed: int, heads: int = HEADS, head_dim: int = HEAD_DIM
) -> list[torch.Tensor]:
    """K and V of every layer: [rows, heads, head_dim] of random values."""
    gen = torch.Generator().manual_seed(seed)
    shape = (rows, heads, head_dim)
    if dtype.is_floating_point:
        return [torch.randn(shape, generator=gen).to(dtype) for _ in range(2 * LAYERS)]
    return [torch.randint(0, 256, shape, generator=gen, dtype=dtype) for _ in range(2 * LAYERS)]


# --- the pinned version still has every target ------------------------------------------------------


def test_pinned_sglang_has_every_patch_target() -> None:
    assert importlib.metadata.version("sglang") == "0.5.23"
    compat.check_targets()


@pytest.mark.usefixtures("restore_targets")
def test_missing_transfer_caller_fails_loudly_and_patches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.mem_cache.pool_host import base, mha

    init_before = base.HostKVCache.__init__
    monkeypatch.setattr(mha.MHATokenToKVPoolHost, "load_to_device_per_layer", lambda self: None)
    with pytest.raises(
        CompatTargetMissing, match=r"pool_host\.mha\.transfer_kv_direct.*load_to_device_per_layer"
    ):
        compat.apply()
    assert base.HostKVCache.__init__ is init_before
    assert not hasattr(mha, "transfer_kv_direct")


def load_with_a_new_keyword(self: Any) -> None:  # never called: its code is what the check reads
    transfer_kv_direct(src_layers=[], dst_layers=[], src_indices=IDX, dst_indices=IDX, page_size=1)
    transfer_kv_per_layer_direct_pf_lf(src_ptrs=[], dst_ptrs=[], src_indices=IDX, dst_indices=IDX,
                                       layer_id=0, page_size=1, stream=None)  # type: ignore[call-arg]  # fmt: skip


def backup_without_page_size(self: Any) -> None:  # never called
    transfer_kv_direct(src_layers=[], dst_layers=[], src_indices=IDX, dst_indices=IDX, page_size=1)
    transfer_kv_all_layer_direct_lf_pf(src_ptrs=[], dst_ptrs=[], src_indices=IDX, dst_indices=IDX)  # type: ignore[call-arg]


IDX = torch.arange(0)


@pytest.mark.usefixtures("restore_targets")
@pytest.mark.parametrize(
    ("method", "copy", "stand_in"),
    [
        ("load_to_device_per_layer", "transfer_kv_per_layer_direct_pf_lf", load_with_a_new_keyword),
        ("backup_from_device_all_layer", "transfer_kv_all_layer_direct_lf_pf", backup_without_page_size),
    ],
)
def test_a_page_first_direct_call_with_other_keywords_fails_loudly(
    monkeypatch: pytest.MonkeyPatch, method: str, copy: str, stand_in: Any
) -> None:
    """sglang calling a copy with other keywords than our torch version's parameters (one added, one
    dropped) is refused at start, before anything is patched."""
    from sglang.srt.mem_cache.pool_host import mha

    monkeypatch.setattr(mha.MHATokenToKVPoolHost, method, stand_in)
    with pytest.raises(
        CompatTargetMissing, match=rf"pool_host\.mha\.{copy}: .*{method} no longer passes exactly"
    ):
        compat.apply()
    assert not hasattr(mha, copy) and not hasattr(mha, "transfer_kv_direct")


@pytest.mark.usefixtures("restore_targets")
@pytest.mark.parametrize("copy", ["transfer_kv_per_layer_direct_pf_lf", "transfer_kv_all_layer_direct_lf_pf"])
def test_a_foreign_page_first_direct_copy_is_not_replaced(monkeypatch: pytest.MonkeyPatch, copy: str) -> None:
    from sglang.srt.mem_cache.pool_host import mha

    def foreign(*args: Any) -> None: ...

    monkeypatch.setattr(mha, copy, foreign, raising=False)
    with pytest.raises(CompatTargetMissing, match=rf"{copy}: already bound .*refusing to replace"):
        compat.apply()
    assert getattr(mha, copy) is foreign


@pytest.mark.usefixtures("restore_targets")
def test_host_pool_without_pin_memory_parameter_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.mem_cache.pool_host import base

    def init(self: Any, *, dtype: torch.dtype) -> None: ...

    monkeypatch.setattr(base.HostKVCache, "__init__", init)
    with pytest.raises(CompatTargetMissing, match=r"pool_host\.base\.HostKVCache\.__init__"):
        compat.check_targets()


@pytest.mark.usefixtures("restore_targets")
def test_a_foreign_transfer_kv_direct_is_not_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.mem_cache.pool_host import mha

    def foreign(*args: Any) -> None: ...

    monkeypatch.setattr(mha, "transfer_kv_direct", foreign, raising=False)
    with pytest.raises(CompatTargetMissing, match="refusing to replace"):
        compat.apply()
    assert mha.transfer_kv_direct is foreign


# --- apply(): idempotent, inert on CUDA, and what it enables ---------------------------------------


@pytest.mark.usefixtures("restore_targets")
def test_apply_is_idempotent() -> None:
    from sglang.srt.mem_cache.pool_host import base, mha

    assert not compat.is_applied()

    def targets() -> tuple[object, ...]:
        return (base.HostKVCache.__init__, mha.transfer_kv_direct, torch.cpu.Stream.synchronize,
                torch.cpu.Stream.query, mha.transfer_kv_per_layer_direct_pf_lf,
                mha.transfer_kv_all_layer_direct_lf_pf)  # fmt: skip

    assert compat.apply() is True
    patched = targets()
    assert compat.apply() is True
    assert all(a is b for a, b in zip(patched, targets(), strict=True))
    assert base.HostKVCache.__init__.__wrapped__.__name__ == "__init__"  # type: ignore[attr-defined]
    assert not hasattr(base.HostKVCache.__init__.__wrapped__, "__wrapped__")  # type: ignore[attr-defined]
    assert compat.is_applied()
    stream = torch.cpu.Stream()
    assert stream.synchronize() is None and stream.query() is True


@pytest.mark.usefixtures("restore_targets")
def test_apply_does_nothing_where_cuda_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.mem_cache.pool_host import base

    init_before = base.HostKVCache.__init__
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert compat.apply() is False
    assert base.HostKVCache.__init__ is init_before
    assert not hasattr(torch.cpu.Stream, "synchronize")


def make_pools(layout: str = "layer_first", page_size: int = 1) -> tuple[Any, Any]:
    """A real sglang CPU device pool (64 slots) and its host pool (ratio 2) in `layout`."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    device = MHATokenToKVPool(64, page_size, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu", False)
    gen = torch.Generator().manual_seed(0)
    for buf in (*device.k_buffer, *device.v_buffer):
        buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype))
    info = device.get_device_pool_infos()[0].buffer_info
    host = MHATokenToKVPoolHost(
        info, 2.0, 0, page_size, layout, device_capacity_tokens=64, start_layer=0, end_layer=LAYERS - 1
    )
    return device, host


def test_unpatched_host_pool_needs_cuda() -> None:
    """What the pin_memory patch is for: without it a CPU host pool cannot even be built."""
    if compat.is_applied():
        pytest.skip("patched by an earlier test in this process")
    with pytest.raises(RuntimeError, match="NVIDIA driver"):
        make_pools()


@pytest.mark.usefixtures("restore_targets")
def test_host_pool_round_trip_through_the_direct_layer_first_path() -> None:
    compat.apply()
    device, host = make_pools()
    assert host.pin_memory is False
    src = torch.tensor([3, 9, 4, 20, 63])
    dst = torch.tensor([30, 1, 40, 50, 7])
    slots = host.alloc(len(src))
    host.backup_from_device_all_layer(device, slots, src, "direct")
    for layer in range(LAYERS):
        host.load_to_device_per_layer(device, slots, dst, layer, "direct")
    for buf in (*device.k_buffer, *device.v_buffer):
        assert torch.equal(buf[dst], buf[src])


@pytest.mark.usefixtures("restore_targets")
@pytest.mark.parametrize("page_size", [1, 4])
def test_host_pool_round_trip_through_the_page_first_direct_path(page_size: int) -> None:
    """The layout sglang gives a mooncake L3: device pages backed up to the host pool (every layer
    at once) and loaded back layer by layer into other device pages, bit for bit; the host pool's
    pages hold them page-first (what the store reads and writes as one object per page)."""
    compat.apply()
    device, host = make_pools("page_first_direct", page_size)
    assert host.layout == "page_first_direct" and host.pin_memory is False
    src = page_rows([2, 9, 4], page_size)
    dst = page_rows([10, 1, 7], page_size)
    slots = host.alloc(len(src))
    host.backup_from_device_all_layer(device, slots, src, "direct")
    for layer in range(LAYERS):
        for c, buf in enumerate((device.k_buffer[layer], device.v_buffer[layer])):
            pages = host.kv_buffer[c][slots[::page_size] // page_size, layer]
            assert torch.equal(pages.reshape(-1, HEADS, HEAD_DIM), buf[src])
        host.load_to_device_per_layer(device, slots, dst, layer, "direct")
    for buf in (*device.k_buffer, *device.v_buffer):
        assert torch.equal(buf[dst], buf[src])


# --- transfer_kv_direct equals the per-row reference -----------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
@pytest.mark.parametrize(
    ("n", "page_size"), [(0, 1), (1, 1), (7, 1), (40, 1), (8, 4), (16, 16)], ids=lambda v: str(v)
)
def test_transfer_equals_reference(dtype: torch.dtype, n: int, page_size: int) -> None:
    gen = torch.Generator().manual_seed(n)
    src = layers(48, dtype, seed=1)
    dst = [torch.zeros(64, HEADS, HEAD_DIM, dtype=dtype) for _ in src]
    expected = [t.clone() for t in dst]
    src_idx = torch.randperm(48, generator=gen)[:n]
    dst_idx = torch.randperm(64, generator=gen)[:n]
    ref_transfer(src, expected, src_idx, dst_idx)
    transfer_kv_direct(src, dst, src_idx, dst_idx, page_size)
    assert all(torch.equal(a, b) for a, b in zip(dst, expected, strict=True))


def page_rows(pages: list[int], page_size: int, shift: int = 0) -> torch.Tensor:
    """The row indices of whole pages (each `page_size` consecutive rows), `shift` rows off alignment."""
    return torch.tensor(
        [p * page_size + shift + r for p in pages for r in range(page_size)], dtype=torch.int64
    )


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("n_pages", [1, 3, 7, compat.MAX_SLICE_RUNS + 1, 33])
@pytest.mark.parametrize("layout", ["consecutive", "scattered", "unaligned", "mixed"])
def test_whole_page_transfer_equals_reference(page_size: int, n_pages: int, layout: str) -> None:
    """HiCache's real index lists (whole pages) through every copy path: runs of consecutive pages
    (slice copies), many scattered aligned pages (page gather), unaligned pages (slices)."""
    gen = torch.Generator().manual_seed(page_size * 100 + n_pages)
    src_pages_total, dst_pages_total = 40, 48
    src = layers(src_pages_total * page_size + page_size, torch.bfloat16, seed=5)
    dst = [
        torch.zeros(dst_pages_total * page_size + page_size, HEADS, HEAD_DIM, dtype=torch.bfloat16)
        for _ in src
    ]
    expected = [t.clone() for t in dst]
    if layout == "consecutive":
        src_pages, dst_pages = list(range(2, 2 + n_pages)), list(range(5, 5 + n_pages))
    elif layout == "mixed":  # two runs of consecutive pages, then scattered ones
        half = n_pages // 2
        rest = torch.randperm(dst_pages_total - 20, generator=gen)[: n_pages - half] + 20
        src_pages = list(range(n_pages))
        dst_pages = [*range(3, 3 + half), *rest.tolist()]
    else:
        src_pages = torch.randperm(src_pages_total, generator=gen)[:n_pages].tolist()
        dst_pages = torch.randperm(dst_pages_total, generator=gen)[:n_pages].tolist()
    shift = page_size // 2 if layout == "unaligned" else 0
    src_idx, dst_idx = page_rows(src_pages, page_size, shift), page_rows(dst_pages, page_size)
    ref_transfer(src, expected, src_idx, dst_idx)
    transfer_kv_direct(src, dst, src_idx, dst_idx, page_size)
    assert all(torch.equal(a, b) for a, b in zip(dst, expected, strict=True))


def test_transfer_with_large_head_dim_and_int32_indices() -> None:
    src = layers(5, torch.bfloat16, seed=2, heads=1, head_dim=576)
    dst = [torch.zeros_like(t) for t in src]
    expected = [t.clone() for t in dst]
    src_idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    dst_idx = torch.tensor([1, 3, 0], dtype=torch.int32)
    ref_transfer(src, expected, src_idx, dst_idx)
    transfer_kv_direct(src, dst, src_idx, dst_idx, 1)
    assert all(torch.equal(a, b) for a, b in zip(dst, expected, strict=True))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("layers", "source layers"),
        ("indices", "source indices"),
        ("pages", "whole pages"),
        ("page_size", "whole pages"),
        ("rows", "rows"),
        ("dtype", "rows"),
    ],
)
def test_transfer_refuses_what_it_does_not_implement(case: str, message: str) -> None:
    src, dst = layers(8, torch.bfloat16, 3), layers(8, torch.bfloat16, 4)
    idx, page_size = torch.arange(4), 1
    if case == "layers":
        dst = dst[:-1]
    elif case == "indices":
        idx = torch.arange(3)
    elif case == "pages":
        page_size = 3
    elif case == "page_size":
        page_size = 0
    elif case == "rows":
        dst = layers(8, torch.bfloat16, 4, head_dim=HEAD_DIM * 2)
    else:
        dst = [t.float() for t in dst]
    before = [t.clone() for t in dst]
    with pytest.raises(ValueError, match=message):
        transfer_kv_direct(src, dst, torch.arange(4), idx, page_size)
    assert all(torch.equal(a, b) for a, b in zip(dst, before, strict=True))


# --- activation --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "enabled"),
    [
        ({}, False),
        ({compat.ENV_VAR: "1"}, True),
        ({compat.ENV_VAR: "0"}, False),
        ({compat.ENV_VAR: ""}, False),
        ({compat.ENV_VAR: "true"}, True),
        ({compat.ENV_VAR_SGLANG_TWIN: "1"}, True),
        ({compat.ENV_VAR: "0", compat.ENV_VAR_SGLANG_TWIN: "1"}, False),
    ],
)
def test_enabled_by_env(environ: dict[str, str], enabled: bool) -> None:
    assert compat.enabled_by_env(environ) is enabled


def test_a_garbled_env_value_is_an_error() -> None:
    with pytest.raises(ValueError, match=compat.ENV_VAR):
        compat.enabled_by_env({compat.ENV_VAR: "maybe"})


@pytest.mark.usefixtures("restore_targets")
@pytest.mark.parametrize("value", ["1", None])
def test_plugin_applies_only_when_asked(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    from sgl_hicache_cpu.plugin import register

    for name in (compat.ENV_VAR, compat.ENV_VAR_SGLANG_TWIN):
        monkeypatch.delenv(name, raising=False)
    if value is not None:
        monkeypatch.setenv(compat.ENV_VAR, value)
    register()
    assert compat.is_applied() is (value is not None)


ACTIVATION_PROBE = """
import sglang.srt.environ  # copies SGL_* variables to SGLANG_* with a warning
from sglang.srt.plugins import load_plugins
load_plugins()
from sgl_hicache_cpu.hicache_cpu_compat import is_applied
print("applied", is_applied())
"""


def test_sglang_plugin_loading_applies_the_patches_from_the_env_var() -> None:
    """The path sglang's own processes take: the entry point, after sglang's SGL_ → SGLANG_ rewrite."""
    env = {**os.environ, compat.ENV_VAR: "1", "SGLANG_PLUGINS": "sgl_hicache_cpu"}
    env.pop(compat.ENV_VAR_SGLANG_TWIN, None)
    out = subprocess.run(
        [sys.executable, "-c", ACTIVATION_PROBE], env=env, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "applied True" in out.stdout
