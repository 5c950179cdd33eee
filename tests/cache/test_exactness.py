"""Regression tests for wrong KV (issue 11): each scenario served another range's KV on 435c209.

Every restore below is judged by the lossless markers of conftest.py: a slot read back must hold the
marker of exactly the token it stands for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tests.cache.conftest import expected_kv, read_kv

A = list(range(100, 140))  # 40 tokens
B = list(range(300, 320))  # 20 tokens


def restore(s: Any, tokens: list[int]) -> tuple[int, list[int]]:
    """Match `tokens`, restore its spilled part; (tokens loaded back, ids now on the device path)."""
    m = s.match(tokens)
    loaded, last = s.load_back(m)
    path = s.cache.path_device_indices(last) if last is not None else []
    return loaded, read_kv(s.pool, path) if len(path) else []


def test_a_respilled_tail_restores_its_own_kv_not_the_heads(make_stack: Any) -> None:
    s = make_stack()
    s.insert(A)
    s.evict_all()  # A: one 40-token extent
    assert restore(s, A[:25] + [7, 7, 7])[0] == 25  # splits A into head (0, 25) and tail (25, 15)
    assert restore(s, A)[0] == 15
    s.evict_all()  # both halves spilled again: the tail must not be taken for the 40-token extent
    loaded, ids = restore(s, A)
    assert loaded == 40 and ids == expected_kv(A)
    s.cache.check_integrity()


def test_a_respilled_part_reuses_its_clean_extent_through_the_exact_reference(make_stack: Any) -> None:
    s = make_stack()
    s.insert(A)
    s.evict_all()
    restore(s, A[:25] + [7, 7, 7])
    restore(s, A)
    stored = s.cache.controller.tier.stats().stores
    s.evict_all()
    assert s.cache.controller.tier.stats().stores == stored, "clean parts must not be written again"
    head = s.cache.root_node.children[A[0]]
    (tail,) = head.children.values()
    assert (head.spill.offset, head.spill.count, tail.spill.offset, tail.spill.count) == (0, 25, 25, 15)
    assert head.spill.extent is tail.spill.extent
    assert restore(s, A) == (40, expected_kv(A))


def test_flush_never_serves_kv_from_before_it(make_stack: Any) -> None:
    s = make_stack()
    s.insert(A)
    s.evict_all()
    s.cache.reset()  # what sglang's flush_cache (and a weight update with flush_cache) calls
    s.allocator.clear()
    assert s.match(A).host_hit_length == 0, "KV computed before a flush was served after it"
    assert s.metrics.totals["flushes"] == 1
    new_kv = [t + 5000 for t in A]  # new weights: the same tokens have other KV now
    s.insert(A, ids=new_kv)  # computed after the flush: spilled and served again, never the old file
    s.evict_all()
    assert restore(s, A) == (40, new_kv)
    s.cache.check_integrity()


def test_a_restart_after_a_flush_attaches_only_what_the_restart_can_trust(make_stack: Any) -> None:
    s = make_stack()
    s.insert(A)
    s.evict_all()
    s.cache.reset()
    s.allocator.clear()
    s.insert(B)  # spilled in the new epoch: not attachable by a restart (weights may have changed)
    s.evict_all()
    s.cache.controller.tier.close()
    again = make_stack(tier_dir=s.tier_dir)
    assert again.match(B).host_hit_length == 0
    assert again.match(A).host_hit_length == 40  # from the first epoch: computed with the weights on disk


def _forge(s: Any, tokens: list[int], payload_tokens: int, parent: bytes | None = None,
           header_tokens: list[int] | None = None) -> None:  # fmt: skip
    """Replace the extent that holds `tokens` (at the root) with a well-formed file of another
    length or other tokens, under the same key: what a foreign writer could leave behind."""
    from sgl_hicache.tier.codec import StoreRequest, prepare
    from sgl_hicache.tier.file.paths import ExtentPaths
    from sgl_hicache.tier.file.store import write_extent

    tier = s.cache.controller.tier
    ns = tier.namespace
    node = s.cache.root_node.children[tokens[0]]
    key = node.spill.extent.key
    paths = ExtentPaths(s.tier_dir, ns.id)
    paths.extent(key).unlink()
    payload = np.zeros(payload_tokens * 2 * 2 * 2 * 8 * 2, dtype=np.uint8)
    # the cache's own parent: only the checked field differs
    parent = parent or s.cache.spilling.node_keys(node)[0]
    req = StoreRequest.of(key, parent, header_tokens or tokens, memoryview(payload))
    cfg = tier._cfg
    # sealed with the directory's secret: only the key check can refuse it
    write_extent(prepare(req, cfg), cfg, ns, paths, False, tier._seal)


def test_a_short_extent_is_a_mismatch_never_kv(make_stack: Any) -> None:
    s = make_stack()
    s.insert(A)
    s.evict_all()
    _forge(s, A, payload_tokens=10)  # same key and tokens, 10 tokens of payload instead of 40
    loaded, _ = restore(s, A)
    assert loaded == 0, "a short load was unpacked as KV"
    assert s.metrics.totals["mismatch_extents"] == 1
    assert s.match(A).host_hit_length == 0
    s.cache.check_integrity()


def test_an_extent_whose_header_names_other_tokens_is_a_mismatch(make_stack: Any) -> None:
    s = make_stack()
    s.insert(A)
    s.evict_all()
    _forge(s, A, payload_tokens=40, header_tokens=B + B)  # right key and size, other tokens
    assert restore(s, A)[0] == 0
    assert s.metrics.totals["mismatch_extents"] == 1
    s.cache.check_integrity()


def test_warm_start_never_attaches_a_forged_extent(make_stack: Any, tmp_path: Path) -> None:
    s = make_stack()
    s.insert(A)
    s.evict_all()
    _forge(s, A, payload_tokens=40, header_tokens=B + B)
    s.cache.controller.tier.close()
    again = make_stack(tier_dir=s.tier_dir)
    assert again.match(A).host_hit_length == 0 and again.match(B + B).host_hit_length == 0


def test_ids_no_extent_key_can_name_are_dropped_never_raised(make_stack: Any) -> None:
    """Multimodal placeholders are 62-bit ids in sglang's radix keys; extent keys hash u32 ids."""
    s = make_stack()
    s.insert([1, 2, 3, 2**40, *A], ids=[1, 2, 3, 4, *A])
    s.evict_all()  # must not raise into sglang's loop
    assert not s.cache.root_node.children and s.metrics.totals["dropped_tokens"] == 44
    assert s.match([1, 2, 3, 2**40, *A]).host_hit_length == 0
    s.cache.check_integrity()


def test_a_weight_update_without_flush_names_new_kv_apart_from_the_weights_on_disk(make_stack: Any) -> None:
    """sglang's weight updater calls our hook after every update, flushed or not: what is spilled
    afterwards is never attached by a restart (which loads the weights on disk again)."""
    from types import SimpleNamespace

    from sgl_hicache.server.hooks import new_epoch_after_weight_update

    s = make_stack()
    s.insert(A)
    s.evict_all()  # spilled with the weights on disk
    new_epoch_after_weight_update(None, SimpleNamespace(scheduler=SimpleNamespace(tree_cache=s.cache)))
    s.insert(B, ids=[t + 5000 for t in B])  # computed with the updated weights, not flushed
    s.evict_all()
    s.cache.controller.tier.close()
    again = make_stack(tier_dir=s.tier_dir)
    assert again.match(A).host_hit_length == 40 and again.match(B).host_hit_length == 0
