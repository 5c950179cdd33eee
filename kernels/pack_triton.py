"""Triton pack / unpack of all layers in one launch (CUDA and ROCm; CPU under TRITON_INTERPRET=1).

Grid: (items, buffers). An item is one token (token-granular) or one page of `slots` (page-granular:
the page's slots are an aligned run, so each buffer's rows are one contiguous span in the pool and
in the packed page). A program copies its item's rows of one buffer in BLOCK-word steps.

Buffers are addressed as `pool_ptr + offset`, with offsets taken from `KVPoolView.buffer_table`
relative to the lowest-address buffer, instead of loading raw pointers from a table: every offset is
formed as `(... // UNIT) * VEC` words, so the compiler can prove 16-byte alignment and emit 16-byte
vector loads/stores; a pointer loaded from memory has unknown alignment and would copy word by word.
All offsets are int64. No vendor-specific features: plain masked tl.load / tl.store.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .layout import KVPoolView, common_alignment, packed_nbytes, page_bytes
from .plan import CopyPlan

MAX_BLOCK_BYTES = 16384  # per loop step: 4 x 16-byte vectors per thread at 8 warps of 32 lanes
_WORDS = {16: torch.int32, 8: torch.int32, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@triton.jit
def _spans(  # type: ignore[no-untyped-def]  # Triton JIT: parameters are typed at launch
    page_bytes,
    table_ptr,
    n_buffers,
    slots_ptr,
    n_tokens,
    PAGE_SIZE: tl.constexpr,
    TOKENS: tl.constexpr,
    UNIT: tl.constexpr,
    VEC: tl.constexpr,
):
    """(pool word offset, packed word offset, words) of this program's span."""
    item = tl.program_id(0).to(tl.int64)
    buf = tl.program_id(1).to(tl.int64)
    first = item * TOKENS
    slot = tl.load(slots_ptr + first, mask=first < n_tokens, other=0)
    in_table = buf < n_buffers
    buf_off = tl.load(table_ptr + buf * 3, mask=in_table, other=0) // UNIT
    row = tl.load(table_ptr + buf * 3 + 1, mask=in_table, other=0) // UNIT
    block_off = tl.load(table_ptr + buf * 3 + 2, mask=in_table, other=0) // UNIT
    page = first // PAGE_SIZE
    pool_off = (buf_off + slot * row) * VEC
    packed_off = (page * (page_bytes // UNIT) + block_off + (first - page * PAGE_SIZE) * row) * VEC
    n_words = tl.minimum(n_tokens - first, TOKENS) * row * VEC
    return pool_off, packed_off, n_words


@triton.jit
def _copy_words(dst_ptr, src_ptr, n_words, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    lanes = tl.arange(0, BLOCK)
    for step in tl.range(0, tl.cdiv(n_words, BLOCK)):
        offs = step * BLOCK + lanes
        mask = offs < n_words
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


@triton.jit
def _pack_kv_kernel(  # type: ignore[no-untyped-def]
    out_ptr,
    page_bytes,
    pool_ptr,
    table_ptr,
    n_buffers,
    slots_ptr,
    n_tokens,
    PAGE_SIZE: tl.constexpr,
    TOKENS: tl.constexpr,
    UNIT: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pool_off, packed_off, n_words = _spans(
        page_bytes, table_ptr, n_buffers, slots_ptr, n_tokens, PAGE_SIZE, TOKENS, UNIT, VEC
    )
    _copy_words(out_ptr + packed_off, pool_ptr + pool_off, n_words, BLOCK)


@triton.jit
def _unpack_kv_kernel(  # type: ignore[no-untyped-def]
    pool_ptr,
    table_ptr,
    n_buffers,
    packed_ptr,
    page_bytes,
    slots_ptr,
    n_tokens,
    PAGE_SIZE: tl.constexpr,
    TOKENS: tl.constexpr,
    UNIT: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pool_off, packed_off, n_words = _spans(
        page_bytes, table_ptr, n_buffers, slots_ptr, n_tokens, PAGE_SIZE, TOKENS, UNIT, VEC
    )
    _copy_words(pool_ptr + pool_off, packed_ptr + packed_off, n_words, BLOCK)


def pack_kv_triton(view: KVPoolView, slots: torch.Tensor, out: torch.Tensor, plan: CopyPlan) -> None:
    _check_runnable(view)
    args, meta = _launch_args(view, slots, out, plan)
    pool, table, n_buffers, packed, pb = args
    _pack_kv_kernel[meta.pop("grid")](packed, pb, pool, table, n_buffers, slots, plan.n_tokens, **meta)


def unpack_kv_triton(view: KVPoolView, slots: torch.Tensor, packed: torch.Tensor, plan: CopyPlan) -> None:
    _check_runnable(view)
    args, meta = _launch_args(view, slots, packed, plan)
    pool, table, n_buffers, words, pb = args
    _unpack_kv_kernel[meta.pop("grid")](pool, table, n_buffers, words, pb, slots, plan.n_tokens, **meta)


def launch_config(view: KVPoolView, unit: int, page_granular: bool) -> tuple[int, int]:
    """(BLOCK in words, num_warps): BLOCK covers a program's span in 16-byte vectors, capped at
    MAX_BLOCK_BYTES per step; warps so that each lane moves one to four vectors per step."""
    tokens = view.page_size if page_granular else 1
    span = tokens * max(view.row_bytes)
    word = _WORDS[unit].itemsize
    block_bytes = min(triton.next_power_of_2(span), MAX_BLOCK_BYTES)
    num_warps = max(1, min(8, block_bytes // (16 * 32)))
    return max(block_bytes // word, 16), num_warps


def _launch_args(
    view: KVPoolView, slots: torch.Tensor, packed: torch.Tensor, plan: CopyPlan
) -> tuple[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, int], dict[str, Any]]:
    unit = common_alignment((view.alignment(),), [packed.data_ptr()])
    word = _WORDS[unit]
    tokens = view.page_size if plan.page_granular else 1
    block, num_warps = launch_config(view, unit, plan.page_granular)
    pool = view.base_buffer.view(torch.uint8).view(-1).view(word)
    words = packed[: packed_nbytes(view, plan.n_tokens)].view(word)
    grid = (triton.cdiv(plan.n_tokens, tokens), len(view.buffers))
    meta: dict[str, Any] = {
        "grid": grid,
        "PAGE_SIZE": view.page_size,
        "TOKENS": tokens,
        "UNIT": unit,
        "VEC": max(unit // word.itemsize, 1),
        "BLOCK": block,
        "num_warps": num_warps,
    }
    return (pool, view.buffer_table, len(view.buffers), words, page_bytes(view)), meta


def _check_runnable(view: KVPoolView) -> None:
    if view.device.type == "cpu" and not isinstance(_pack_kv_kernel, InterpretedFunction):
        raise RuntimeError(
            "the Triton backend on CPU tensors needs TRITON_INTERPRET=1 set before this module is imported"
        )
