"""Argument checks shared by every backend, and the choice between page- and token-granular copies.

All checks on slot values (range, duplicates, page alignment) are reduced on the slots' device and
read back with a single host sync, so a GPU call costs one small round trip, not one per check.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .layout import KVPoolView, packed_nbytes, page_bytes


class CopyPlan(NamedTuple):
    n_tokens: int
    page_granular: bool  # every page of `slots` is an aligned run: copy whole pages


def plan_copy(view: KVPoolView, slots: torch.Tensor, packed: torch.Tensor, *, scatter: bool) -> CopyPlan:
    """Validate a pack (scatter=False) or unpack (scatter=True) and choose its granularity.

    Raises ValueError for: slots not a 1-D int64 tensor on the pool's device; `packed` not a 1-D
    contiguous uint8 tensor on that device or shorter than `packed_nbytes(view, len(slots))`;
    a slot outside [0, num_slots); a slot repeated in an unpack (a scatter with duplicates is ambiguous).
    """
    _check_slots(view, slots)
    n = slots.numel()
    _check_packed(view, packed, packed_nbytes(view, n))
    if n == 0:
        return CopyPlan(0, view.page_size == 1)
    lo, hi, dup, aligned = _slot_stats(slots, view.page_size, scatter).tolist()
    if lo < 0 or hi >= view.num_slots:
        raise ValueError(f"slots out of range [0, {view.num_slots}): min {lo}, max {hi}")
    if dup:
        raise ValueError("unpack_kv got duplicate slots: a scatter with duplicates is ambiguous")
    return CopyPlan(n, bool(aligned))


def trusted_plan(view: KVPoolView, slots: torch.Tensor, packed: torch.Tensor) -> CopyPlan:
    """The plan for slots handed out by sglang's allocator: in range, no duplicates, and whole
    aligned pages when page_size > 1 (its paged allocator allocates nothing else). Only the checks
    that need no slot values run (dtype, device, buffer size), so nothing syncs with the host.
    Wrong slots here copy wrong KV: callers pass only slots a tree node or an allocation owns."""
    _check_slots(view, slots)
    n = slots.numel()
    _check_packed(view, packed, packed_nbytes(view, n))
    return CopyPlan(n, True)


def zero_padding(view: KVPoolView, n_tokens: int, out: torch.Tensor) -> None:
    """Zero the last page of `out` when it is partial, so packed bytes depend only on the KV."""
    if n_tokens % view.page_size:
        full = n_tokens // view.page_size * page_bytes(view)
        out[full : full + page_bytes(view)].zero_()


def _check_slots(view: KVPoolView, slots: torch.Tensor) -> None:
    if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 or slots.dim() != 1:
        raise ValueError("slots must be a 1-D torch.int64 tensor")
    if slots.device != view.device:
        raise ValueError(f"slots are on {slots.device}, the pool on {view.device}")


def _check_packed(view: KVPoolView, packed: torch.Tensor, nbytes: int) -> None:
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError("the packed buffer must be a 1-D torch.uint8 tensor")
    if not packed.is_contiguous() or packed.device != view.device:
        raise ValueError(f"the packed buffer must be contiguous and on {view.device}")
    if packed.numel() < nbytes:
        raise ValueError(f"the packed buffer holds {packed.numel()} bytes, {nbytes} needed")


def _slot_stats(slots: torch.Tensor, page_size: int, scatter: bool) -> torch.Tensor:
    """[min, max, has_duplicates, page_aligned] as one int64 tensor on the slots' device."""
    dup = torch.zeros((), dtype=torch.bool, device=slots.device)
    if scatter and slots.numel() > 1:
        s = slots.sort().values
        dup = (s[1:] == s[:-1]).any()
    stats = [slots.min(), slots.max(), dup, _page_aligned(slots, page_size)]
    return torch.stack([x.to(torch.int64) for x in stats])


def _page_aligned(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """True when each page of `slots` (a partial last one too) is the run first, first+1, ... with
    `first` a multiple of page_size, i.e. the page maps to the head of one pool page."""
    if page_size == 1:
        return torch.ones((), dtype=torch.bool, device=slots.device)
    pos = torch.arange(slots.numel(), device=slots.device) % page_size
    first = slots[torch.arange(slots.numel(), device=slots.device) - pos]
    return ((first % page_size == 0) & (slots == first + pos)).all()
