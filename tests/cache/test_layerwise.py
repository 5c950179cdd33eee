"""Layer-wise restore on a real sglang pool (CPU): a resumed request is admitted once the first
layer group of its restore landed, the forward's layer l reads its KV only after group(l) was
verified and unpacked (through the KV pool's own per-layer wait, as sglang's attention calls it),
and a late group that fails ends with the requests that read it retracted and the nodes dropped.

The tier is slowed by a FaultyTier that reveals verified bytes at a steady pace over `LATENCY_S`
(a slow disk), so at admission only the first of the two layer groups (one layer each: the test
pool has two layers) has landed.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.cache.conftest import LAYERS, expected_kv, read_kv

B = list(range(300, 500))
CHUNK = 4096
RID = "resume-1"
LATENCY_S = 3.0


def spilled(make_stack: Any, **fault: Any) -> Any:
    """B spilled to one extent (two layer groups of eight 4 KiB chunks in all), read slowly."""
    from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier

    s = make_stack(size=512, chunk_bytes=CHUNK, layerwise_restore=True)
    assert s.cache.controller.layout.count == 2
    s.insert(B)
    s.evict_all()
    s.cache.controller.tier = FaultyTier(s.cache.controller.tier, FaultSpec(latency_s=LATENCY_S, **fault))
    return s


def admit(s: Any) -> tuple[Any, Any, Any]:
    """The scheduler's admission retries until the cache answers; then sglang locks the request's
    prefix (`_commit_prefill_admission`). Returns (answer, request, match)."""
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    m = s.match(B)
    req = SimpleNamespace(last_node=m.last_device_node, rid=RID)
    params = InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req)
    deadline = time.monotonic() + 30
    while (answer := s.cache.init_load_back(params)) is None:
        assert m.best_match_node.evicted, "a node became resident before its first group landed"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    req.last_node = answer[1]
    s.cache.inc_lock_ref(req.last_node)
    return answer, req, m


def forward(s: Any, slots: torch.Tensor) -> list[list[int] | None]:
    """What attention reads: layer by layer, through the KV pool's own wait (`get_key_buffer`),
    the ids whose markers the restored slots hold in that layer (None: not a marker at all)."""
    seen: list[list[int] | None] = []
    for layer in range(LAYERS):
        s.pool.get_key_buffer(layer)  # sglang's per-layer wait (register_layer_transfer_counter)
        s.pool.get_value_buffer(layer)
        try:
            seen.append(read_kv(s.pool, slots, range(layer, layer + 1)))
        except AssertionError:
            seen.append(None)
    return seen


def take_completions(s: Any) -> None:
    """The scheduler's next polls, until the tier's completions of every read are taken. A
    layer-wise restore settles inside the forward on the bytes the tier shows landed, which may be a
    moment before the poll that takes the read's completion (the slow disk shows its last byte at
    the instant it releases the completion; a real tier shows it before its I/O thread posts the
    completion), and its `restore_read_seconds` is counted when that completion is taken
    (`ExtentReads.count_read_span`). Every byte landed, so the completion is due now: the bound is
    the tier's I/O timeout, the product's own limit on a read."""
    ctl = s.cache.controller
    deadline = time.monotonic() + ctl.timeout_s
    s.cache.poll()
    while ctl.reads.in_flight:
        assert time.monotonic() < deadline, "every byte of a read landed, but not its completion"
        time.sleep(0.005)
        s.cache.poll()


def test_the_prefill_starts_before_the_last_group_landed_and_reads_every_layer_restored(
    make_stack: Any,
) -> None:
    s = spilled(make_stack)
    t0 = time.monotonic()
    (loaded, node), req, _ = admit(s)
    assert loaded == len(B) and not node.evicted
    lw = s.cache.layerwise
    assert len(lw.active) == 1, "restored whole: every group landed before the admission"
    (restore,) = lw.active
    assert restore.overlapped, "admitted after every group landed: nothing overlapped"
    assert not restore.done(1), "the last group was unpacked before the forward reached it"
    slots = s.cache.path_device_indices(node)
    assert forward(s, slots) == [expected_kv(B)] * LAYERS
    assert s.cache.after_forward([req]) == []
    totals = s.metrics.totals
    assert (totals["layerwise_restores"], totals["layerwise_overlapped_restores"]) == (1, 1)
    assert (totals["restored_tokens"], totals["layerwise_failed_restores"]) == (len(B), 0)
    # its read took LATENCY_S (the slow disk's pace), counted as a whole restore's read is, once the
    # scheduler's next poll takes the read's completion
    take_completions(s)
    assert LATENCY_S / 2 <= totals["restore_read_seconds"] <= time.monotonic() - t0
    assert not lw.active and node.lock_ref == 1, "the table's lock went; the request's stays"
    s.cache.dec_lock_ref(node)
    assert read_kv(s.pool, slots) == expected_kv(B)
    s.cache.check_integrity()


def test_a_long_forward_that_settles_a_restore_does_not_count_as_its_read_time(make_stack: Any) -> None:
    """`restore_read_seconds` of a layer-wise restore ends when its reads did: a forward that
    reaches the last group long after they finished (a long prefill: nobody took the completions
    meanwhile) settles the restore there, and that time is not read time."""
    s = spilled(make_stack)
    (loaded, node), req, _ = admit(s)
    assert loaded == len(B)
    slots = s.cache.path_device_indices(node)
    time.sleep(LATENCY_S + 1.0)  # the forward's other work; the reads finish meanwhile
    assert forward(s, slots) == [expected_kv(B)] * LAYERS
    assert s.cache.after_forward([req]) == []
    s.cache.controller.poll()  # the scheduler's next poll takes the completions
    read = s.metrics.totals["restore_read_seconds"]
    assert LATENCY_S / 2 <= read <= LATENCY_S + 0.75, f"read time {read:.2f} s includes the forward's"
    s.cache.dec_lock_ref(node)
    s.cache.check_integrity()


def test_without_the_flag_the_request_waits_for_every_group(make_stack: Any) -> None:
    from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier

    s = make_stack(size=512, chunk_bytes=CHUNK)
    s.insert(B)
    s.evict_all()
    s.cache.controller.tier = FaultyTier(s.cache.controller.tier, FaultSpec(latency_s=1.0))
    assert s.cache.layerwise is None and s.pool.layer_transfer_counter is None
    (loaded, node), _, _ = admit(s)
    assert loaded == len(B) and read_kv(s.pool, s.cache.path_device_indices(node)) == expected_kv(B)


@pytest.mark.parametrize("status", ["corrupt", "miss", "io_error"])
def test_a_late_group_that_fails_retracts_the_request_and_drops_its_nodes(
    make_stack: Any, status: str
) -> None:
    s = spilled(make_stack, late_fault_rate=1.0, late_fault_share=0.5, late_fault_status=status)
    free_before = s.allocator.available_size()
    (loaded, node), req, _ = admit(s)
    assert loaded == len(B)
    seen = forward(s, s.cache.path_device_indices(node))
    assert seen[0] == expected_kv(B), "group 0 landed and verified: restored"
    assert seen[1] != expected_kv(B), "group 1 failed: its slots hold no restored KV"
    assert s.cache.after_forward([req, SimpleNamespace(last_node=s.cache.root_node)]) == [req]
    s.cache.dec_lock_ref(req.last_node)  # sglang's retraction releases the request's lock
    s.cache.drop_failed_layerwise()
    m = s.match(B)
    assert (m.device_prefix_len, m.host_hit_length) == (0, 0), (
        "the failed nodes are gone, nothing half-restored"
    )
    assert s.allocator.available_size() == free_before
    totals = s.metrics.totals
    assert (totals["layerwise_failed_restores"], totals["layerwise_retracted_requests"]) == (1, 1)
    assert totals["restored_tokens"] == 0
    s.cache.check_integrity()


def test_a_late_group_that_never_comes_fails_at_the_timeout(make_stack: Any) -> None:
    s = spilled(make_stack, late_fault_rate=1.0, late_fault_share=0.5, late_fault_status="stall")
    s.cache.layerwise.timeout_s = 1.5  # the I/O timeout (10 s at least) in a test's time
    (_, node), req, _ = admit(s)
    t0 = time.monotonic()
    seen = forward(s, s.cache.path_device_indices(node))
    assert time.monotonic() - t0 < 10, "the forward waited past the restore's deadline"
    assert seen[0] == expected_kv(B) and seen[1] != expected_kv(B)
    assert s.cache.after_forward([req]) == [req]
    assert s.metrics.totals["restores_too_late"] == 1
    s.cache.dec_lock_ref(req.last_node)
    s.cache.drop_failed_layerwise()
    assert s.match(B).device_prefix_len == 0
    s.cache.check_integrity()


def test_a_failed_chain_still_held_is_never_matched_and_goes_once_free(make_stack: Any) -> None:
    s = spilled(make_stack, late_fault_rate=1.0, late_fault_share=0.5)
    (_, node), req, _ = admit(s)
    forward(s, s.cache.path_device_indices(node))
    assert s.cache.after_forward([]) == []  # the request was not in this forward's batch
    s.cache.drop_failed_layerwise()  # its lock still held: kept, never matched
    assert s.match(B).device_prefix_len == 0 and not node.evicted
    s.cache.dec_lock_ref(req.last_node)
    s.cache.drop_failed_layerwise()
    assert s.match(B).device_prefix_len == 0 and s.cache.tree.attached(node) is False
    s.cache.check_integrity()


def test_a_load_reports_its_layer_groups_verified_in_group_order(make_stack: Any) -> None:
    """Stage B: what the controller sees of a grouped load in flight is, per group, a verified
    prefix, and group 1 starts only once group 0 is whole (the tier lands them in order)."""
    s = spilled(make_stack)
    ctl = s.cache.controller
    (node,) = [n for n in s.match(B).best_match_node.parent.children.values() if n.evicted]
    ref = node.spill
    ctl.prefetch([ref])
    seen = []
    deadline = time.monotonic() + 30
    while not seen or seen[-1] != (len(B), len(B)):
        s.cache.poll()
        landing = ctl.reads.landed(ref.extent)
        if landing is not None:
            seen.append(landing.groups)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert all(g1 == 0 or g0 == len(B) for g0, g1 in seen), "group 1 landed before group 0 was whole"
    assert seen == sorted(seen) and any(g0 == len(B) and g1 < len(B) for g0, g1 in seen)


C = list(range(700, 900))


def test_two_resumed_requests_in_one_forward_only_the_failed_ones_reader_is_retracted(
    make_stack: Any,
) -> None:
    """Two layer-wise restores in progress in one forward (one batch); B's second group fails:
    only B's request is retracted and its nodes dropped, C's request reads every layer restored."""
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier

    s = make_stack(size=1024, chunk_bytes=CHUNK, layerwise_restore=True)
    for seq in (B, C):
        s.insert(seq)
    s.evict_all()
    tier = FaultyTier(s.cache.controller.tier, FaultSpec(latency_s=LATENCY_S, late_fault_rate=1.0))
    lates = iter([True, False])  # B's load fails late, C's does not
    tier._draw_late = lambda: next(lates)  # type: ignore[method-assign]
    s.cache.controller.tier = tier
    reqs, params = [], []
    for seq, rid in ((B, "b"), (C, "c")):
        m = s.match(seq)
        s.cache.prefetch(seq, rid=rid)
        req = SimpleNamespace(last_node=m.last_device_node, rid=rid)
        reqs.append(req)
        params.append(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req))
    answers: list[Any] = [None, None]
    deadline = time.monotonic() + 30
    while None in answers:  # one scheduling round admits both, in any order
        for i, p in enumerate(params):
            if answers[i] is None:
                answers[i] = s.cache.init_load_back(p)
        assert time.monotonic() < deadline
        time.sleep(0.005)
    for req, (loaded, node) in zip(reqs, answers, strict=True):
        assert loaded == 200
        req.last_node = node
        s.cache.inc_lock_ref(node)
    assert len(s.cache.layerwise.active) == 2
    slots = [s.cache.path_device_indices(r.last_node) for r in reqs]
    seen = [forward(s, sl) for sl in slots]  # one forward reads both: each layer waits for both
    assert seen[1] == [expected_kv(C)] * LAYERS and seen[0][0] == expected_kv(B)
    assert s.cache.after_forward(reqs) == [reqs[0]]
    s.cache.dec_lock_ref(reqs[0].last_node)
    s.cache.drop_failed_layerwise()
    assert s.match(B).device_prefix_len == 0 and s.match(C).device_prefix_len == len(C)
    s.cache.dec_lock_ref(reqs[1].last_node)
    s.cache.check_integrity()


def test_a_group_failing_on_one_tp_rank_retracts_on_every_rank(tmp_path: Any) -> None:
    """Two TP ranks (threads, a MIN collective between them): rank 1's load fails after its first
    group, rank 0's lands whole. Both admit layer-wise (agreed), both retract the request (agreed),
    and both end with the same tree."""
    import threading

    from sgl_hicache.cache.warm_start import tree_digest
    from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier
    from tests.cache.conftest import build_stack, close_stack
    from tests.cache.test_tp_agreement import ThreadedAgreement

    group = ThreadedAgreement.Group(2)
    stacks = [
        build_stack(tmp_path / f"rank{r}", size=512, chunk_bytes=CHUNK, layerwise_restore=True)
        for r in range(2)
    ]
    results: list[Any] = [None, None]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        s = stacks[r]
        try:
            s.cache.agreement = ThreadedAgreement(group, r)
            s.insert(B)
            s.evict_all()
            spec = FaultSpec(latency_s=LATENCY_S, late_fault_rate=float(r == 1))
            s.cache.controller.tier = FaultyTier(s.cache.controller.tier, spec)
            (loaded, node), req, _ = admit(s)
            forward(s, s.cache.path_device_indices(node))
            retracted = s.cache.after_forward([req])
            s.cache.dec_lock_ref(req.last_node)
            s.cache.drop_failed_layerwise()
            results[r] = (
                loaded,
                retracted == [req],
                s.match(B).device_prefix_len,
                tree_digest(s.cache.root_node),
            )
        except BaseException as e:  # reported below
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    try:
        assert not any(t.is_alive() for t in threads), "a rank hung"
        if errors:
            raise errors[0]
        assert results[0] == results[1] and results[0][:3] == (len(B), True, 0), results
        assert stacks[0].metrics.totals["tp_disagreements"] >= 1
    finally:
        for s in stacks:
            close_stack(s)


def test_a_failed_chain_leaves_the_tree_and_a_request_that_recomputed_it_caches_its_own(
    make_stack: Any,
) -> None:
    """Issue 37 review F4: a failed restore's chain, still held by a request, is out of the tree
    after the forward's post step. Another request that recomputed the same tokens inserts them as
    nodes of its own slots (sglang's checkpoint re-matches its whole key), which then serve every
    layer exactly; the failed chain's slots stay the holder's until it lets go, then are freed."""
    s = spilled(make_stack, late_fault_rate=1.0, late_fault_share=0.5)
    free_before = s.allocator.available_size()
    (_, node), req, _ = admit(s)
    failed = set(s.cache.path_device_indices(node).tolist())
    forward(s, s.cache.path_device_indices(node))
    assert s.cache.after_forward([]) == []  # its request was not in this forward's batch: still held
    s.cache.drop_failed_layerwise()
    s.cache.check_integrity()  # the held chain's slots are owned: neither free nor leaked
    s.insert(B)  # another request computed B itself
    m = s.match(B)
    path = s.cache.path_device_indices(m.last_device_node)
    assert m.device_prefix_len == len(B) and read_kv(s.pool, path) == expected_kv(B)
    assert not failed & set(path.tolist()), "the failed chain's slots were matched"
    assert s.allocator.available_size() == free_before - 2 * len(B), "the held slots were freed"
    s.cache.dec_lock_ref(req.last_node)
    s.cache.drop_failed_layerwise()
    assert s.allocator.available_size() == free_before - len(B)
    assert s.metrics.totals["layerwise_dropped_tokens"] == len(B)
    s.cache.check_integrity()
    s.evict_all()  # only the recomputed B is spilled (the failed chain is no victim)
    assert s.cache.spilled_tokens == len(B)
    s.cache.controller.tier = s.cache.controller.tier._inner  # no more faults: B restores whole
    (loaded, again), req, _ = admit(s)
    assert loaded == len(B) and forward(s, s.cache.path_device_indices(again)) == [expected_kv(B)] * LAYERS
    assert s.cache.after_forward([req]) == []
    s.cache.dec_lock_ref(req.last_node)
    s.cache.check_integrity()


def test_a_failed_node_split_before_the_post_forward_step_is_never_matched(make_stack: Any) -> None:
    """A node of a restore that failed in the forward is split before `after_forward` (an insert
    ending inside it): the head keeps the failed node's slots and must stay unmatched too, and it
    leaves the tree with the chain, with what was inserted below it."""
    s = spilled(make_stack, late_fault_rate=1.0, late_fault_share=0.5)
    (_, node), req, _ = admit(s)
    forward(s, s.cache.path_device_indices(node))
    (restore,) = s.cache.layerwise.ended
    assert restore.failed is not None
    other = B[:100] + list(range(5000, 5020))
    s.insert(other)  # sglang's insert splits the failed node at 100
    assert s.match(B[:100]).device_prefix_len == 0, "the failed node's head was matched"
    assert s.cache.after_forward([req]) == [req]
    s.cache.dec_lock_ref(req.last_node)
    s.cache.drop_failed_layerwise()
    assert s.match(other).device_prefix_len == 0
    s.cache.check_integrity()
