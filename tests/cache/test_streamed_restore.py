"""Restores stream through staging: a history whose extents together exceed host staging (each one
fitting) is restored whole, its reads started as room frees, each extent unpacked as it lands and its
staging given back, so no restore needs all of its history in staging at once.

The histories here are chains of 64-token turns (one extent each, 8 KiB of packed KV: 128 B a
token), spilled with the default staging, which is then replaced by one of 20 KiB: two extents fit
in it at once, never a whole history.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from tests.cache.conftest import Stack, expected_kv, read_kv, shrink_staging

TURN = 64
STAGING = 20 << 10  # two 8 KiB reads at a time (blocks are whole 4 KiB pages)


def history(first: int, turns: int) -> list[int]:
    return list(range(first, first + turns * TURN))


def spill_history(s: Stack, tokens: list[int]) -> None:
    """Insert `tokens` turn by turn (one node, so one extent, per turn), then spill them all."""
    for end in range(TURN, len(tokens) + 1, TURN):
        s.insert(tokens[:end])
    s.evict_all()


def slow(s: Stack, latency_s: float = 0.05) -> None:
    from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier

    s.cache.controller.tier = FaultyTier(s.cache.controller.tier, FaultSpec(latency_s=latency_s))


def resident(s: Stack, tokens: list[int]) -> list[int]:
    """The KV ids the device holds for `tokens`' resident prefix (`read_kv` of its slots)."""
    import torch

    m = s.match(tokens)
    chain = s.cache.tree.path_up(m.last_device_node, s.cache.root_node) or []
    return read_kv(s.pool, torch.cat([node.value for node in chain])) if chain else []


def admission(s: Stack, tokens: list[int], rid: str) -> Any:
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    m = s.match(tokens)
    assert m.host_hit_length == len(tokens)
    req = SimpleNamespace(last_node=m.last_device_node, rid=rid)
    return InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req)


def admit_all(s: Stack, attempts: dict[str, Any]) -> dict[str, Any]:
    """The scheduler's rounds: each waiting request's admission retried in turn until answered;
    staging never holds more than it has, and the tree and staging accounts stay exact."""
    answers: dict[str, Any] = {}
    deadline = time.monotonic() + 30
    while len(answers) < len(attempts):
        for rid, params in attempts.items():
            if rid not in answers and (answer := s.cache.init_load_back(params)) is not None:
                answers[rid] = answer
        ctl = s.cache.controller
        assert ctl.staging.used_bytes <= ctl.staging.capacity_bytes
        s.cache.check_integrity(with_tier=False)
        assert time.monotonic() < deadline, "admission deferred for 30 s"
        time.sleep(0.002)
    return answers


def test_a_history_larger_than_staging_is_restored_whole(make_stack: Any) -> None:
    s = make_stack(size=1024)
    tokens = history(100, turns=5)  # 40 KiB of KV, twice the staging
    spill_history(s, tokens)
    shrink_staging(s, STAGING)
    slow(s)
    answers = admit_all(s, {"r": admission(s, tokens, "r")})
    loaded, last = answers["r"]
    assert loaded == len(tokens) and read_kv(s.pool, last.value) == expected_kv(tokens[-TURN:])
    assert resident(s, tokens) == expected_kv(tokens)
    totals = s.metrics.totals
    assert totals["restore_failures"] == 0 and totals["restored_tokens"] == len(tokens)
    assert totals["restores_streamed"] == 1
    assert s.cache.controller.staging.peak_bytes <= STAGING
    s.cache.controller.poll()
    assert s.cache.controller.staging.used_bytes == 0
    s.cache.check_integrity()


def test_two_restores_that_together_exceed_staging_both_complete(make_stack: Any) -> None:
    s = make_stack(size=1024)
    first, second = history(100, turns=3), history(5000, turns=3)
    spill_history(s, first)
    spill_history(s, second)
    shrink_staging(s, STAGING)
    slow(s)
    answers = admit_all(s, {"a": admission(s, first, "a"), "b": admission(s, second, "b")})
    for tokens, rid in ((first, "a"), (second, "b")):
        assert answers[rid][0] == len(tokens)
        assert resident(s, tokens) == expected_kv(tokens)
    totals = s.metrics.totals
    assert totals["restore_failures"] == 0 and totals["restored_tokens"] == len(first) + len(second)
    s.cache.check_integrity()


def test_a_stream_whose_third_extent_is_corrupt_recomputes_and_leaves_no_partial_node(
    make_stack: Any,
) -> None:
    s = make_stack(size=1024)
    tokens = history(100, turns=4)
    spill_history(s, tokens)
    m = s.match(tokens)
    chain = s.cache.tree.path_up(m.best_match_node, m.last_device_node)
    third = chain[2].spill.extent.key.hex()
    (path,) = list(s.tier_dir.rglob(f"{third}*"))
    raw = bytearray(path.read_bytes())
    raw[4096 + 5] ^= 0xFF  # the payload's first chunk
    path.write_bytes(bytes(raw))
    shrink_staging(s, STAGING)
    slow(s)
    free_before = s.allocator.available_size()
    answers = admit_all(s, {"r": admission(s, tokens, "r")})
    assert answers["r"] == (0, m.last_device_node), "recomputed"
    stats = s.cache.controller.restores.stats
    assert stats.tokens >= 2 * TURN, "the first two extents streamed (unpacked, released) before it"
    assert all(node.evicted for node in chain if s.cache.tree.attached(node)), "a partial node is visible"
    assert s.allocator.available_size() == free_before and s.cache.controller.restores.held_tokens == 0
    totals = s.metrics.totals
    assert (totals["corrupt_extents"], totals["restore_failures"], totals["restored_tokens"]) == (1, 1, 0)
    again = s.match(tokens)
    assert again.device_prefix_len == 0 and again.host_hit_length == 2 * TURN, "the lost turn is pruned"
    s.cache.check_integrity()
    answers = admit_all(s, {"r2": admission(s, tokens[: 2 * TURN], "r2")})
    assert answers["r2"][0] == 2 * TURN
    assert resident(s, tokens) == expected_kv(tokens[: 2 * TURN])


def test_prefetches_yield_to_a_restore_waiting_for_room(make_stack: Any) -> None:
    """A restore whose fourth read found no room: a prefetch that would fit in what is left starts
    nothing until the restore has its reads (restores first); then it does."""
    s = make_stack(size=1024)
    tokens, other = history(100, turns=4), list(range(5000, 5016))  # 8 KiB extents; one of 2 KiB
    spill_history(s, tokens)
    s.insert(other)
    s.evict_all()
    shrink_staging(s, 28 << 10)  # three of the history's reads, and 4 KiB
    slow(s, latency_s=0.2)
    params = admission(s, tokens, "r")
    assert s.cache.init_load_back(params) is None
    assert s.metrics.totals["restore_staging_waits"] == 1
    assert s.cache.prefetch(other) == 0 and s.metrics.totals["prefetch_issued"] == 0
    admit_all(s, {"r": params})
    assert s.cache.prefetch(other) == len(other) and s.metrics.totals["prefetch_issued"] == 1
