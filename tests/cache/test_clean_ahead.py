"""Clean-ahead (issue 25): under write-back on a tier only this server uses, an idle server writes
the next victims of eviction (the coldest evictable nodes that have no copy on the tier, up to
`clean_ahead` of the device pool counting what is already free), as a write-through would, so that
evicting them when a request needs room costs no pack on the scheduler thread. Every restored slot
is checked against its lossless marker."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import torch
from sgl_hicache_kernels import packed_nbytes
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

import sgl_hicache.cache.clean_copies as clean_copies
from tests.cache.conftest import Stack, read_kv

SIZE = 256


def conversations(s: Stack, n: int, length: int = 40) -> list[list[int]]:
    """`n` unrelated prompts inserted one after the other (the first is the coldest)."""
    prompts = [[1000 * (i + 1) + t for t in range(length)] for i in range(n)]
    for p in prompts:
        s.insert(p)
    return prompts


def path_slots(s: Stack, node: Any) -> torch.Tensor:
    """The slots of the path from the root to `node`."""
    values = []
    while node is not s.cache.root_node:
        values.append(node.value)
        node = node.parent
    return torch.cat(values[::-1])


def idle(s: Stack) -> None:
    """sglang's idle hook with no request running or waiting; then the writes it started land."""
    s.cache.poll()
    s.cache.clean_ahead()
    s.cache.controller.wait_writes()
    s.cache.poll()


def test_an_idle_server_writes_its_coldest_victims_and_their_eviction_copies_nothing(make_stack: Any) -> None:
    s = make_stack(size=SIZE, clean_ahead=0.25)
    prompts = conversations(s, 6)  # 240 of 256 slots: 16 free, short of a quarter of the pool (64)
    idle(s)
    written = s.metrics.totals["written_ahead_tokens"]
    assert written == 80, "the two coldest prompts: enough, with what is free, for a quarter of the pool"
    assert s.cache.spilled_tokens == 0, "written ahead, still resident"
    bytes_before = s.metrics.totals["spilled_bytes"]
    s.cache.evict(EvictParams(num_tokens=80))
    assert s.metrics.totals["spilled_bytes"] == bytes_before, "their eviction wrote nothing"
    assert s.cache.spilled_tokens == s.metrics.totals["spilled_tokens"] == 80
    for p in prompts[:2]:
        m = s.match(p)
        assert m.host_hit_length == len(p)
        n, last = s.load_back(m)
        assert n == len(p) and read_kv(s.pool, last.value) == p[-len(last.value) :]
    s.cache.check_integrity()


def test_nothing_is_written_ahead_with_room_free_or_on_a_shared_root(make_stack: Any, tmp_path: Any) -> None:
    roomy = make_stack(size=SIZE, clean_ahead=0.25)
    conversations(roomy, 2)  # 80 of 256: more than a quarter free
    idle(roomy)
    assert roomy.metrics.totals["written_ahead_tokens"] == 0
    a, _b = (make_stack(tmp_path / "shared", size=SIZE) for _ in range(2))
    assert a.cache.controller.tier.shared  # two tiers of this process on one root
    conversations(a, 6)
    idle(a)
    assert a.metrics.totals["written_ahead_tokens"] == 0, "a shared root's eviction stores again anyway"


def test_clean_ahead_zero_turns_it_off(make_stack: Any) -> None:
    s = make_stack(size=SIZE, clean_ahead=0.0)
    conversations(s, 6)
    idle(s)
    assert s.metrics.totals["written_ahead_tokens"] == 0


def test_a_node_written_ahead_then_split_is_written_again_whole_on_eviction(make_stack: Any) -> None:
    """A request that branches inside a written-ahead node splits it: neither half is the extent's
    exact range, so each is stored anew when evicted, and restores exactly."""
    s = make_stack(size=SIZE, clean_ahead=0.25)
    prompts = conversations(s, 5)  # 56 slots free
    idle(s)
    assert s.metrics.totals["written_ahead_tokens"] == 40, "the coldest prompt"
    branch = prompts[0][:20] + [7] * 20
    s.insert(branch)
    s.evict_all()
    for p in (prompts[0], branch):
        m = s.match(p)
        n, last = s.load_back(m, rid=f"r{p[-1]}")
        assert n == m.host_hit_length > 0
        assert read_kv(s.pool, path_slots(s, last)) == p, "the whole path, every layer"
    s.cache.check_integrity()


