"""Tiny KV pools and slot patterns for the kernel tests (random bytes, so NaN bit patterns occur)."""

from __future__ import annotations

import torch
from sgl_hicache_kernels import KVKind, KVPoolView

FP8 = torch.float8_e4m3fn


def make_view(
    kind: KVKind,
    dtype: torch.dtype,
    heads: int,
    head_dim: int,
    *,
    page_size: int,
    num_slots: int,
    layers: int = 2,
    v_head_dim: int | None = None,
    device: str = "cpu",
    seed: int = 0,
    zeros: bool = False,
) -> KVPoolView:
    """A pool view over fresh buffers filled with random bytes (or zeros); fp8 stored as uint8 as sglang does."""
    gen = torch.Generator().manual_seed(seed)
    store = torch.uint8 if dtype.itemsize == 1 else dtype

    def buf(dim: int) -> torch.Tensor:
        nbytes = (num_slots, heads, dim * dtype.itemsize)
        data = (
            torch.zeros(nbytes, dtype=torch.uint8)
            if zeros
            else torch.randint(0, 256, nbytes, generator=gen, dtype=torch.uint8)
        )
        return data.view(store).to(device)

    per_layer = (head_dim, v_head_dim or head_dim) if kind is KVKind.MHA else (head_dim,)
    return KVPoolView(
        kind=kind,
        layers=tuple(tuple(buf(d) for d in per_layer) for _ in range(layers)),
        page_size=page_size,
        dtype=dtype,
        heads=heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
    )


def fresh_like(view: KVPoolView) -> KVPoolView:
    """A zero-filled pool of the same shape."""
    layers = tuple(tuple(torch.zeros_like(b) for b in layer) for layer in view.layers)
    return KVPoolView(
        view.kind, layers, view.page_size, view.dtype, view.heads, view.head_dim, view.v_head_dim
    )


def make_slots(pattern: str, n: int, view: KVPoolView, seed: int = 1) -> torch.Tensor:
    """n slots: "scattered" (distinct, unsorted), "pages" (aligned runs of shuffled whole pages),
    "runs" (shuffled unaligned runs of consecutive slots), "duplicates" (scattered with repeats)."""
    gen = torch.Generator().manual_seed(seed)
    ps = view.page_size
    if pattern == "pages":
        pages = torch.randperm(view.num_slots // ps, generator=gen)[: -(-n // ps)]
        slots = (pages[:, None] * ps + torch.arange(ps)).flatten()[:n]
    elif pattern == "runs":  # shuffled runs of 40 consecutive slots (not page-aligned)
        chunks = torch.arange(view.num_slots).split(40)
        slots = torch.cat([chunks[i] for i in torch.randperm(len(chunks), generator=gen)])[:n]
    elif pattern == "scattered":
        slots = torch.randperm(view.num_slots, generator=gen)[:n]
    elif pattern == "duplicates":
        slots = torch.randint(0, max(n // 2, 1), (n,), generator=gen)
    else:
        raise ValueError(pattern)
    assert slots.numel() == n
    return slots.to(view.device)


def byte_rows(view: KVPoolView) -> list[torch.Tensor]:
    """Each buffer as uint8 [num_slots, row_bytes], written out here rather than taken from the view."""
    return [b.view(torch.uint8).reshape(b.shape[0], -1) for layer in view.layers for b in layer]
