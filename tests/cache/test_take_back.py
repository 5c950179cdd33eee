"""Landed reads yield to evicted KV (`take_back_reads`, take_back.py): an eviction's spill that finds
staging full takes the room back from prefetched reads no restore asked for yet (the tier serves
them again) instead of dropping its victim; never from a deferred restore's reads, the restore
taking its slots in that eviction, nor a restore in progress; nothing given back when all of it
would not make room. Off, the victim is dropped as before. Every restore here is checked byte for
byte.

The histories are 64-token turns (one extent each, 8 KiB of packed KV) under a 20 KiB staging.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from sgl_hicache.cache.metrics import DropReason
from tests.cache.conftest import Stack, TwoRanks, expected_kv, read_kv, shrink_staging
from tests.cache.test_restore_reserve import HISTORY, STAGING, TURN, HeldWrites, turn
from tests.cache.test_streamed_restore import admission, admit_all, resident


def landed(s: Stack, n: int) -> None:
    """Until `n` reads have landed (completed and verified, kept for a restore)."""
    for _ in range(3000):
        s.cache.controller.poll()
        if len(s.cache.controller.reads.landed_reads()) >= n:
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"{n} reads did not land in 30 s")


def on_tier(s: Stack, *histories: list[int], staging: int = STAGING) -> None:
    for tokens in histories:
        s.insert(tokens)
    s.evict_all()
    shrink_staging(s, staging)


def evict(s: Stack, tokens: list[int]) -> None:
    s.insert(tokens)
    s.cache.evict(EvictParams(num_tokens=10**9))


@pytest.mark.parametrize("take_back", [True, False], ids=["take_back", "off"])
def test_a_spill_takes_back_a_landed_prefetch_instead_of_dropping_its_victim(
    make_stack: Any, monkeypatch: pytest.MonkeyPatch, take_back: bool
) -> None:
    s = make_stack(size=1024, take_back_reads=take_back)
    on_tier(s, HISTORY)
    held = HeldWrites(monkeypatch, s.cache.controller.tier)
    assert s.cache.prefetch(HISTORY) == TURN
    landed(s, 1)
    evict(s, turn(1000))  # its write holds 8 KiB: 16 of 20 KiB held
    held.wait(s, 1)
    victim = turn(2000)
    evict(s, victim)  # 8 KiB more: only the prefetch's room can hold it
    totals = s.metrics.totals
    if take_back:
        assert (totals["reads_taken_back"], totals["reads_taken_back_tokens"]) == (1, TURN)
        assert totals["spills_refused_staging_full"] == 0 and totals["spilled_tokens"] == 3 * TURN
        assert not s.cache.controller.reads.landed_reads()
    else:
        assert totals["reads_taken_back"] == 0 and s.metrics.drops[DropReason.STAGING_FULL] == TURN
        assert s.match(victim).host_hit_length == 0, "dropped unwritten"
    held.release()
    s.cache.controller.wait_writes()
    if take_back:
        assert s.match(victim).host_hit_length == TURN
        loaded, last = s.load_back(s.match(victim), rid="victim")
        assert loaded == TURN and read_kv(s.pool, last.value) == expected_kv(victim)
    loaded, last = s.load_back(s.match(HISTORY), rid="history")  # read again if it was taken back
    assert loaded == TURN and read_kv(s.pool, last.value) == expected_kv(HISTORY)
    assert totals["reads_on_demand"] == (2 if take_back else 0)  # the victim, HISTORY again
    s.cache.check_integrity()


def test_the_eviction_that_makes_room_for_a_restore_never_takes_its_reads(
    make_stack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HISTORY's read has landed; its restore must evict a resident turn, whose spill finds staging
    full: the only landed read is the restore's own, so the victim is dropped, not the restore."""
    s = make_stack(size=2 * TURN)
    on_tier(s, HISTORY)
    held = HeldWrites(monkeypatch, s.cache.controller.tier)
    evict(s, turn(3000))  # its write holds 8 KiB
    held.wait(s, 1)
    for base in (1000, 2000):
        s.insert(turn(base))  # the pool is full
    s.cache.prefetch(HISTORY)
    landed(s, 1)
    (loaded, last) = admit_all(s, {"r": admission(s, HISTORY, "r")})["r"]
    totals = s.metrics.totals
    assert loaded == TURN and read_kv(s.pool, last.value) == expected_kv(HISTORY)
    assert resident(s, HISTORY) == expected_kv(HISTORY)
    assert (totals["reads_taken_back"], totals["restores_overtaken"], totals["restore_failures"]) == (0, 0, 0)
    assert s.metrics.drops[DropReason.STAGING_FULL] == TURN, "the victim had no room: dropped"
    held.release()
    s.cache.check_integrity()


