"""`check_integrity` for the spill cache: tree, pool and staging accounting agree, or AssertionError
with the numbers. Call when the scheduler is idle (no request holds slots outside the tree unless
their count is passed as `held_tokens`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sgl_hicache.cache.spill_state import ExtentState

if TYPE_CHECKING:
    from sgl_hicache.cache.spill_radix_cache import SpillRadixCache


def check_cache_integrity(cache: SpillRadixCache, held_tokens: int = 0, with_tier: bool = True) -> None:
    device_tokens, spilled_tokens, slots = 0, 0, []
    stack = [(child, False) for child in cache.root_node.children.values()]
    while stack:
        node, under_spilled = stack.pop()
        if node.evicted:
            ref = node.spill
            assert ref.count == len(node.key), f"spilled node of {len(node.key)} tokens refers to {ref.count}"
            assert ref.extent.state is not ExtentState.WRITING or ref.extent.staged is not None, (
                "writing without staging"
            )
            spilled_tokens += len(node.key)
        else:
            assert not under_spilled, "a device-resident node lies below a spilled one"
            assert len(node.value) == len(node.key), (
                f"node holds {len(node.value)} slots for {len(node.key)} tokens"
            )
            device_tokens += len(node.key)
            slots.append(node.value)
        stack.extend((child, node.evicted) for child in node.children.values())
    partial = cache.partial_restores.held_tokens  # slots of restores still landing: in no node
    _check_slots([*slots, *cache.partial_restores.held_slots()], device_tokens + partial)
    sizes = cache.evictable_size_ + cache.protected_size_
    assert sizes == device_tokens, (
        f"evictable {cache.evictable_size_} + protected {cache.protected_size_} != device {device_tokens}"
    )
    assert cache.spilled_tokens == spilled_tokens, (
        f"spilled counter {cache.spilled_tokens} != tree {spilled_tokens}"
    )
    allocator = cache.token_to_kv_pool_allocator
    free = allocator.available_size()
    assert free + device_tokens + partial + held_tokens == allocator.size, (
        f"free {free} + tree {device_tokens} + partial restores {partial} + held {held_tokens}"
        f" != pool {allocator.size}"
    )
    if cache.spill_io is not None:
        cache.spill_io.check_integrity(with_tier)


def _check_slots(slots: list[torch.Tensor], owned: int) -> None:
    if not slots:
        return
    flat = torch.cat(slots)
    unique = int(torch.unique(flat).numel())
    assert unique == owned, f"{owned - unique} slots are owned by more than one node or restore"
    assert int(flat.min()) > 0, "slot 0 (sglang's padding slot) is owned by a node"
