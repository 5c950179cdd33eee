"""sglang's calls into the cache never see an exception of ours (issue 12): each path, made to raise
inside our logic, counts the error, logs it once, serves as sglang's plain radix cache would, and
leaves tree and pool consistent; the cache serves exactly afterwards."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from sgl_hicache.cache.metrics import DropReason
from tests.cache.conftest import expected_kv, read_kv

A = list(range(100, 140))


def boom(*_args: Any, **_kwargs: Any) -> Any:
    raise RuntimeError("injected")


@pytest.fixture
def spilled(make_stack: Any) -> Any:
    """A stack whose tree holds A spilled (on the tier, nothing resident)."""
    s = make_stack()
    s.insert(A)
    s.evict_all()
    return s


def contained_twice(s: Any, caplog: Any, name: str, call: Any, errors: int = 2) -> list[Any]:
    """Run `call` twice under the injected fault: both answered, counted (`errors` in all: twice,
    unless a fallback meets the fault too), logged once."""
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="sgl_hicache.cache.guard"):
        answers = [call(), call()]
    assert s.metrics.totals["internal_errors"] == errors
    logged = [r for r in caplog.records if f"internal error in {name};" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None
    s.cache.check_integrity()
    return answers


def restores_exactly(s: Any) -> None:
    m = s.match(A)
    assert (m.device_prefix_len, m.host_hit_length) == (0, len(A))
    loaded, last = s.load_back(m)
    assert loaded == len(A) and read_kv(s.pool, path_slots(s, last)) == expected_kv(A)
    s.cache.check_integrity()


def path_slots(s: Any, node: Any) -> Any:
    """The slots of every node from the root down to `node`, in token order."""
    values = []
    while node is not s.cache.root_node:
        values.append(node.value)
        node = node.parent
    return torch.cat(values[::-1])


def test_match_prefix_serves_the_resident_match(spilled: Any, caplog: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(spilled.cache.tree, "match_spilled", boom)
    for m in contained_twice(spilled, caplog, "match_prefix", lambda: spilled.match(A)):
        assert (m.device_prefix_len, m.host_hit_length) == (0, 0)
    monkeypatch.undo()
    restores_exactly(spilled)


def test_a_failed_poll_is_skipped(spilled: Any, caplog: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(spilled.cache.controller, "poll", boom)
    for m in contained_twice(spilled, caplog, "poll", lambda: spilled.match(A)):
        assert m.host_hit_length == len(A)  # the match itself went on
    monkeypatch.undo()
    restores_exactly(spilled)


def test_a_node_whose_spill_raises_is_dropped(make_stack: Any, caplog: Any, monkeypatch: Any) -> None:
    s = make_stack()
    s.insert(A)
    s.insert(A[:20] + [7] * 20)  # two leaves: two spills, both raising
    monkeypatch.setattr(s.cache.controller, "store", boom)
    results = contained_twice(
        s, caplog, "evict (a node's spill)", lambda: s.cache.evict(EvictParams(num_tokens=1))
    )
    assert [r.num_tokens_evicted for r in results] == [20, 20]
    assert s.metrics.drops[DropReason.INTERNAL_ERROR] == 40 and s.cache.spilled_tokens == 0
    monkeypatch.undo()
    s.evict_all()  # the shared head (still resident) spills now; the dropped tails are gone
    assert s.match(A).host_hit_length == 20
    s.insert(A)
    s.evict_all()
    restores_exactly(s)


def test_evict_falls_back_to_dropping(make_stack: Any, caplog: Any, monkeypatch: Any) -> None:
    s = make_stack()
    s.insert(A)
    s.insert(A[:20] + [7] * 20)
    free = s.allocator.available_size()
    monkeypatch.setattr(s.cache.controller.restores, "evict", boom)
    results = contained_twice(s, caplog, "evict", lambda: s.cache.evict(EvictParams(num_tokens=1)))
    assert [r.num_tokens_evicted for r in results] == [20, 20]
    assert s.allocator.available_size() == free + 40 and s.cache.spilled_tokens == 0
    monkeypatch.undo()
    assert s.match(A).device_prefix_len == 20  # the tails were dropped, the shared head stays
    s.insert(A)
    s.evict_all()
    restores_exactly(s)


@pytest.mark.parametrize(
    ("target", "name"),
    [
        ("reads.readiness", "init_load_back (readiness)"),
        ("complete", "init_load_back (restore)"),
        ("admission._agreed_readiness", "init_load_back"),
    ],
)
def test_init_load_back_recomputes(
    spilled: Any, caplog: Any, monkeypatch: Any, target: str, name: str
) -> None:
    owner, attr = target.rsplit(".", 1) if "." in target else ("", target)
    obj = {"reads": spilled.cache.controller.reads, "admission": spilled.cache.admission,
           "": spilled.cache.controller}[owner]  # fmt: skip
    free = spilled.allocator.available_size()
    monkeypatch.setattr(obj, attr, boom)
    m = spilled.match(A)
    for answer in contained_twice(spilled, caplog, name, lambda: spilled.load_back(m)):
        assert answer == (0, m.last_device_node)
    assert spilled.allocator.available_size() == free and spilled.cache.controller.restores.held_tokens == 0
    monkeypatch.undo()
    restores_exactly(spilled)


def test_insert_over_spilled_nodes_drops_them(spilled: Any, caplog: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(spilled.cache.tree, "match_spilled", boom)
    contained_twice(spilled, caplog, "insert (adopting spilled nodes)", lambda: spilled.insert(A, ids=A))
    monkeypatch.undo()
    m = spilled.match(A)
    assert (m.device_prefix_len, m.host_hit_length) == (len(A), 0)
    assert read_kv(spilled.pool, path_slots(spilled, m.last_device_node)) == expected_kv(A)
    spilled.evict_all()
    restores_exactly(spilled)


def test_reset_falls_back_to_an_empty_tree_in_a_new_epoch(
    spilled: Any, caplog: Any, monkeypatch: Any
) -> None:
    epochs = [spilled.cache.epoch]

    def reset() -> None:
        spilled.cache.reset()
        epochs.append(spilled.cache.epoch)

    monkeypatch.setattr(spilled.cache.controller.reads, "clear", boom)
    contained_twice(spilled, caplog, "reset", reset)
    assert len(set(epochs)) == 3 and spilled.cache.spilled_tokens == 0
    assert spilled.match(A).host_hit_length == 0  # nothing named before is found
    monkeypatch.undo()
    spilled.insert(A)
    spilled.evict_all()
    restores_exactly(spilled)


def test_a_poll_that_fails_on_one_completion_still_takes_the_others(
    make_stack: Any, caplog: Any, monkeypatch: Any
) -> None:
    """The tier hands each completion over once: a failure on the first must not strand the second
    write in flight (its staging held and its node never restorable) for good."""
    import time

    s = make_stack()
    s.insert(A)
    s.insert(A[:20] + [7] * 20)  # a shared head and two leaves: three writes
    io = s.cache.controller
    monkeypatch.setattr(io, "poll", lambda: None)  # the writes finish unseen ...
    s.cache.evict(EvictParams(num_tokens=10**9))
    writes = io.writes_in_flight
    assert writes >= 2
    deadline = time.monotonic() + 30
    while io.tier.stats().stores < writes:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    monkeypatch.undo()
    finish, calls = io._finish_write, []

    def first_fails(extent: Any, ok: bool) -> None:
        calls.append(extent)
        if len(calls) == 1:
            raise RuntimeError("injected")
        finish(extent, ok)

    monkeypatch.setattr(io, "_finish_write", first_fails)  # ... then the first one's handling raises
    assert s.match(A).device_prefix_len == 0  # answered; the poll's error contained
    assert s.metrics.totals["internal_errors"] == 1
    assert len(calls) == writes and io.writes_in_flight == 0, "writes after the first were lost with it"
    s.cache.check_integrity()


@pytest.mark.parametrize("target", ["engine.pack", "tier.submit_store"])
def test_a_spill_failing_after_taking_staging_gives_it_back(
    make_stack: Any, caplog: Any, monkeypatch: Any, target: str
) -> None:
    s = make_stack()
    s.insert(A)
    s.insert(A[:20] + [7] * 20)
    io = s.cache.controller
    owner, attr = (io.tier, "submit_store") if target.startswith("tier.") else (io.engine, "pack")
    monkeypatch.setattr(owner, attr, boom)
    contained_twice(s, caplog, "evict (a node's spill)", lambda: s.cache.evict(EvictParams(num_tokens=1)))
    assert io.staging.used_bytes == 0, "staging taken by the failed spills was never given back"
    monkeypatch.undo()
    s.insert(A)
    s.evict_all()
    restores_exactly(s)


def test_a_read_failing_to_start_gives_its_staging_back(spilled: Any, caplog: Any, monkeypatch: Any) -> None:
    io = spilled.cache.controller
    monkeypatch.setattr(io.tier, "submit_load", boom)
    m = spilled.match(A)
    for answer in contained_twice(
        spilled, caplog, "init_load_back (readiness)", lambda: spilled.load_back(m)
    ):
        assert answer == (0, m.last_device_node)
    assert io.staging.used_bytes == 0, "staging taken by the failed reads was never given back"
    monkeypatch.undo()
    restores_exactly(spilled)


@pytest.mark.parametrize("failing", [0, 1])
def test_a_restore_failing_while_marking_its_nodes_frees_the_slots_no_node_owns(
    make_stack: Any, caplog: Any, monkeypatch: Any, failing: int
) -> None:
    """The verdict is in (every byte verified and unpacked) when marking the chain's nodes resident
    raises: the nodes already marked keep their slots (exact KV), the others' slots are freed."""
    s = make_stack()
    s.insert(A[:20])
    s.insert(A)  # a chain of two nodes, A[:20] and A[20:]
    s.evict_all()
    m = s.match(A)
    chain = s.cache.tree.path_up(m.best_match_node, m.last_device_node)
    assert [len(n.key) for n in chain] == [20, 20]
    mark = s.cache.tree._mark_one

    def fails_on_one(node: Any, value: Any, now: float) -> None:
        if node is chain[failing]:
            raise RuntimeError("injected")
        mark(node, value, now)

    monkeypatch.setattr(s.cache.tree, "_mark_one", fails_on_one)
    for answer in contained_twice(s, caplog, "init_load_back", lambda: s.load_back(s.match(A))):
        assert answer[0] == 0  # recomputed from the resident prefix the match found
    monkeypatch.undo()
    m = s.match(A)
    assert (m.device_prefix_len, m.host_hit_length) == (20 * failing, 40 - 20 * failing)
    loaded, last = s.load_back(m)
    assert loaded == 40 - 20 * failing and read_kv(s.pool, path_slots(s, last)) == expected_kv(A)
    s.cache.check_integrity()
    s.evict_all()
    restores_exactly(s)


