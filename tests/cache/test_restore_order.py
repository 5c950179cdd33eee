"""Restores take staging in the order they began waiting for room (`restores_in_order`,
room_waits.py), and a restore waiting for room takes back landed prefetches no restore asked for
(`restores_take_back`, take_back.py): without them, queued restores each start some reads, split
a staging of about one context between them and wait until their limit (a hold-and-wait convoy),
while prefetches of requests further back keep their room. With the keys off, as before. Every
restore here is checked byte for byte against the KV that was evicted.

The histories are 64-token turns (one extent each, 8 KiB of packed KV) under a 20 KiB staging.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from sgl_hicache.config import PrefetchPolicy
from tests.cache.conftest import Stack, TwoRanks, expected_kv, read_kv
from tests.cache.test_restore_reserve import HISTORY, TURN, HeldWrites, turn
from tests.cache.test_streamed_restore import admission, admit_all, resident
from tests.cache.test_take_back import evict, landed, on_tier

OTHER = turn(5000)


def exact(s: Stack, answers: dict[str, Any], histories: dict[str, list[int]]) -> None:
    """Each request got its whole history, its KV exactly what was evicted, and the tree is sound."""
    for rid, tokens in histories.items():
        loaded, last = answers[rid]
        assert loaded == len(tokens)
        assert read_kv(s.pool, last.value) == expected_kv(tokens)[-len(last.value) :]
        assert resident(s, tokens) == expected_kv(tokens)
    s.cache.controller.wait_writes()
    s.cache.check_integrity()


def other_landed_and_a_write_held(
    s: Stack, monkeypatch: pytest.MonkeyPatch, history: list[int]
) -> tuple[Any, Any, HeldWrites]:
    """`history` and OTHER on the tier, OTHER's prefetch landed (no restore asked for it), and one
    eviction's write held in staging: the controller, the counters and the held writes."""
    on_tier(s, history, OTHER)
    ctl = s.cache.controller
    s.cache.prefetch(OTHER)
    landed(s, 1)
    held = HeldWrites(monkeypatch, ctl.tier)
    evict(s, turn(1000))
    held.wait(s, 1)
    return ctl, s.metrics.totals, held


def extent_of(s: Stack, tokens: list[int]) -> Any:
    return s.match(tokens).best_match_node.spill.extent


def reading(s: Stack, extent: Any) -> bool:
    """Whether a read of `extent` has started (in flight or landed; `match` would take completions)."""
    return s.cache.controller.reads.landed(extent) is not None


@pytest.mark.parametrize("in_order", [True, False], ids=["in_order", "off"])
def test_a_restore_starts_no_read_while_another_waits_for_room(
    make_stack: Any, monkeypatch: pytest.MonkeyPatch, in_order: bool
) -> None:
    """A's read waits for room (two writes hold 16 of 20 KiB). One write finishes: B, tried
    first, starts nothing (the room is A's) and A's read starts; B starts once A's has. Off, B
    takes the room and A waits on."""
    s = make_stack(size=1024, restores_in_order=in_order, restores_take_back=False)
    on_tier(s, HISTORY, OTHER)
    ctl, totals = s.cache.controller, s.metrics.totals
    held = HeldWrites(monkeypatch, ctl.tier)
    evict(s, turn(1000))
    evict(s, turn(2000))
    held.wait(s, 2)
    a, b = admission(s, HISTORY, "a"), admission(s, OTHER, "b")
    mine, theirs = extent_of(s, HISTORY), extent_of(s, OTHER)
    assert s.cache.init_load_back(a) is None and ctl.reads.room_wanted
    held.release(1)  # 8 KiB back: room for one read
    ctl.poll()
    assert s.cache.init_load_back(b) is None
    if in_order:
        assert totals["restore_reads_yielded"] == 1 and totals["reads_on_demand"] == 0
        assert not reading(s, theirs)
        assert s.cache.init_load_back(a) is None and not ctl.reads.room_wanted, "A's read started"
        assert reading(s, mine)
        held.release()
        ctl.poll()
        assert s.cache.init_load_back(b) is None and totals["reads_on_demand"] == 2, "B's read started"
    else:
        assert totals["restore_reads_yielded"] == 0 and totals["reads_on_demand"] == 1
        assert reading(s, theirs)
        assert s.cache.init_load_back(a) is None and ctl.reads.room_wanted, "B took A's room"
        held.release()
    exact(s, admit_all(s, {"a": a, "b": b}), {"a": HISTORY, "b": OTHER})