def test_only_prefetches_no_restore_asked_for_are_taken_back_the_latest_first(make_stack: Any) -> None:
    s = make_stack(size=1024)
    first, second, deferred = turn(100), turn(1000), turn(2000)
    on_tier(s, first, second, deferred, staging=STAGING + (8 << 10))  # three reads and 4 KiB
    s.cache.prefetch(first)
    landed(s, 1)
    s.cache.prefetch(second)
    landed(s, 2)
    assert s.cache.init_load_back(admission(s, deferred, "d")) is None  # its read started: deferred
    landed(s, 3)
    ctl = s.cache.controller
    order = [r.extent for r in ctl.take_back.candidates()]
    extents = [s.match(t).best_match_node.spill.extent for t in (second, first, deferred)]
    assert order == extents[:2], "the deferred restore's read is its next admission: kept"
    evict(s, turn(3000))  # 8 KiB: one read's room is enough
    assert s.metrics.totals["reads_taken_back"] == 1
    assert [r.extent for r in ctl.reads.landed_reads()] == [extents[1], extents[2]]
    s.cache.controller.wait_writes()
    for rid, tokens in (("a", first), ("b", second), ("d", deferred)):
        loaded, last = s.load_back(s.match(tokens), rid=rid)
        assert loaded == TURN and read_kv(s.pool, last.value) == expected_kv(tokens)
    s.cache.check_integrity()