def test_by_default_an_idle_server_writes_everything_evictable_and_what_comes_after(make_stack: Any) -> None:
    s = make_stack(size=SIZE)
    conversations(s, 2)
    idle(s)
    assert s.metrics.totals["written_ahead_tokens"] == 80
    time.sleep(clean_copies.LOOK_EVERY_S)
    idle(s)
    assert s.metrics.totals["written_ahead_tokens"] == 80, "nothing is written twice"
    s.insert([5] * 30)  # a later turn: the next idle look writes it too
    time.sleep(clean_copies.LOOK_EVERY_S)
    idle(s)
    assert s.metrics.totals["written_ahead_tokens"] == 110
    s.evict_all()
    assert s.metrics.totals["spilled_tokens"] == 110 and s.cache.spilled_tokens == 110
    n, last = s.load_back(s.match([5] * 30))
    assert n == 30 and read_kv(s.pool, last.value) == [5] * 30


def test_a_parent_is_written_after_its_children_as_eviction_would_take_it(make_stack: Any) -> None:
    s = make_stack(size=SIZE)
    prefix = list(range(500, 520))
    branches = [prefix + [600 + i] * 20 for i in range(2)]
    for b in branches:
        s.insert(b)
    idle(s)
    assert s.metrics.totals["written_ahead_tokens"] == 60, "both branches, then the prefix they share"
    s.evict_all()
    assert s.metrics.totals["spilled_bytes"] == packed_nbytes(s.cache.controller.view, 60), (
        "evictions wrote nothing"
    )
    for i, b in enumerate(branches):
        m = s.match(b)
        n, last = s.load_back(m, rid=f"r{i}")
        assert n == m.host_hit_length > 0
        assert read_kv(s.pool, path_slots(s, last)) == b


def test_a_node_too_large_for_the_background_share_is_left_to_its_eviction_and_the_walk_goes_on(
    make_stack: Any,
) -> None:
    s = make_stack(size=SIZE)
    io = s.cache.controller
    io.staging.capacity_bytes = 3 * packed_nbytes(io.view, 48)  # write-ahead may hold 72 tokens at once
    big = [900 + t for t in range(100)]
    s.insert(big)  # the coldest: never fits the share
    conversations(s, 2)
    for _ in range(2):  # the two 40-token prompts do not fit the share together: one look each
        idle(s)
        time.sleep(clean_copies.LOOK_EVERY_S)
    totals = s.metrics.totals
    assert totals["written_ahead_tokens"] == 80
    assert (totals["writes_through_too_large"], totals["writes_through_deferred"]) == (0, 0), (
        "not write-throughs"
    )
    s.evict_all()  # the large one is written now, as under write-back without clean-ahead
    m = s.match(big)
    n, last = s.load_back(m)
    assert n == 100 and read_kv(s.pool, last.value) == big


def test_the_idle_hook_writes_ahead_only_when_no_request_runs_or_waits(make_stack: Any) -> None:
    """sglang calls `on_idle` also while a deferred restore waits for its reads: on the CPU a pack
    is a copy on the scheduler thread, which would delay that request."""
    from sgl_hicache.server.hooks import poll_when_idle

    s = make_stack(size=SIZE)
    conversations(s, 2)
    busy = SimpleNamespace(tree_cache=s.cache, is_fully_idle=lambda: False)
    assert poll_when_idle("result", busy) == "result"
    assert s.metrics.totals["written_ahead_tokens"] == 0
    poll_when_idle(None, SimpleNamespace(tree_cache=s.cache, is_fully_idle=lambda: True))
    assert s.metrics.totals["written_ahead_tokens"] == 80


def test_a_clean_eviction_makes_its_extent_the_tiers_newest(make_stack: Any) -> None:
    """The write an eviction skips would have made the extent the most recently used: the tier's LRU
    must not evict a hot prefix written ahead long ago before KV spilled since."""
    s = make_stack(size=SIZE, clean_ahead=0.25)
    prompts = conversations(s, 6)
    idle(s)  # the two coldest, p0 and p1, are written ahead (published now)
    for p in prompts[:2]:
        s.match(p)  # ... and used again: the hottest now
    s.cache.evict(EvictParams(num_tokens=40))  # p2: written now, published after p0 and p1
    s.cache.controller.wait_writes()
    s.cache.poll()
    s.evict_all()  # p3-p5 written; p0, p1 clean: only pointed at, after p2's write
    key = {p[0]: s.cache.root_node.children[p[0]].spill.extent.key for p in prompts}
    order = [info.key for info in s.cache.controller.tier.extents()]  # least recently used first
    assert order.index(key[prompts[2][0]]) < order.index(key[prompts[0][0]]), (
        "p0 was used after p2 was written"
    )
    assert s.metrics.totals["written_ahead_tokens"] == 80