def test_a_restore_failing_after_its_verdict_frees_its_slots(
    spilled: Any, caplog: Any, monkeypatch: Any
) -> None:
    free = spilled.allocator.available_size()
    monkeypatch.setattr(type(spilled.metrics), "observe_restore", boom)  # a frozen dataclass
    m = spilled.match(A)
    for answer in contained_twice(spilled, caplog, "init_load_back", lambda: spilled.load_back(m)):
        assert answer == (0, m.last_device_node)
    assert spilled.allocator.available_size() == free
    monkeypatch.undo()
    restores_exactly(spilled)


def test_a_drop_that_raises_leaves_the_node_whole(make_stack: Any, monkeypatch: Any) -> None:
    """A node whose drop fails stays in the tree with its slots (a fallback may pick it again: it
    must not free them a second time), never in the tree with its slots freed."""
    s = make_stack()
    s.insert(A[:3])  # too short to spill: evict drops it
    (leaf,) = s.cache.root_node.children.values()
    monkeypatch.setattr(s.cache, "_delete_leaf", boom)
    with pytest.raises(RuntimeError, match="injected"):
        s.cache.spilling.drop_node(leaf, DropReason.TOO_SHORT)
    s.cache.check_integrity()


B = list(range(300, 340))


def _short_leaf(s: Any) -> Any:
    s.insert(A[:3])  # too short to spill: evict drops it, and so does the fallback
    return lambda: s.cache.evict(EvictParams(num_tokens=1))