def test_nothing_is_given_back_when_all_of_it_would_not_make_room(
    make_stack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = make_stack(size=1024)
    on_tier(s, HISTORY)
    held = HeldWrites(monkeypatch, s.cache.controller.tier)
    s.cache.prefetch(HISTORY)
    landed(s, 1)
    evict(s, turn(1000))
    held.wait(s, 1)  # 16 of 20 KiB held: 4 KiB free and 8 KiB of landed read
    evict(s, turn(2000, 2 * TURN))  # 16 KiB: more than both
    totals = s.metrics.totals
    assert totals["reads_taken_back"] == 0 and s.metrics.drops[DropReason.STAGING_FULL] == 2 * TURN
    assert len(s.cache.controller.reads.landed_reads()) == 1, "the read is kept"
    held.release()
    loaded, last = s.load_back(s.match(HISTORY), rid="h")
    assert loaded == TURN and read_kv(s.pool, last.value) == expected_kv(HISTORY)
    assert totals["prefetch_hits"] == 1 and totals["reads_on_demand"] == 0
    s.cache.check_integrity()


def test_a_restore_in_progress_keeps_its_reads(make_stack: Any) -> None:
    s = make_stack(size=1024)
    on_tier(s, HISTORY)
    s.cache.prefetch(HISTORY)
    landed(s, 1)
    ctl = s.cache.controller
    assert len(ctl.take_back.candidates()) == 1
    refs = (s.match(HISTORY).best_match_node.spill,)
    slots = s.allocator.alloc(TURN)
    ctl.restores.open("r", refs, slots)  # its slots taken: in progress
    assert ctl.take_back.candidates() == []
    ctl.restores.drop("r")
    assert len(ctl.take_back.candidates()) == 1


def test_nothing_is_given_back_when_the_room_freed_would_lie_in_pieces(
    make_stack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Staging of 24 KiB: a landed read, a write held, another landed read. A 16 KiB spill would
    find 16 KiB free after giving back both reads, but in two 8 KiB pieces around the write: it
    gives back nothing, and the reads stay for their restores."""
    s = make_stack(size=1024)
    other = turn(5000)
    on_tier(s, HISTORY, other, staging=24 << 10)
    held = HeldWrites(monkeypatch, s.cache.controller.tier)
    s.cache.prefetch(HISTORY)
    landed(s, 1)
    evict(s, turn(1000))
    held.wait(s, 1)
    s.cache.prefetch(other)
    landed(s, 2)
    assert s.cache.controller.staging.used_bytes == 24 << 10
    evict(s, turn(2000, 2 * TURN))
    totals = s.metrics.totals
    assert totals["reads_taken_back"] == 0 and s.metrics.drops[DropReason.STAGING_FULL] == 2 * TURN
    assert len(s.cache.controller.reads.landed_reads()) == 2
    held.release()
    for rid, tokens in (("h", HISTORY), ("o", other)):
        loaded, last = s.load_back(s.match(tokens), rid=rid)
        assert loaded == TURN and read_kv(s.pool, last.value) == expected_kv(tokens)
    assert totals["reads_on_demand"] == 0
    s.cache.check_integrity()


def test_only_the_reads_around_the_room_are_given_back(
    make_stack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Staging of 28 KiB: read A, a write held, read B, 4 KiB free. A 12 KiB spill fits once B
    (beside the free 4 KiB) is given back; A, though started last (first in line), lies the other
    side of the write: it is kept."""
    s = make_stack(size=1024)
    a, b, x = HISTORY, turn(5000), turn(6000)
    on_tier(s, a, b, x, staging=28 << 10)
    held = HeldWrites(monkeypatch, s.cache.controller.tier)
    ctl = s.cache.controller
    s.cache.prefetch(x)  # [0, 8K)
    landed(s, 1)
    evict(s, turn(1000))  # [8K, 16K), held
    held.wait(s, 1)
    s.cache.prefetch(b)  # [16K, 24K)
    landed(s, 2)
    ctl.reads.finish_extent(id(s.match(x).best_match_node.spill.extent))  # [0, 8K) free again
    s.cache.prefetch(a)  # [0, 8K), started last
    landed(s, 2)
    extent = {tuple(t): s.match(t).best_match_node.spill.extent for t in (a, b)}
    assert [r.extent for r in ctl.take_back.candidates()] == [extent[tuple(a)], extent[tuple(b)]]
    victim = turn(2000, 96)
    evict(s, victim)  # 12 KiB: only B's block and the free 4 KiB beside it make one
    totals = s.metrics.totals
    assert totals["reads_taken_back"] == 1 and totals["spills_refused_staging_full"] == 0
    assert [r.extent for r in ctl.reads.landed_reads()] == [extent[tuple(a)]]
    held.release()
    ctl.wait_writes()
    for rid, tokens in (("a", a), ("b", b), ("v", victim)):
        loaded, _ = s.load_back(s.match(tokens), rid=rid)
        assert loaded == len(tokens) and resident(s, tokens) == expected_kv(tokens)
    s.cache.check_integrity()


def test_a_short_prefetch_a_restore_asked_for_is_not_taken_back(make_stack: Any) -> None:
    """A prefetch read the first 32 tokens of HISTORY; its restore needs all 64 and finds no room
    for the longer read: the short read is the restore's now (it may unpack from it while it waits
    for room, and the eviction making room for its slots must not take it), not a prefetch."""
    s = make_stack(size=1024)
    on_tier(s, HISTORY)
    s.cache.prefetch(HISTORY[:32])
    landed(s, 1)
    ctl = s.cache.controller
    extent = s.match(HISTORY).best_match_node.spill.extent
    assert [r.extent for r in ctl.take_back.candidates()] == [extent]
    assert ctl.reads.start(extent, TURN, prefetch=False, new=False) is None  # no room to start it
    assert ctl.take_back.candidates() == []
    loaded, _ = s.load_back(s.match(HISTORY), rid="r")
    assert loaded == TURN and resident(s, HISTORY) == expected_kv(HISTORY)
    s.cache.check_integrity()


def test_tp_ranks_where_only_one_can_take_back_keep_equal_trees(
    two_ranks: Callable[..., TwoRanks], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Take-back is each rank's own: rank 0 (20 KiB of staging) gives back its landed prefetch
    for a spill, rank 1 (12 KiB, no read landed) refuses it. The eviction's agreement drops the
    victim on both, so the trees stay equal; HISTORY is then restored exact on both."""
    from sgl_hicache.cache.warm_start import tree_digest

    ranks = two_ranks(size=1024)
    for r, s in enumerate(ranks.stacks):
        on_tier(s, HISTORY, staging=STAGING if r == 0 else 12 << 10)
    helds = [HeldWrites(monkeypatch, s.cache.controller.tier) for s in ranks.stacks]
    victim = turn(2000)

    def work(r: int, s: Stack) -> list[Any]:
        held = helds[r]
        evict(s, turn(1000))  # 8 KiB held on both
        held.wait(s, 1)
        s.cache.prefetch(HISTORY)  # starts on rank 0 only: rank 1 has 4 KiB free
        if r == 0:
            landed(s, 1)
        evict(s, victim)
        evicted = (s.match(victim).host_hit_length, tree_digest(s.cache.root_node))
        held.release()
        loaded, _ = s.load_back(s.match(HISTORY), rid="h")
        return [evicted, (loaded, resident(s, HISTORY), tree_digest(s.cache.root_node))]

    record = ranks.run(work)  # equal on both ranks
    assert record[0][0] == 0, "the victim was dropped on both ranks"
    assert record[1][:2] == (TURN, expected_kv(HISTORY))
    totals = [s.metrics.totals for s in ranks.stacks]
    assert (totals[0]["reads_taken_back"], totals[1]["reads_taken_back"]) == (1, 0)
    assert totals[0]["tp_disagreements"] >= 1, "rank 0 spilled it and had to drop it"
