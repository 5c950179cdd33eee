"""Plain-torch pack / unpack: the production path on CPU (and a reference backend on GPU).

One vectorized index op per buffer (two when the last page is partial); no Python loop over tokens.
Bytes are moved as the widest word dtype every row and address allows (complex128 = 16 bytes): the
CPU index kernels pay per element, so wider words are several times faster than uint8. Loads and
stores of any dtype copy bit patterns unchanged (NaN payloads included); the tests check this.
Page-granular plans index whole pages ([pages, page_size * row] views), token-granular ones index rows.

With page_size 1 on CPU, long runs of consecutive slots (sglang's allocator hands a fresh prefill one
run) are copied as plain slices: a slice copy streams at copy bandwidth, an index op pays the per-row
cost of a gather even when the rows happen to be consecutive. Runs shorter than `RUN_BYTES` per buffer
stay in the index op: a smaller slice copy runs on one thread (ATen's grain is 32K elements) and loses
to the two-thread index op. See docs/KERNELS.md for the measurements.
"""

from __future__ import annotations

import torch

from .layout import KVPoolView, common_alignment, page_bytes
from .plan import CopyPlan

_WORDS = {16: torch.complex128, 8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
RUN_BYTES = 1 << 20  # a run is copied as a slice when every buffer's piece of it is at least this big
Run = tuple[
    int, int, int
]  # (start, end) in `slots`, and the first slot: slots[start:end] = first, first+1, ...


def pack_kv_torch(view: KVPoolView, slots: torch.Tensor, out: torch.Tensor, plan: CopyPlan) -> None:
    regions, pools = _operands(view, out, plan.n_tokens)
    if runs := _token_runs(view, slots):
        for region, pool in zip(regions, pools, strict=True):
            _pack_segments(pool, region[:, 0], slots, runs)
        return
    ps, (index, tail, first) = view.page_size, _indices(view, slots, plan)
    for region, pool in zip(regions, pools, strict=True):
        full, last = region[: index.shape[0]], region[index.shape[0] :]
        if plan.page_granular:
            torch.index_select(_pages(pool, ps), 0, index, out=_flat(full))
            if tail.numel():
                last[0, : tail.numel()].copy_(pool[first : first + tail.numel()])
        else:
            torch.ops.aten.index.Tensor_out(pool, [index], out=full)
            if tail.numel():
                torch.index_select(pool, 0, tail, out=last[0, : tail.numel()])


def unpack_kv_torch(view: KVPoolView, slots: torch.Tensor, packed: torch.Tensor, plan: CopyPlan) -> None:
    regions, pools = _operands(view, packed, plan.n_tokens)
    if runs := _token_runs(view, slots):
        for region, pool in zip(regions, pools, strict=True):
            _unpack_segments(pool, region[:, 0], slots, runs)
        return
    ps, (index, tail, first) = view.page_size, _indices(view, slots, plan)
    for region, pool in zip(regions, pools, strict=True):
        full, last = region[: index.shape[0]], region[index.shape[0] :]
        if plan.page_granular:
            _pages(pool, ps).index_copy_(0, index, _flat(full))
            if tail.numel():
                pool[first : first + tail.numel()].copy_(last[0, : tail.numel()])
        else:
            pool.index_put_((index,), full)
            if tail.numel():
                pool.index_copy_(0, tail, last[0, : tail.numel()])


def long_runs(slots: torch.Tensor, min_len: int) -> list[Run]:
    """(start, end, first slot) of each maximal run `slots[start:end] == first, first+1, ...` with at
    least `min_len` (>= 1) slots, in order. Any slots: a repeat or a step down ends a run."""
    n = slots.numel()
    if n < min_len:
        return []
    breaks = torch.nonzero(slots[1:] != slots[:-1] + 1).flatten() + 1
    bounds = torch.cat([breaks.new_zeros(1), breaks, breaks.new_full((1,), n)])
    starts, ends = bounds[:-1], bounds[1:]
    keep = ends - starts >= min_len
    starts, ends = starts[keep], ends[keep]
    return list(zip(starts.tolist(), ends.tolist(), slots[starts].tolist(), strict=True))


def _token_runs(view: KVPoolView, slots: torch.Tensor) -> list[Run]:
    """The runs worth a slice copy (page_size 1 on CPU only: on a GPU this would add a host sync)."""
    if view.page_size != 1 or slots.device.type != "cpu":
        return []
    return long_runs(slots, -(-RUN_BYTES // min(view.row_bytes)))


def _pack_segments(pool: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, runs: list[Run]) -> None:
    """rows[i] <- pool[slots[i]]: runs as slices, the gaps between them as index ops."""
    done = 0
    for start, end, first in runs:
        if done < start:
            torch.ops.aten.index.Tensor_out(pool, [slots[done:start]], out=rows[done:start])
        rows[start:end].copy_(pool[first : first + end - start])
        done = end
    if done < slots.numel():
        torch.ops.aten.index.Tensor_out(pool, [slots[done:]], out=rows[done:])


def _unpack_segments(pool: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, runs: list[Run]) -> None:
    """pool[slots[i]] <- rows[i]: runs as slices, the gaps between them as index ops."""
    done = 0
    for start, end, first in runs:
        if done < start:
            pool.index_put_((slots[done:start],), rows[done:start])
        pool[first : first + end - start].copy_(rows[start:end])
        done = end
    if done < slots.numel():
        pool.index_put_((slots[done:],), rows[done:])


def _indices(view: KVPoolView, slots: torch.Tensor, plan: CopyPlan) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(index of the full pages: pool page ids when page-granular, else slots as [pages, page_size];
    the slots of a partial last page; that page's first slot when page-granular)."""
    ps = view.page_size
    n_full = plan.n_tokens // ps * ps
    tail = slots[n_full:]
    if not plan.page_granular:
        return slots[:n_full].view(-1, ps), tail, 0
    return slots[:n_full:ps] // ps, tail, int(tail[0]) if tail.numel() else 0


def _operands(
    view: KVPoolView, packed: torch.Tensor, n_tokens: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Word views: per buffer, its block in every packed page `[pages, page_size, row_words]`
    (strided by the page) and the pool buffer `[num_slots, row_words]`."""
    rows = view.byte_rows()
    tensors = (*rows, packed)
    unit = common_alignment(
        view.row_bytes, [t.data_ptr() for t in tensors] + [int(t.storage_offset()) for t in tensors]
    )
    word = _WORDS[unit]
    n_pages = -(-n_tokens // view.page_size)
    pages = packed[: n_pages * page_bytes(view)].view(word).view(n_pages, -1)
    regions = [
        pages[:, off // unit : (off + view.page_size * rb) // unit].unflatten(1, (view.page_size, -1))
        for off, rb in zip(view.block_offsets, view.row_bytes, strict=True)
    ]
    return regions, [r.view(word) for r in rows]


def _flat(region: torch.Tensor) -> torch.Tensor:
    """`[pages, page_size, row_words]` as `[pages, page_size * row_words]` (a view, never a copy)."""
    return region.view(region.shape[0], region.shape[1] * region.shape[2])


def _pages(pool: torch.Tensor, page_size: int) -> torch.Tensor:
    """The pool's whole pages as `[pages, page_size * row_words]` (a trailing partial page is left out)."""
    whole = pool.shape[0] // page_size * page_size
    return pool[:whole].view(-1, page_size * pool.shape[1])
