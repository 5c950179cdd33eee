"""The CPU profile's two `page_first_direct` copies (`sgl_hicache_cpu.page_first_direct`) against a
row-by-row reference, byte for byte: MHA (K and V buffers) and MLA (one buffer), several page sizes,
layer counts and page orders; and every index list or buffer they do not implement refused before
anything is written."""

from __future__ import annotations

import pytest
import torch
from sgl_hicache_cpu.page_first_direct import (
    transfer_kv_all_layer_direct_lf_pf,
    transfer_kv_per_layer_direct_pf_lf,
)

HEADS, HEAD_DIM = 2, 8
HOST_PAGES, DEVICE_PAGES = 12, 10


def ref_pf_to_lf(host: list[torch.Tensor], device: list[torch.Tensor], host_idx: torch.Tensor,
                 device_idx: torch.Tensor, layer_id: int, page_size: int) -> None:  # fmt: skip
    """Row by row: device row d of layer `layer_id + j` = host row h (page h // page_size, offset h % page_size)."""
    layers = len(device) // len(host)
    for c, buf in enumerate(host):
        for j in range(layers):
            for h, d in zip(host_idx.tolist(), device_idx.tolist(), strict=True):
                device[c * layers + j][d] = buf[h // page_size, layer_id + j, h % page_size]


def ref_lf_to_pf(device: list[torch.Tensor], host: list[torch.Tensor], device_idx: torch.Tensor,
                 host_idx: torch.Tensor, page_size: int) -> None:  # fmt: skip
    layers = len(device) // len(host)
    for c, buf in enumerate(host):
        for j in range(layers):
            for d, h in zip(device_idx.tolist(), host_idx.tolist(), strict=True):
                buf[h // page_size, j, h % page_size] = device[c * layers + j][d]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def same_bytes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b, strict=True))


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Every bit pattern of `dtype`, NaNs and denormals included: a copy must move bytes, not values."""
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), generator=gen, dtype=torch.uint8)
    return raw.view(dtype)


def host_buffers(components: int, layers: int, page_size: int, dtype: torch.dtype, seed: int,
                 head_dim: int = HEAD_DIM) -> list[torch.Tensor]:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    shape = (HOST_PAGES, layers, page_size, HEADS, head_dim)
    return [random_bits(shape, dtype, gen) for _ in range(components)]


def device_layers(components: int, layers: int, page_size: int, dtype: torch.dtype, seed: int,
                  head_dim: int = HEAD_DIM) -> list[torch.Tensor]:  # fmt: skip
    """One buffer per component and layer, with sglang's padding page (rows of page 0 unused)."""
    gen = torch.Generator().manual_seed(seed)
    shape = ((DEVICE_PAGES + 1) * page_size, HEADS, head_dim)
    return [random_bits(shape, dtype, gen) for _ in range(components * layers)]


def rows(pages: list[int], page_size: int, shift: int = 0) -> torch.Tensor:
    return torch.tensor(
        [p * page_size + shift + r for p in pages for r in range(page_size)], dtype=torch.int64
    )


def page_lists(n_pages: int, order: str, seed: int) -> tuple[list[int], list[int]]:
    """(host pages, device pages): consecutive on both sides, or drawn at random."""
    if order == "consecutive":
        return list(range(2, 2 + n_pages)), list(range(1, 1 + n_pages))
    gen = torch.Generator().manual_seed(seed)
    host = torch.randperm(HOST_PAGES, generator=gen)[:n_pages].tolist()
    device = (torch.randperm(DEVICE_PAGES, generator=gen)[:n_pages] + 1).tolist()
    return host, device


MLA_MHA = pytest.mark.parametrize("components", [1, 2], ids=["mla", "mha"])
PAGE_SIZES = pytest.mark.parametrize("page_size", [1, 4, 16])
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8], ids=str)
SHAPES = pytest.mark.parametrize(
    ("n_pages", "order"), [(0, "scattered"), (1, "scattered"), (5, "consecutive"), (7, "scattered")]
)


@MLA_MHA
@PAGE_SIZES
@DTYPES
@SHAPES
@pytest.mark.parametrize("layers", [1, 3])
def test_all_layer_backup_equals_reference(components: int, page_size: int, dtype: torch.dtype,
                                           n_pages: int, order: str, layers: int) -> None:  # fmt: skip
    device = device_layers(components, layers, page_size, dtype, seed=1)
    host = host_buffers(components, layers, page_size, dtype, seed=2)
    expected = [t.clone() for t in host]
    host_pages, device_pages = page_lists(n_pages, order, seed=n_pages)
    host_idx, device_idx = rows(host_pages, page_size), rows(device_pages, page_size)
    ref_lf_to_pf(device, expected, device_idx, host_idx, page_size)
    transfer_kv_all_layer_direct_lf_pf(device, host, device_idx, host_idx, page_size)
    assert same_bytes(host, expected)