@pytest.mark.parametrize("in_order", [True, False], ids=["in_order", "off"])
def test_a_restore_whose_reads_all_started_completes_while_another_waits(
    make_stack: Any, monkeypatch: pytest.MonkeyPatch, in_order: bool
) -> None:
    """B's read started before A waited for room: B takes it once landed and is restored (the order
    holds back new reads only), its staging then goes to A."""
    s = make_stack(size=1024, restores_in_order=in_order, restores_take_back=True)
    on_tier(s, HISTORY, OTHER)
    ctl, totals = s.cache.controller, s.metrics.totals
    held = HeldWrites(monkeypatch, ctl.tier)
    evict(s, turn(1000))
    held.wait(s, 1)  # 8 of 20 KiB held
    a, b = admission(s, HISTORY, "a"), admission(s, OTHER, "b")
    assert s.cache.init_load_back(b) is None  # its read starts: 16 of 20 KiB
    assert s.cache.init_load_back(a) is None and ctl.reads.room_wanted
    landed(s, 1)
    answers = {"b": s.cache.init_load_back(b)}
    assert answers["b"] is not None, "restored while A waits"
    assert totals["restore_reads_yielded"] == 0 and ctl.reads.room_wanted
    answers.update(admit_all(s, {"a": a}))
    held.release()
    exact(s, answers, {"a": HISTORY, "b": OTHER})


@pytest.mark.parametrize("take_back", [True, False], ids=["take_back", "off"])
def test_a_waiting_restore_takes_back_another_requests_landed_prefetch(
    make_stack: Any, monkeypatch: pytest.MonkeyPatch, take_back: bool
) -> None:
    """OTHER's prefetch landed (no restore asked for it) and a write holds 8 KiB: HISTORY's read
    finds 4 KiB free, takes OTHER's read back and starts at once. Off, it waits."""
    s = make_stack(size=1024, restores_in_order=True, restores_take_back=take_back)
    on_tier(s, HISTORY, OTHER)
    ctl, totals = s.cache.controller, s.metrics.totals
    mine, theirs = extent_of(s, HISTORY), extent_of(s, OTHER)
    assert s.cache.prefetch(OTHER) == TURN
    landed(s, 1)
    held = HeldWrites(monkeypatch, ctl.tier)
    evict(s, turn(1000))
    held.wait(s, 1)  # 16 of 20 KiB held
    a = admission(s, HISTORY, "a")
    assert s.cache.init_load_back(a) is None
    if take_back:
        assert not ctl.reads.room_wanted and reading(s, mine)
        assert (totals["reads_taken_back"], totals["reads_taken_back_for_restores"]) == (1, 1)
        assert totals["reads_taken_back_tokens"] == TURN and not ctl.reads.landed_reads()
    else:
        assert ctl.reads.room_wanted and totals["reads_taken_back"] == 0
        assert [r.extent for r in ctl.reads.landed_reads()] == [theirs]
        held.release()
    answers = admit_all(s, {"a": a})
    held.release()
    answers.update(admit_all(s, {"o": admission(s, OTHER, "o")}))  # read again if taken back
    assert totals["reads_on_demand"] == (2 if take_back else 1)
    exact(s, answers, {"a": HISTORY, "o": OTHER})