def _spilled_chain(s: Any) -> Any:
    s.insert(A)
    s.evict_all()
    return lambda: s.load_back(s.match(A))


def _resident_node(s: Any) -> Any:
    s.insert(A)
    return lambda: s.match(A[:20])  # splits the node, and so does the fallback's walk


@pytest.mark.parametrize(
    ("setup", "target", "name", "last_resort"),
    [
        (_short_leaf, "cache._delete_leaf", "evict", True),
        (_spilled_chain, "restores.drop", "init_load_back", False),
        (_resident_node, "cache._split_node", "match_prefix", True),
    ],
)
def test_a_fault_the_fallback_meets_again_is_contained(
    make_stack: Any, caplog: Any, monkeypatch: Any, setup: Any, target: str, name: str, last_resort: bool
) -> None:
    """Fallbacks run some of the code that failed: a fault there never reaches sglang, frees nothing
    twice, and is counted; where the fallback itself fails, the guard's last resort answers and
    spill is off for good (the cache then serves as sglang's plain radix cache)."""
    s = make_stack()
    call = setup(s)
    owner, attr = target.split(".")
    monkeypatch.setattr({"cache": s.cache, "restores": s.cache.controller.restores}[owner], attr, boom)
    with caplog.at_level(logging.ERROR, logger="sgl_hicache"):
        contained_twice(s, caplog, name, call, errors=4)
        disabled = [
            r
            for r in caplog.records
            if "spill disabled after an internal error in a fallback" in r.getMessage()
        ]
    assert (s.cache.controller is None, len(disabled)) == ((True, 1) if last_resort else (False, 0))
    monkeypatch.undo()
    if not last_resort:
        s.evict_all()
        restores_exactly(s)
        return
    s.insert(B)  # plain sglang from now on: resident KV served exactly, evictions drop
    m = s.match(B)
    assert m.device_prefix_len == len(B) and read_kv(
        s.pool, path_slots(s, m.last_device_node)
    ) == expected_kv(B)
    s.evict_all()
    assert s.match(B).device_prefix_len == 0 and s.cache.spilled_tokens == 0
    s.cache.check_integrity()


