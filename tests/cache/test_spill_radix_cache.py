"""Tree logic of SpillRadixCache on a real sglang pool: exact spilled / restored nodes and KV."""

from __future__ import annotations

import logging
from typing import Any

from sgl_hicache_kernels import packed_nbytes

from sgl_hicache.cache.metrics import DropReason
from tests.cache.conftest import expected_kv, read_kv

A = list(range(100, 140))  # 40 tokens
B = list(range(300, 320))  # 20 tokens
C = list(range(500, 540))  # 40 tokens


def test_evicted_nodes_stay_in_the_tree_as_spilled_and_free_their_slots(make_stack: Any) -> None:
    s = make_stack()
    s.insert(A)
    s.insert(B)
    s.evict_all()
    nodes = list(s.cache.root_node.children.values())
    assert sorted(len(n.key) for n in nodes) == [20, 40] and all(n.evicted for n in nodes)
    assert s.cache.spilled_tokens == 60 and s.cache.evictable_size() == 0
    assert s.allocator.available_size() == s.allocator.size
    assert s.metrics.totals["spilled_tokens"] == 60 and s.metrics.totals["dropped_tokens"] == 0
    assert s.cache.controller.tier.stats().extents == 2
    s.cache.check_integrity()


def test_resume_restores_exact_kv_into_new_slots(make_stack: Any) -> None:
    s = make_stack()
    s.insert(A)
    s.evict_all()
    m = s.match(A + [999])
    assert m.device_prefix_len == 0 and m.host_hit_length == 40
    loaded, last = s.load_back(m)
    assert loaded == 40 and last is m.best_match_node and not last.evicted
    assert read_kv(s.pool, last.value) == expected_kv(A)
    assert s.match(A).device_prefix_len == 40
    assert s.metrics.totals["restored_tokens"] == 40
    s.cache.check_integrity()


def test_partial_match_splits_a_spilled_node_and_restores_only_the_prefix(make_stack: Any) -> None:
    s = make_stack()
    s.insert(A)
    s.evict_all()
    m = s.match(A[:25] + [7, 7, 7])
    assert m.host_hit_length == 25
    loaded, last = s.load_back(m)
    assert loaded == 25 and read_kv(s.pool, last.value) == expected_kv(A[:25])
    (rest,) = last.children.values()
    assert rest.evicted and (rest.spill.offset, rest.spill.count) == (25, 15)
    m2 = s.match(A)
    assert (m2.device_prefix_len, m2.host_hit_length) == (25, 15)
    loaded, last = s.load_back(m2)
    assert loaded == 15 and read_kv(s.pool, last.value) == expected_kv(A[25:])
    s.cache.check_integrity()


def test_short_leaves_drop_but_a_short_parent_of_spilled_children_spills(make_stack: Any) -> None:
    s = make_stack()
    s.insert([1, 2] + A)
    s.insert([1, 2] + B)  # shared 2-token parent
    s.insert([5, 6, 7])  # a 3-token leaf: below min_spill_tokens (4)
    s.evict_all()
    assert [5] not in [list(n.key.token_ids[:1]) for n in s.cache.root_node.children.values()]
    (parent,) = s.cache.root_node.children.values()
    assert parent.evicted and len(parent.key) == 2 and len(parent.children) == 2
    assert s.metrics.totals["dropped_tokens"] == s.metrics.drops[DropReason.TOO_SHORT] == 3
    m = s.match([1, 2] + B)
    assert m.host_hit_length == 22 and s.load_back(m)[0] == 22
    s.cache.check_integrity()


def test_insert_over_spilled_nodes_adopts_the_requests_slots(make_stack: Any) -> None:
    s = make_stack()
    s.insert(A)
    s.evict_all()
    slots = s.insert(A + B)  # recomputed A (restore not used): its slots become the tree's
    node = s.cache.root_node.children[A[0]]
    assert not node.evicted and node.value.tolist() == slots[:40].tolist()
    assert s.cache.spilled_tokens == 0
    s.cache.check_integrity()


def test_corrupt_extent_is_a_clean_miss(make_stack: Any) -> None:
    s = make_stack()
    s.insert(A)
    s.evict_all()
    (extent_file,) = [p for p in s.tier_dir.rglob("*") if p.is_file() and p.stat().st_size > 4096]
    data = bytearray(extent_file.read_bytes())
    data[4096 + 100] ^= 0xFF  # inside the payload (header_len is 4096 for a short token list)
    extent_file.write_bytes(bytes(data))
    m = s.match(A)
    before = s.allocator.available_size()
    assert s.load_back(m) == (0, m.last_device_node)
    assert s.allocator.available_size() == before, "slots of an abandoned restore must be freed"
    assert s.metrics.totals["corrupt_extents"] == 1 and s.metrics.totals["restore_failures"] == 1
    assert s.match(A).host_hit_length == 0, "the lost node is pruned"
    s.cache.check_integrity()


