"""Triton pack / unpack of all layers in one launch (CUDA and ROCm; CPU under TRITON_INTERPRET=1).

Grid: (programs, buffers). A span is one token (token-granular) or one page of `slots`
(page-granular: the page's slots are an aligned run, so each buffer's rows are one contiguous span in
the pool and in the packed page). A program copies GROUP consecutive spans of one buffer, each in
STEPS masked BLOCK-word steps (unrolled up to MAX_UNROLL steps: straight-line code).

Buffers are addressed as `pool_ptr + offset`, with offsets taken from `KVPoolView.buffer_table`
relative to the lowest-address buffer, instead of loading raw pointers from a table: every offset is
formed as `(... // UNIT) * VEC` words, so the compiler can prove 16-byte alignment and emit 16-byte
vector loads/stores; a pointer loaded from memory has unknown alignment and would copy word by word.
All offsets are int64. No vendor-specific features: plain masked tl.load / tl.store.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .layout import KVPoolView, common_alignment, packed_nbytes, page_bytes
from .plan import CopyPlan

MAX_BLOCK_BYTES = 16384  # per step: 4 x 16-byte vectors per lane at 8 warps of 32 lanes
MIN_PROGRAM_BYTES = 16384  # group small spans so a program moves at least this much
MAX_UNROLL: tl.constexpr = tl.constexpr(8)  # steps per span unrolled; more run as a loop
_WORDS = {16: torch.int32, 8: torch.int32, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


class LaunchConfig(NamedTuple):
    block_bytes: int  # bytes per step (a power of two)
    num_warps: int
    group: int  # spans per program


@triton.jit
def _buffer_entry(table_ptr, n_buffers, UNIT: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton JIT
    """(offset from the pool base, row length, block offset in a packed page) of the buffer
    tl.program_id(1), in UNIT-byte units; loaded once per program."""
    row_ptr = table_ptr + tl.program_id(1).to(tl.int64) * 3
    ok = tl.program_id(1) < n_buffers
    buf_off = tl.load(row_ptr, mask=ok, other=0) // UNIT
    row = tl.load(row_ptr + 1, mask=ok, other=0) // UNIT
    block_off = tl.load(row_ptr + 2, mask=ok, other=0) // UNIT
    return buf_off, row, block_off


@triton.jit
def _span(  # type: ignore[no-untyped-def]
    span,
    buf_off,
    row,
    block_off,
    page_units,
    slots_ptr,
    n_tokens,
    PAGE_SIZE: tl.constexpr,
    TOKENS: tl.constexpr,
    VEC: tl.constexpr,
):
    """(pool word offset, packed word offset, words) of one span (TOKENS tokens from token span*TOKENS)."""
    first = span * TOKENS
    slot = tl.load(slots_ptr + first, mask=first < n_tokens, other=0)
    page = first // PAGE_SIZE
    pool_off = (buf_off + slot * row) * VEC
    packed_off = (page * page_units + block_off + (first - page * PAGE_SIZE) * row) * VEC
    n_words = tl.maximum(tl.minimum(n_tokens - first, TOKENS), 0) * row * VEC
    return pool_off, packed_off, n_words


@triton.jit
def _copy_words(dst_ptr, src_ptr, n_words, BLOCK: tl.constexpr, STEPS: tl.constexpr):  # type: ignore[no-untyped-def]
    lanes = tl.arange(0, BLOCK)
    if STEPS <= MAX_UNROLL:
        for step in tl.static_range(STEPS):
            offs = step * BLOCK + lanes
            mask = offs < n_words
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)
    else:
        for step in tl.range(0, STEPS):
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
    GROUP: tl.constexpr,
    UNIT: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK: tl.constexpr,
    STEPS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    buf_off, row, block_off = _buffer_entry(table_ptr, n_buffers, UNIT)
    for g in tl.static_range(GROUP):
        pool_off, packed_off, n_words = _span(
            pid * GROUP + g,
            buf_off,
            row,
            block_off,
            page_bytes // UNIT,
            slots_ptr,
            n_tokens,
            PAGE_SIZE,
            TOKENS,
            VEC,
        )
        _copy_words(out_ptr + packed_off, pool_ptr + pool_off, n_words, BLOCK, STEPS)


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
    GROUP: tl.constexpr,
    UNIT: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK: tl.constexpr,
    STEPS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    buf_off, row, block_off = _buffer_entry(table_ptr, n_buffers, UNIT)
    for g in tl.static_range(GROUP):
        pool_off, packed_off, n_words = _span(
            pid * GROUP + g,
            buf_off,
            row,
            block_off,
            page_bytes // UNIT,
            slots_ptr,
            n_tokens,
            PAGE_SIZE,
            TOKENS,
            VEC,
        )
        _copy_words(pool_ptr + pool_off, packed_ptr + packed_off, n_words, BLOCK, STEPS)


def pack_kv_triton(
    view: KVPoolView,
    slots: torch.Tensor,
    out: torch.Tensor,
    plan: CopyPlan,
    config: LaunchConfig | None = None,
) -> None:
    _check_runnable(view)
    pool, table, words, grid, meta = _launch_args(view, out, plan, config)
    _pack_kv_kernel[grid](
        words, page_bytes(view), pool, table, len(view.buffers), slots, plan.n_tokens, **meta
    )


def unpack_kv_triton(
    view: KVPoolView,
    slots: torch.Tensor,
    packed: torch.Tensor,
    plan: CopyPlan,
    config: LaunchConfig | None = None,
) -> None:
    _check_runnable(view)
    pool, table, words, grid, meta = _launch_args(view, packed, plan, config)
    _unpack_kv_kernel[grid](
        pool, table, len(view.buffers), words, page_bytes(view), slots, plan.n_tokens, **meta
    )


def launch_config(view: KVPoolView, page_granular: bool, warp_size: int = 32) -> LaunchConfig:
    """Defaults, chosen by reasoning (GPU measurement pending, see docs/KERNELS.md): a step covers
    the span in 16-byte vectors up to MAX_BLOCK_BYTES; warps (64-lane wavefronts on ROCm) so each
    lane moves one to four 16-byte vectors per step; spans grouped so a program moves at least
    MIN_PROGRAM_BYTES (a 2 KiB token row alone is too little work to amortize scheduling)."""
    span = (view.page_size if page_granular else 1) * max(view.row_bytes)
    block_bytes = min(triton.next_power_of_2(span), MAX_BLOCK_BYTES)
    num_warps = max(1, min(8, block_bytes // (16 * warp_size)))
    group = min(16, max(1, triton.next_power_of_2(MIN_PROGRAM_BYTES // span)))
    return LaunchConfig(block_bytes, num_warps, group)


def _launch_args(
    view: KVPoolView, packed: torch.Tensor, plan: CopyPlan, config: LaunchConfig | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, int], dict[str, Any]]:
    cfg = config or launch_config(view, plan.page_granular, 64 if torch.version.hip else 32)
    unit = common_alignment((view.alignment(),), [packed.data_ptr()])
    word = _WORDS[unit]
    tokens = view.page_size if plan.page_granular else 1
    block = max(cfg.block_bytes // word.itemsize, 16)
    span_words = tokens * max(view.row_bytes) // word.itemsize
    grid = (triton.cdiv(triton.cdiv(plan.n_tokens, tokens), cfg.group), len(view.buffers))
    meta: dict[str, Any] = {
        "PAGE_SIZE": view.page_size,
        "TOKENS": tokens,
        "GROUP": cfg.group,
        "UNIT": unit,
        "VEC": max(unit // word.itemsize, 1),
        "BLOCK": block,
        "STEPS": triton.cdiv(span_words, block),
        "num_warps": cfg.num_warps,
    }
    pool = view.base_buffer.view(torch.uint8).view(-1).view(word)
    words = packed[: packed_nbytes(view, plan.n_tokens)].view(word)
    return pool, view.buffer_table, words, grid, meta


def _check_runnable(view: KVPoolView) -> None:
    if view.device.type == "cpu" and not isinstance(_pack_kv_kernel, InterpretedFunction):
        raise RuntimeError(
            "the Triton backend on CPU tensors needs TRITON_INTERPRET=1 set before this module is imported"
        )