def test_a_reset_whose_fallback_fails_too_is_sglangs_reset(
    spilled: Any, caplog: Any, monkeypatch: Any
) -> None:
    monkeypatch.setattr(spilled.cache.controller.reads, "clear", boom)
    monkeypatch.setattr(spilled.cache.lifecycle, "start_epoch", boom)  # the fallback's last step
    contained_twice(spilled, caplog, "reset", spilled.cache.reset, errors=4)
    assert spilled.cache.controller is None and spilled.cache.spilled_tokens == 0
    assert spilled.match(A).host_hit_length == 0  # an empty tree
    monkeypatch.undo()
    spilled.insert(A)
    assert spilled.match(A).device_prefix_len == len(A)
    spilled.cache.check_integrity()


def test_disabling_spill_frees_the_slots_of_restores_in_progress(make_stack: Any) -> None:
    """Issue 38.3: a request deferred with its restore's slots taken (early unpack), then a fallback
    fails and spill is disabled: those slots go back to the pool, so sglang's idle memory check
    (available + evictable + protected == pool, strict by default) still holds."""
    import time
    from types import SimpleNamespace

    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier

    s = make_stack(size=512, chunk_bytes=4096)
    tokens = list(range(300, 500))
    s.insert(tokens)
    s.evict_all()
    ctl = s.cache.controller
    ctl.tier = FaultyTier(ctl.tier, FaultSpec(latency_s=2.0))
    m = s.match(tokens)
    req = SimpleNamespace(last_node=m.last_device_node, rid="resume-1")
    params = InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req)
    deadline = time.monotonic() + 20
    while ctl.restores.held_tokens == 0:  # deferred; the first landed chunk took the slots
        assert s.cache.init_load_back(params) is None and time.monotonic() < deadline
        time.sleep(0.01)
    s.cache.disable_spill()
    cache, allocator = s.cache, s.allocator
    assert allocator.available_size() + cache.evictable_size() + cache.protected_size() == allocator.size
    assert ctl.restores.held_tokens == 0
    cache.check_integrity()


def test_a_restore_whose_unpack_fails_gives_its_staging_back_at_once(
    spilled: Any, caplog: Any, monkeypatch: Any
) -> None:
    """Issue 38.5: the unpack of a complete restore raises: the request recomputes, and the reads'
    staging goes back now, not after the prefetch TTL."""
    s, ctl = spilled, spilled.cache.controller
    monkeypatch.setattr(ctl.engine, "unpack", boom)
    m = s.match(A)
    assert s.load_back(m)[0] == 0
    ctl.poll()
    assert ctl.staging.used_bytes == 0, "the failed restore's reads still hold staging"
    monkeypatch.undo()
    s.cache.check_integrity()
    restores_exactly(s)


def test_a_restore_whose_eviction_disables_spill_strands_no_slot(make_stack: Any, monkeypatch: Any) -> None:
    """The eviction that makes room for a restore frees slots, then raises, and its fallback raises
    too: spill is disabled inside the restore's allocation. The slots it allocated go back to the
    pool (before: the restore registered them with a controller that was gone, AttributeError, and
    sglang's strict idle memory check found 216 + 0 + 0 != 256)."""
    s = make_stack(size=256)
    s.insert(A)
    s.evict_all()
    s.insert(list(range(1000, 1240)))  # the pool nearly full: A's restore must evict
    cache = s.cache
    victims = type(cache.spilling).victims
    calls: list[int] = []

    def once(self: Any, n: int) -> Any:  # the eviction's own walk, then its fallback's, which fails
        calls.append(n)
        if len(calls) > 1:
            raise RuntimeError("injected (fallback)")
        return victims(self, n)

    monkeypatch.setattr(type(cache.spilling), "victims", once)
    monkeypatch.setattr(cache, "update_eviction_metrics", boom)
    loaded, _ = s.load_back(s.match(A))
    assert cache.controller is None and loaded == 0
    alloc = s.allocator
    assert alloc.available_size() + cache.evictable_size() + cache.protected_size() == alloc.size
