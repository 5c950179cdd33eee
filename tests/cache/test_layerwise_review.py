"""Review of issue 37's layer-wise restore (merged at c91bd7a): defects found, each shown by a test.

Each test names what it shows and fails on main at c91bd7a (see the review report), except where a
test says it closes a gap (it passes, and fails under the mutation it names).
"""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.cache.conftest import LAYERS, expected_kv, read_kv

CHUNK = 4096
LATENCY_S = 3.0


def forward(s: Any, slots: torch.Tensor) -> list[list[int] | None]:
    """Attention's reads, layer by layer, through the KV pool's own wait (as test_layerwise.py)."""
    seen: list[list[int] | None] = []
    for layer in range(LAYERS):
        s.pool.get_key_buffer(layer)
        s.pool.get_value_buffer(layer)
        try:
            seen.append(read_kv(s.pool, slots, range(layer, layer + 1)))
        except AssertionError:
            seen.append(None)
    return seen


def admit(s: Any, tokens: list[int], rid: str) -> tuple[Any, Any]:
    """Retry admission until the cache answers; lock the prefix as sglang does. (answer, request)"""
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    m = s.match(tokens)
    req = SimpleNamespace(last_node=m.last_device_node, rid=rid)
    params = InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req)
    deadline = time.monotonic() + 30
    while (answer := s.cache.init_load_back(params)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    req.last_node = answer[1]
    s.cache.inc_lock_ref(req.last_node)
    return answer, req


P = list(range(1000, 1100))  # a parent node: evicted last, its write still under way
Q = list(range(2000, 2100))  # its child: evicted first, on the tier, read slowly


def test_review_a_write_that_completes_mid_restore_does_not_fail_a_layerwise_restore(
    make_stack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DEFECT (cache loss, spurious retraction): a layer-wise restore whose chain holds a node still
    being written (its bytes in staging, unpacked whole at admission) and a node read from the tier.
    When the write completes while the forward waits for the read's later group, the staging goes
    back and `LayerwiseFlow._read_failed` finds no read for the written extent: the restore fails, its
    request is retracted and recomputes, and the restored nodes are dropped, although every byte
    landed and was verified. Fails on main at c91bd7a (`after_forward` returns the request)."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier

    s = make_stack(size=512, chunk_bytes=CHUNK, layerwise_restore=True)
    ctl = s.cache.controller
    s.insert(P)
    s.insert(P + Q)  # two nodes: P, and Q below it
    s.cache.evict(EvictParams(num_tokens=len(Q)))  # the leaf Q first: written, on the tier
    ctl.wait_writes()
    submit = ctl._submit_packed
    monkeypatch.setattr(ctl, "_submit_packed", lambda: None)  # P's write waits in staging
    s.cache.evict(EvictParams(num_tokens=len(P)))
    tier = FaultyTier(ctl.tier, FaultSpec(latency_s=LATENCY_S))
    ctl.tier = tier
    (loaded, node), req = admit(s, P + Q, "pq")
    assert loaded == len(P + Q)
    (restore,) = s.cache.layerwise.active
    assert len(restore.progress.refs) == 2, "P (in staging) and Q (read) restored together"
    assert not restore.done(1), "Q's second group landed before the forward: nothing to show"
    slots = s.cache.path_device_indices(node)
    s.pool.get_key_buffer(0)  # the forward's layer 0
    # P's write is submitted and completes (fast) while the forward waits for Q's group 1
    tier._spec = dataclasses.replace(tier._spec, latency_s=0.0)
    monkeypatch.setattr(ctl, "_submit_packed", submit)
    seen = forward(s, slots)
    assert s.cache.after_forward([req]) == [], f"a restore whose bytes all landed failed: {restore.failed}"
    assert seen == [expected_kv(P + Q)] * LAYERS
    assert s.metrics.totals["layerwise_failed_restores"] == 0
    s.cache.dec_lock_ref(req.last_node)
    s.cache.check_integrity()


B = list(range(300, 500))


def test_review_two_layerwise_restores_of_one_extent_one_settling_first_does_not_fail_the_other(
    make_stack: Any,
) -> None:
    """DEFECT (cache loss, spurious retraction): two requests admitted layer-wise in one round
    restore two parts of one extent (b its first half, c the rest: the spilled node was split) from
    one read. b's part is whole first; when it settles (a poll between admission and the forward),
    `finish_reads(b.refs)` gives up the extent's read, which c still needs: c fails with "read of
    extent failed", is retracted and its nodes dropped, although the read then completes OK. (The
    read's last groups are held back a moment, so c is still waiting when b settles.) Fails on main
    at c91bd7a."""
    from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier

    s = make_stack(size=1024, chunk_bytes=CHUNK, layerwise_restore=True)
    s.insert(B)
    s.evict_all()
    spec = FaultSpec(latency_s=LATENCY_S, late_fault_rate=1.0, late_fault_share=0.75, late_fault_status="stall",
                     late_stall_s=2.0)  # fmt: skip
    s.cache.controller.tier = FaultyTier(s.cache.controller.tier, spec)
    assert s.cache.prefetch(B, rid="c") == len(B)  # one read of the whole extent
    (loaded_b, _), req_b = admit(s, B[:100] + [7, 8], "b")  # splits the spilled node at 100
    (loaded_c, node_c), req_c = admit(s, B, "c")
    assert (loaded_b, loaded_c) == (100, 100), "b restores B[:100], c the rest"
    lw = s.cache.layerwise
    rb, rc = lw.active
    deadline = time.monotonic() + 30
    while rb in lw.active:  # the scheduler polls (another request's admission, its idle hook)
        s.cache.poll()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert rb.failed is None and not rc.complete, "c was whole when b settled: nothing to show"
    seen = forward(s, s.cache.path_device_indices(node_c))
    assert s.cache.after_forward([req_b, req_c]) == [], f"c's restore failed: {rc.failed}"
    assert rc.failed is None and seen == [expected_kv(B)] * LAYERS
    for req in (req_b, req_c):
        s.cache.dec_lock_ref(req.last_node)
    s.cache.check_integrity()


def test_review_restored_bytes_counts_no_byte_of_a_failed_restore(make_stack: Any) -> None:
    """DEFECT (metric contract): `restored_bytes` is documented (metrics.py, OPERATIONS.md "Write
    amplification") as the verified bytes unpacked "by restores that completed"; since the merge it
    is counted per unpack (`SpillController._unpack`), so a layer-wise restore whose later group
    fails counts its first group's bytes, and the write-amplification ratio is understated. (So
    does an early unpack into a restore that is then dropped, and counting again when it is
    re-opened and unpacked a second time.) Fails on main at c91bd7a (group 0's bytes counted)."""
    from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier

    s = make_stack(size=512, chunk_bytes=CHUNK, layerwise_restore=True)
    s.insert(B)
    s.evict_all()
    spec = FaultSpec(latency_s=LATENCY_S, late_fault_rate=1.0, late_fault_share=0.5)
    s.cache.controller.tier = FaultyTier(s.cache.controller.tier, spec)
    (loaded, node), req = admit(s, B, "r")
    assert loaded == len(B)
    forward(s, s.cache.path_device_indices(node))
    assert s.cache.after_forward([req]) == [req]
    assert s.metrics.totals["restored_tokens"] == 0
    assert s.metrics.totals["restored_bytes"] == 0, "bytes of a restore that failed were counted"
    s.cache.dec_lock_ref(req.last_node)
    s.cache.drop_failed_layerwise()
    s.cache.check_integrity()


def test_review_an_insert_through_a_held_failed_chain_keeps_sglangs_checkpoint_contract(
    make_stack: Any,
) -> None:
    """DEFECT (crash, needs a failed chain still held at hook 13, the state
    `drop_failed_layerwise` keeps for later): another request that computed the same tokens is
    inserted (sglang's `RadixCache.checkpoint`: a chunked request between chunks, or any request's
    release). sglang's insert walks into the poisoned node as an existing match (the request's own
    slots for it are freed as duplicates), then re-matches and asserts `len(new_indices) ==
    len(radix_key)`, but the device walk stops at the poisoned node: AssertionError in the
    scheduler. This test checks that contract directly: after an insert of a key, a match of it
    covers the whole key. Fails on main at c91bd7a."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier
    from tests.cache.conftest import fill_kv

    s = make_stack(size=1024, chunk_bytes=CHUNK, layerwise_restore=True)
    s.insert(B)
    s.evict_all()
    spec = FaultSpec(latency_s=LATENCY_S, late_fault_rate=1.0, late_fault_share=0.5)
    s.cache.controller.tier = FaultyTier(s.cache.controller.tier, spec)
    (_, node), req = admit(s, B, "r")
    forward(s, s.cache.path_device_indices(node))
    assert s.cache.after_forward([]) == []  # its request not in this batch: the chain stays held
    s.cache.drop_failed_layerwise()
    assert not node.evicted and node.lock_ref > 0, "kept while held (test_layerwise.py's case)"
    # another request computed B itself (its match stopped at the poisoned node) and is checkpointed
    slots = s.allocator.alloc(len(B))
    fill_kv(s.pool, slots, B)
    key = RadixKey(array("q", B))
    result = s.cache.insert(InsertParams(key=key, value=slots))
    s.allocator.free(slots[: result.prefix_len])  # sglang frees the duplicates
    m = s.match(B)
    assert m.device_prefix_len == len(B), (
        f"sglang's checkpoint asserts the re-match covers the inserted key: {m.device_prefix_len} of "
        f"{len(B)} (the request's own slots for the rest were freed as duplicates)"
    )
    s.cache.dec_lock_ref(req.last_node)
