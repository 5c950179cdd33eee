"""from_sglang_pool against real sglang 0.5.23 pools built on CPU, and a round trip through them."""

from __future__ import annotations

import os

import pytest
import torch
from sgl_hicache_kernels import KVKind, from_sglang_pool, pack_kv, packed_nbytes, unpack_kv

memory_pool = pytest.importorskip("sglang.srt.mem_cache.memory_pool")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
backends = [
    "torch",
    pytest.param(
        "triton",
        marks=[pytest.mark.interpret, pytest.mark.skipif(not INTERPRET, reason="run by test_interpret.py")],
    ),
]


def mha_pool(dtype: torch.dtype, page_size: int) -> object:
    return memory_pool.MHATokenToKVPool(
        size=3 * page_size + 5, page_size=page_size, dtype=dtype, head_num=2, head_dim=64, layer_num=3,
        device="cpu", enable_memory_saver=False, start_layer=4,
    )  # fmt: skip


def mla_pool(dtype: torch.dtype, page_size: int) -> object:
    return memory_pool.MLATokenToKVPool(
        size=3 * page_size + 5, page_size=page_size, dtype=dtype, kv_lora_rank=512, qk_rope_head_dim=64,
        layer_num=2, device="cpu", enable_memory_saver=False,
    )  # fmt: skip


def fill_random(pool: object, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for buf in from_sglang_pool(pool).buffers:
        raw = buf.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e4m3fnuz]
)  # fnuz: ROCm fp8
def test_mha_view_matches_pool(dtype: torch.dtype) -> None:
    pool = mha_pool(dtype, 16)
    view = from_sglang_pool(pool)
    assert (view.kind, view.page_size, view.dtype, view.heads, view.head_dim) == (
        KVKind.MHA,
        16,
        dtype,
        2,
        64,
    )
    assert view.start_layer == 4 and len(view.layers) == 3 and view.num_slots == 3 * 16 + 5 + 16
    assert all(k is pool.k_buffer[i] and v is pool.v_buffer[i] for i, (k, v) in enumerate(view.layers))
    assert view.token_bytes == 3 * 2 * 2 * 64 * dtype.itemsize


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_mla_view_matches_pool(dtype: torch.dtype) -> None:
    pool = mla_pool(dtype, 1)
    view = from_sglang_pool(pool)
    assert (view.kind, view.heads, view.head_dim, len(view.layers)) == (KVKind.MLA, 1, 576, 2)
    assert all(layer[0] is buf for layer, buf in zip(view.layers, pool.kv_buffer, strict=True))


def test_other_pool_classes_are_rejected() -> None:
    with pytest.raises(TypeError):
        from_sglang_pool(object())


@pytest.mark.parametrize("backend", backends)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("make", [mha_pool, mla_pool], ids=["mha", "mla"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_round_trip_between_real_pools(
    make: object, dtype: torch.dtype, page_size: int, backend: str
) -> None:
    src, dst = make(dtype, page_size), make(dtype, page_size)  # type: ignore[operator]
    fill_random(src, seed=0)
    src_view, dst_view = from_sglang_pool(src), from_sglang_pool(dst)
    slots = (
        torch.arange(page_size, 3 * page_size + 3).flip(0)
        if page_size == 1
        else torch.arange(page_size, 3 * page_size + 3)
    )
    out = torch.empty(packed_nbytes(src_view, slots.numel()), dtype=torch.uint8)
    pack_kv(src_view, slots, out, backend=backend)  # type: ignore[arg-type]
    unpack_kv(dst_view, slots, out, backend=backend)  # type: ignore[arg-type]
    for a, b in zip(src_view.buffers, dst_view.buffers, strict=True):
        assert torch.equal(a.view(torch.uint8)[slots], b.view(torch.uint8)[slots])
    if dtype == torch.float8_e4m3fn:  # the logical values agree too, through sglang's own accessor
        layer = src.start_layer
        assert torch.equal(
            src.get_key_buffer(layer)[slots].view(torch.uint8),
            dst.get_key_buffer(layer)[slots].view(torch.uint8),
        )