def test_a_removed_extent_counts_as_lost_not_corrupt(make_stack: Any) -> None:
    """A missing file (evicted or removed by another process, a store restarted) is a clean miss:
    operators alert on corruption, so it must not be counted as one."""
    s = make_stack()
    s.insert(A)
    s.evict_all()
    for path in [p for p in s.tier_dir.rglob("*") if p.is_file() and p.stat().st_size > 4096]:
        path.unlink()
    m = s.match(A)
    assert s.load_back(m) == (0, m.last_device_node)
    totals = s.metrics.totals
    assert (totals["lost_extents"], totals["corrupt_extents"], totals["restore_failures"]) == (1, 0, 1)
    assert s.match(A).host_hit_length == 0, "the lost node is pruned"
    s.cache.check_integrity()


def test_full_staging_drops_instead_of_waiting(make_stack: Any, caplog: Any) -> None:
    s = make_stack(staging_bytes=1 << 20)
    a, b = (packed_nbytes(s.cache.controller.view, len(x)) for x in (A, B))
    s.cache.controller.staging.capacity_bytes = a + b - 1  # either fits, not both while A is written
    s.insert(A)
    s.insert(B)
    with caplog.at_level(logging.WARNING):
        s.evict_all()  # A (least recent) spills first and holds its staging until its write is polled
    assert [n.key.token_ids[0] for n in s.cache.root_node.children.values()] == [A[0]]
    assert s.metrics.totals["dropped_tokens"] == 20 and s.metrics.totals["spills_refused_staging_full"] == 1
    assert s.metrics.drops[DropReason.STAGING_FULL] == 20
    assert s.metrics.totals["spills_refused_too_large"] == 0 and not caplog.records, "momentary: counted only"
    s.insert(B)
    s.evict_all()  # A's write is done and its staging released: B spills now
    assert s.metrics.totals["spilled_tokens"] == 60
    s.cache.check_integrity()


def test_a_node_larger_than_all_of_staging_is_refused_and_logged_once(make_stack: Any, caplog: Any) -> None:
    s = make_stack(staging_bytes=1 << 20)
    a = packed_nbytes(s.cache.controller.view, len(A))
    s.cache.controller.staging.capacity_bytes = a - 1  # B fits, A never can
    s.insert(A)
    s.insert(B)
    s.insert(C)
    with caplog.at_level(logging.WARNING, logger="sgl_hicache.cache.staging_share"):
        s.evict_all()
    assert [n.key.token_ids[0] for n in s.cache.root_node.children.values()] == [B[0]]
    assert s.metrics.totals["spills_refused_too_large"] == 2 and s.metrics.totals["dropped_tokens"] == 80
    assert s.metrics.drops[DropReason.TOO_LARGE] == 80
    assert s.metrics.totals["spills_refused_staging_full"] == 0
    (record,) = caplog.records
    message = record.getMessage()
    assert all(x in message for x in ("of 40 tokens", f"({a} B of KV)", f"largest block is {a - 1} B"))
    assert f"raise --hicache-spill-staging to at least {-(-a // 2**20)}M" in message
    s.cache.check_integrity()


def test_tenants_never_restore_each_other(make_stack: Any) -> None:
    s = make_stack()
    s.insert(A, salt="alice")
    s.evict_all()
    assert s.match(A, salt="bob").host_hit_length == 0
    assert s.match(A).host_hit_length == 0
    assert s.match(A, salt="alice").host_hit_length == 40
    s.cache.check_integrity()


def test_without_a_tier_eviction_drops_like_sglang(make_stack: Any) -> None:
    s = make_stack(spill=False)
    s.insert(A)
    s.evict_all()
    assert not s.cache.root_node.children and s.metrics.drops[DropReason.NO_TIER] == 40
    s.cache.check_integrity()


def test_warm_start_attaches_the_tiers_extents_as_spilled_nodes(make_stack: Any) -> None:
    s = make_stack()
    s.insert([1, 2] + A)
    s.insert([1, 2] + B)
    s.insert(B, salt="carol")  # salted: re-attached only when a request of that tenant brings the tokens
    s.evict_all()
    s.cache.controller.tier.close()
    again = make_stack(tier_dir=s.tier_dir)
    assert again.cache.spilled_tokens == 2 + 40 + 20
    m = again.match([1, 2] + A)
    assert m.host_hit_length == 42
    loaded, last = again.load_back(m)
    assert loaded == 42 and read_kv(again.pool, last.value) == expected_kv(A)
    assert again.match(B, salt="dave").host_hit_length == 0 and again.match(B).host_hit_length == 0
    m = again.match(B + [7], salt="carol")
    assert m.host_hit_length == 20 and again.cache.spilled_tokens == 62 - 42 + 20
    loaded, last = again.load_back(m)
    assert loaded == 20 and read_kv(again.pool, last.value) == expected_kv(B)
    again.cache.check_integrity()