def test_a_waiting_restore_never_takes_back_a_read_a_restore_in_progress_needs(
    make_stack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = make_stack(size=1024, restores_in_order=True, restores_take_back=True)
    ctl, totals, held = other_landed_and_a_write_held(s, monkeypatch, HISTORY)
    ctl.restores.open("o", (s.match(OTHER).best_match_node.spill,), s.allocator.alloc(TURN))
    a = admission(s, HISTORY, "a")
    assert s.cache.init_load_back(a) is None and ctl.reads.room_wanted
    assert totals["reads_taken_back"] == 0 and len(ctl.reads.landed_reads()) == 1
    ctl.restores.drop("o")  # no longer in progress: its read is a prefetch again
    assert s.cache.init_load_back(a) is None and not ctl.reads.room_wanted
    assert totals["reads_taken_back_for_restores"] == 1
    answers = admit_all(s, {"a": a})
    held.release()
    answers.update(admit_all(s, {"o": admission(s, OTHER, "o")}))
    exact(s, answers, {"a": HISTORY, "o": OTHER})


def test_a_waiting_restore_gives_back_nothing_when_it_would_not_make_room(
    make_stack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 128-token history (one 16 KiB read): OTHER's landed prefetch [0, 8K) and the free
    [16K, 20K) lie either side of a held write, so giving it back would not make 16 KiB: it is
    kept. Once the write finishes, giving it back does make room, and the read starts."""
    s = make_stack(size=1024, restores_in_order=True, restores_take_back=True)
    long = turn(7000, 2 * TURN)
    ctl, totals, held = other_landed_and_a_write_held(s, monkeypatch, long)
    a = admission(s, long, "a")
    assert s.cache.init_load_back(a) is None and ctl.reads.room_wanted
    assert totals["reads_taken_back"] == 0 and len(ctl.reads.landed_reads()) == 1
    held.release()
    ctl.poll()
    assert s.cache.init_load_back(a) is None and not ctl.reads.room_wanted
    assert totals["reads_taken_back_for_restores"] == 1
    answers = admit_all(s, {"a": a})
    answers.update(admit_all(s, {"o": admission(s, OTHER, "o")}))
    exact(s, answers, {"a": long, "o": OTHER})


def test_a_restore_never_takes_back_its_own_extents(make_stack: Any) -> None:
    """`TakeBack.room` passes over the reads of the extents it is told to keep (a waiting
    restore's own), even when they alone would make room."""
    s = make_stack(size=1024, restores_in_order=True, restores_take_back=True)
    on_tier(s, OTHER, staging=8 << 10)
    ctl = s.cache.controller
    s.cache.prefetch(OTHER)
    landed(s, 1)
    mine = {id(extent_of(s, OTHER))}
    assert ctl.take_back.room(ctl.staging, 8 << 10, exclude=mine) is None
    assert len(ctl.reads.landed_reads()) == 1 and s.metrics.totals["reads_taken_back"] == 0
    assert ctl.take_back.room(ctl.staging, 8 << 10) == 1


def test_tp_ranks_where_only_one_takes_back_for_a_restore_keep_equal_trees(
    two_ranks: Callable[..., TwoRanks], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 (20 KiB of staging) has OTHER's prefetch landed and takes it back for HISTORY's
    read; rank 1 (12 KiB) had no room for the prefetch and its restore waits. Take-back changes no
    tree: the ranks agree, restore HISTORY and OTHER exact, and their trees stay equal."""
    from sgl_hicache.cache.warm_start import tree_digest

    ranks = two_ranks(size=1024, restores_in_order=True, restores_take_back=True)
    for r, s in enumerate(ranks.stacks):
        on_tier(s, HISTORY, OTHER, staging=(20 if r == 0 else 12) << 10)
    helds = [HeldWrites(monkeypatch, s.cache.controller.tier) for s in ranks.stacks]

    def work(r: int, s: Stack) -> list[Any]:
        evict(s, turn(1000))
        helds[r].wait(s, 1)  # 8 KiB held on both
        s.cache.prefetch(OTHER)  # starts on rank 0 only
        if r == 0:
            landed(s, 1)
        first = s.cache.init_load_back(admission(s, HISTORY, "a"))
        helds[r].release()
        loaded, _ = s.load_back(s.match(HISTORY), rid="a")
        other, _ = s.load_back(s.match(OTHER), rid="o")
        return [
            first,
            loaded,
            resident(s, HISTORY),
            other,
            resident(s, OTHER),
            tree_digest(s.cache.root_node),
        ]

    record = ranks.run(work)
    assert record[:5] == [None, TURN, expected_kv(HISTORY), TURN, expected_kv(OTHER)]
    totals = [s.metrics.totals for s in ranks.stacks]
    assert (totals[0]["reads_taken_back_for_restores"], totals[1]["reads_taken_back_for_restores"]) == (1, 0)


@pytest.mark.parametrize("shared", [False, True], ids=["own", "shared"])
def test_a_restore_gives_back_its_shorter_read_that_holds_the_room_its_read_needs(
    make_stack: Any, shared: bool
) -> None:
    """A prefetch read HISTORY's first 32 tokens (4 KiB) into an 8 KiB staging; HISTORY's restore
    needs all 64 (8 KiB), which cannot start beside it. Before, the short read was the restore's
    until a longer one started, which never could: it waited until it was too late and
    recomputed. It gives the short read back and completes; not while another restore in
    progress still needs it (`shared`), until that one is gone."""
    from sgl_hicache.cache.spill_state import SpillRef

    s = make_stack(size=1024, prefetch_policy=PrefetchPolicy.TIMEOUT, prefetch_timeout_s=2.0)
    on_tier(s, HISTORY, staging=8 << 10)
    ctl, totals = s.cache.controller, s.metrics.totals
    assert s.cache.prefetch(HISTORY[:32]) == 32
    landed(s, 1)
    a = admission(s, HISTORY, "a")
    if shared:
        ref = s.match(HISTORY).best_match_node.spill
        ctl.restores.open("o", (SpillRef(ref.extent, 0, 32),), s.allocator.alloc(32))
        assert s.cache.init_load_back(a) is None and ctl.reads.room_wanted
        assert len(ctl.reads.landed_reads()) == 1, "kept for the restore in progress"
        ctl.restores.drop("o")
    answers = admit_all(s, {"a": a})
    assert (totals["restores_too_late"], totals["reads_on_demand"]) == (0, 1)
    exact(s, answers, {"a": HISTORY})


def test_a_waiting_restore_leaves_a_shorter_read_another_restore_started_on_demand(make_stack: Any) -> None:
    """C needs HISTORY's first 32 tokens and started their read itself (on demand); A needs all 64,
    which cannot start beside it in an 8 KiB staging. A gives back only a short read a prefetch
    started: C's is C's. Before, A gave C's read back every round and C started it again (a read
    on demand each round, neither restored until too late); now C completes, then A's read
    starts, and both are exact (reviewer's finding)."""
    s = make_stack(size=1024, prefetch_policy=PrefetchPolicy.TIMEOUT, prefetch_timeout_s=10.0)
    on_tier(s, HISTORY, staging=8 << 10)
    totals = s.metrics.totals
    c, a = admission(s, HISTORY[:32], "c"), admission(s, HISTORY, "a")
    answers = admit_all(s, {"c": c, "a": a})
    assert totals["restores_too_late"] == 0
    assert totals["reads_on_demand"] == 2, "C's read once, then A's: none started again"
    assert answers["c"][0] == 32
    exact(s, answers, {"a": HISTORY})
    assert read_kv(s.pool, answers["c"][1].value) == expected_kv(HISTORY[:32])[-len(answers["c"][1].value) :]


@pytest.mark.parametrize("c_first", [True, False], ids=["c_first", "a_first"])
def test_a_waiting_restore_leaves_a_prefetched_read_another_restore_uses(
    make_stack: Any, c_first: bool
) -> None:
    """A prefetch reads HISTORY's first 32 tokens (slowly); C needs exactly those, A all 64, which
    cannot start beside them in an 8 KiB staging. Once C asked for the read it is C's to use: A
    leaves it, C completes, then (no one using it) A gives it back and reads. Tried first, A finds
    the prefetch nobody uses yet and gives it back: C reads it again, once, and keeps it. Either
    way nothing waits until too late, and both are exact. Before: A gave C's read back every time,
    or, keeping it, A (opened on its landed prefix) held it after C finished until too late."""
    from tests.cache.test_streamed_restore import slow

    s = make_stack(size=1024, prefetch_policy=PrefetchPolicy.TIMEOUT, prefetch_timeout_s=10.0)
    on_tier(s, HISTORY, staging=8 << 10)
    totals = s.metrics.totals
    slow(s, 0.3)
    assert s.cache.prefetch(HISTORY[:32]) == 32
    c, a = admission(s, HISTORY[:32], "c"), admission(s, HISTORY, "a")
    answers = admit_all(s, {"c": c, "a": a} if c_first else {"a": a, "c": c})
    assert totals["restores_too_late"] == 0
    assert totals["reads_on_demand"] == (1 if c_first else 2), "A's read, and C's again only if A came first"
    assert answers["c"][0] == 32
    assert read_kv(s.pool, answers["c"][1].value) == expected_kv(HISTORY[:32])[-len(answers["c"][1].value) :]
    exact(s, answers, {"a": HISTORY})