@MLA_MHA
@PAGE_SIZES
@DTYPES
@SHAPES
@pytest.mark.parametrize(("layers", "layer_id", "per_call"), [(1, 0, 1), (3, 2, 1), (4, 1, 2)])
def test_per_layer_load_equals_reference(components: int, page_size: int, dtype: torch.dtype, n_pages: int,
                                         order: str, layers: int, layer_id: int, per_call: int) -> None:  # fmt: skip
    """`per_call` layers from `layer_id` (sglang passes one; the kernel takes several)."""
    host = host_buffers(components, layers, page_size, dtype, seed=3)
    device = device_layers(components, per_call, page_size, dtype, seed=4)
    expected = [t.clone() for t in device]
    host_pages, device_pages = page_lists(n_pages, order, seed=n_pages + 10)
    host_idx, device_idx = rows(host_pages, page_size), rows(device_pages, page_size)
    ref_pf_to_lf(host, expected, host_idx, device_idx, layer_id, page_size)
    transfer_kv_per_layer_direct_pf_lf(host, device, host_idx, device_idx, layer_id, page_size)
    assert same_bytes(device, expected)


@pytest.mark.parametrize("page_size", [1, 4])
def test_round_trip_with_large_head_dim_int32_indices_and_unaligned_device_pages(page_size: int) -> None:
    """MLA-like rows (576 wide), int32 index lists, device pages that start off a page boundary."""
    device = device_layers(1, 2, page_size, torch.bfloat16, seed=5, head_dim=576)
    host = host_buffers(1, 2, page_size, torch.bfloat16, seed=6, head_dim=576)
    host_idx = rows([7, 0, 3], page_size).to(torch.int32)
    device_idx = rows([1, 5, 2], page_size, shift=page_size // 2).to(torch.int32)
    expected_host = [t.clone() for t in host]
    ref_lf_to_pf(device, expected_host, device_idx, host_idx, page_size)
    transfer_kv_all_layer_direct_lf_pf(device, host, device_idx, host_idx, page_size)
    assert same_bytes(host, expected_host)
    back = [torch.zeros_like(t) for t in device]
    for layer in range(2):
        transfer_kv_per_layer_direct_pf_lf(host, [back[layer]], host_idx, device_idx, layer, page_size)
    assert all(
        torch.equal(bits(b[device_idx]), bits(d[device_idx])) for b, d in zip(back, device, strict=True)
    )


REFUSALS = [
    ("count", "source indices"),
    ("partial page", "whole pages"),
    ("page size 0", "page size 0"),
    ("page size of the buffer", "in pages of"),
    ("unaligned host page", "aligned pages"),
    ("host rows out of order", "aligned pages"),
    ("device rows out of order", "consecutive rows"),
    ("host page out of range", "outside the buffers"),
    ("device row out of range", "outside the buffers"),
    ("three buffers", "page-first buffers"),
    ("odd device layers", "page-first buffers"),
    ("layer out of range", "layers 3..3"),
    ("row shape", "rows"),
    ("dtype", "rows"),
]


def refusal_case(
    case: str,
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor, int, int]:
    """(host, device, host rows, device rows, layer, page size) for a per-layer load, broken as named."""
    ps, layers = 4, 3
    host = host_buffers(2, layers, ps, torch.bfloat16, seed=7)
    device = device_layers(2, 1, ps, torch.bfloat16, seed=8)
    host_idx, device_idx, layer = rows([1, 2], ps), rows([3, 4], ps), 0
    if case == "count":
        device_idx = device_idx[:-ps]
    elif case == "partial page":
        host_idx, device_idx = host_idx[:-1], device_idx[:-1]
    elif case == "page size 0":
        ps = 0
    elif case == "page size of the buffer":
        ps, host_idx, device_idx = 2, rows([2, 3, 4, 5], 2), rows([6, 7, 8, 9], 2)
    elif case == "unaligned host page":
        host_idx = rows([1, 2], ps, shift=1)
    elif case == "host rows out of order":
        host_idx = host_idx.flip(0)
    elif case == "device rows out of order":
        device_idx = torch.cat([device_idx[:ps].flip(0), device_idx[ps:]])
    elif case == "host page out of range":
        host_idx = rows([1, HOST_PAGES], ps)
    elif case == "device row out of range":
        device_idx = rows([3, DEVICE_PAGES + 1], ps)
    elif case == "three buffers":
        host = [*host, host[0]]
        device = [*device, device[0], device[0], device[0], device[0]]
    elif case == "odd device layers":
        device = device[:1]
    elif case == "layer out of range":
        layer = layers
    elif case == "row shape":
        device = device_layers(2, 1, ps, torch.bfloat16, seed=8, head_dim=HEAD_DIM * 2)
    elif case == "dtype":
        device = [t.view(torch.float16) for t in device]
    return host, device, host_idx, device_idx, layer, ps


@pytest.mark.parametrize(("case", "message"), REFUSALS, ids=[c for c, _ in REFUSALS])
@pytest.mark.parametrize("direction", ["load", "backup"])
def test_refuses_what_it_does_not_implement_and_writes_nothing(
    case: str, message: str, direction: str
) -> None:
    host, device, host_idx, device_idx, layer, ps = refusal_case(case)
    if direction == "backup" and case == "layer out of range":
        host = [t[:, :0] for t in host]  # no layer to write into
        message = "layers 0..0"
    before = [t.clone() for t in (*host, *device)]
    with pytest.raises(ValueError, match=message):
        if direction == "load":
            transfer_kv_per_layer_direct_pf_lf(host, device, host_idx, device_idx, layer, ps)
        else:
            transfer_kv_all_layer_direct_lf_pf(device, host, device_idx, host_idx, ps)
    assert same_bytes([*host, *device], before)
