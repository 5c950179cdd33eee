"""Random multi-client workloads on a small pool: accounting stays exact and every restore is right."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.cache.conftest import expected_kv, read_kv


def turn(stack: Any, conversation: list[int]) -> None:
    """One scheduler-like turn: match, restore the spilled part, 'compute' the rest, insert."""
    match = stack.match(conversation)
    if match.host_hit_length:
        loaded, last = stack.load_back(match)
        if loaded:
            path = stack.cache.path_device_indices(last)
            assert read_kv(stack.pool, path) == expected_kv(conversation[: len(path)]), "restored wrong KV"
    need = len(conversation)
    if stack.allocator.available_size() < need:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        stack.cache.evict(EvictParams(num_tokens=need - stack.allocator.available_size()))
    stack.insert(conversation)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_conversations_keep_integrity(make_stack: Any, seed: int) -> None:
    rng = random.Random(seed)
    stack = make_stack(size=160)
    clients: list[list[int]] = [[] for _ in range(5)]
    for _ in range(60):
        client = rng.randrange(len(clients))
        shared = [1, 2, 3, 4] if rng.random() < 0.5 else []  # a common system prompt for some
        if not clients[client]:
            clients[client] = shared + [rng.randrange(5, 900) for _ in range(rng.randrange(8, 30))]
        clients[client] = clients[client] + [rng.randrange(5, 900) for _ in range(rng.randrange(4, 20))]
        if len(clients[client]) > 120:
            clients[client] = []
            continue
        turn(stack, clients[client])
        if rng.random() < 0.3:
            stack.cache.controller.wait_writes()
        stack.cache.check_integrity()
    stack.cache.controller.wait_writes()
    stack.cache.check_integrity()
    assert stack.metrics.totals["spilled_tokens"] > 0 and stack.metrics.totals["restored_tokens"] > 0
