"""Bulk pack / unpack of paged KV (the distribution sgl-hicache-kernels, `kernels/` of the repository).

    view = from_sglang_pool(pool)                      # once per pool
    out = torch.empty(packed_nbytes(view, len(slots)), dtype=torch.uint8, device=view.device)
    pack_kv(view, slots, out)                          # gather every layer's KV at `slots`
    unpack_kv(view, slots[:m], out)                    # scatter (a prefix of) it back

The packed layout is page-major, or with `group_layers` layer-grouped: one page-major section per
group of that many layers (see `layout.py` and docs/KERNELS.md); `view.groups(group_layers)` gives
each group's sub-view and byte ranges, so one group unpacks alone. `backend="auto"` runs Triton
on CUDA/ROCm devices and torch on CPU; "triton" / "torch" force one (Triton on CPU tensors needs
TRITON_INTERPRET=1 set before `sgl_hicache_kernels.pack_triton` is first imported).
"""

from __future__ import annotations

from typing import Literal

import torch

from .layout import (
    DEFAULT_LAYER_GROUPS,
    KVKind,
    KVPoolView,
    LayerGroups,
    default_group_layers,
    packed_nbytes,
    page_bytes,
)
from .pack_torch import pack_kv_torch, unpack_kv_torch
from .plan import plan_copy, trusted_plan, zero_padding
from .sglang_pools import from_sglang_pool

Backend = Literal["auto", "torch", "triton"]

__all__ = [
    "DEFAULT_LAYER_GROUPS",
    "Backend",
    "KVKind",
    "KVPoolView",
    "LayerGroups",
    "default_group_layers",
    "from_sglang_pool",
    "pack_kv",
    "packed_nbytes",
    "page_bytes",
    "unpack_kv",
]


def pack_kv(
    view: KVPoolView,
    slots: torch.Tensor,
    out: torch.Tensor,
    *,
    backend: Backend = "auto",
    trusted: bool = False,
    group_layers: int = 0,
) -> None:
    """Gather the KV of every layer at `slots` into `out[:packed_nbytes(view, len(slots))]`.

    `slots` (1-D int64, on the pool's device) gives the packed order; repeated slots are copied
    each time. The padding of a partial last page is zeroed; bytes of `out` past it are untouched.
    Empty `slots` is a no-op. Raises ValueError on bad arguments (see `plan.plan_copy`). On a GPU the
    checks sync once with the host; the copy itself is queued on the current stream, like any kernel.
    `trusted`: the slots come straight from sglang's allocator (in range, whole aligned pages): the
    checks of their values are skipped, so a GPU call never syncs with the host (see `plan.trusted_plan`).
    `group_layers`: write the layer-grouped layout (one section per group; 0: page-major).
    """
    groups = view.groups(group_layers)
    if groups.count > 1:
        for g, sub in enumerate(groups.subviews):
            lo, hi = groups.section(g, len(slots))
            pack_kv(sub, slots, out[lo:hi], backend=backend, trusted=trusted)
        return
    plan = trusted_plan(view, slots, out) if trusted else plan_copy(view, slots, out, scatter=False)
    if plan.n_tokens == 0:
        return
    zero_padding(view, plan.n_tokens, out)
    if _resolve(backend, view) == "triton":
        from .pack_triton import pack_kv_triton

        pack_kv_triton(view, slots, out, plan)
    else:
        pack_kv_torch(view, slots, out, plan)


def unpack_kv(
    view: KVPoolView,
    slots: torch.Tensor,
    packed: torch.Tensor,
    *,
    backend: Backend = "auto",
    trusted: bool = False,
    group_layers: int = 0,
    packed_tokens: int | None = None,
    group: int | None = None,
) -> None:
    """Scatter packed KV back into the pool at `slots`: token i of `slots` takes token i of `packed`.

    `packed` may hold more tokens than `slots` (an extent of which only a prefix is restored): only
    the first `packed_nbytes(view, len(slots))` bytes are read. Raises ValueError on bad arguments
    and on duplicate slots. Empty `slots` is a no-op. `trusted`: as for `pack_kv`.
    `group_layers`: `packed` is layer-grouped, a buffer of `packed_tokens` tokens (default
    `len(slots)`; its sections' places depend on it); `group`: unpack that group's layers only.
    """
    groups = view.groups(group_layers)
    if groups.count > 1 or group is not None:
        total = len(slots) if packed_tokens is None else packed_tokens
        if total < len(slots):
            raise ValueError(f"a packed buffer of {total} tokens cannot restore {len(slots)}")
        for g in range(groups.count) if group is None else (group,):
            lo, hi = groups.section(g, total)
            unpack_kv(groups.subviews[g], slots, packed[lo:hi], backend=backend, trusted=trusted)
        return
    plan = trusted_plan(view, slots, packed) if trusted else plan_copy(view, slots, packed, scatter=True)
    if plan.n_tokens == 0:
        return
    if _resolve(backend, view) == "triton":
        from .pack_triton import unpack_kv_triton

        unpack_kv_triton(view, slots, packed, plan)
    else:
        unpack_kv_torch(view, slots, packed, plan)


def _resolve(backend: Backend, view: KVPoolView) -> Literal["torch", "triton"]:
    if backend == "auto":
        return "triton" if view.device.type == "cuda" else "torch"
    if backend not in ("torch", "triton"):
        raise ValueError(f"unknown backend {backend!r}")
    return backend
