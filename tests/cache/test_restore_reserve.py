"""Restores waiting for room in staging come before new eviction spills (`restore_reserve`,
staging_share.py): while a restore waits to start a read, no store may take the bytes that read
needs, so the room earlier writes give back goes to the read; a spill that would take it is dropped
unwritten and counted. With the key off (as before) the eviction takes the room and the restore
waits on. No effect while no restore waits; with TP > 1 the ranks' trees stay equal.

The histories here are 64-token turns (one extent each, 8 KiB of packed KV: 128 B a token) under a
20 KiB staging: two turns' writes and one page.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from sgl_hicache_kernels import packed_nbytes
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from sgl_hicache.cache.metrics import DropReason, SpillMetrics
from sgl_hicache.cache.staging import StagingPool
from sgl_hicache.cache.staging_share import Refused, StagingShare
from tests.cache.conftest import Stack, TwoRanks, expected_kv, read_kv, shrink_staging
from tests.cache.test_streamed_restore import admission, admit_all, resident

TURN = 64
STAGING = 20 << 10
HISTORY = list(range(100, 100 + TURN))


def turn(base: int, tokens: int = TURN) -> list[int]:
    return list(range(base, base + tokens))


class HeldWrites:
    """The tier's finished stores kept from the cache (their staging stays held, as behind a slow
    disk) until `release`d."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tier: Any) -> None:
        from sgl_hicache.tier.results import Op

        self.held: list[Any] = []
        self._out: list[Any] = []
        inner = tier.get_finished

        def get_finished() -> list[Any]:
            done = inner()
            self.held.extend(d for d in done if d.op is Op.STORE)
            out, self._out = [d for d in done if d.op is not Op.STORE] + self._out, []
            return out

        monkeypatch.setattr(tier, "get_finished", get_finished)

    def wait(self, s: Stack, n: int) -> None:
        """Until the tier has finished `n` stores (the cache sees none of them)."""
        for _ in range(3000):
            s.cache.controller.poll()
            if len(self.held) >= n:
                return
            threading.Event().wait(0.01)
        raise AssertionError(f"the tier finished {len(self.held)} of {n} stores in 30 s")

    def release(self, n: int | None = None) -> None:
        """Let `n` held stores (all by default) reach the cache at its next poll."""
        n = len(self.held) if n is None else n
        self._out, self.held = self._out + self.held[:n], self.held[n:]


def waiting_restore(make_stack: Callable[..., Stack], monkeypatch: pytest.MonkeyPatch,
                    reserve: bool = True, **config: Any) -> tuple[Stack, HeldWrites, Any]:  # fmt: skip
    """HISTORY on the tier; two evictions' writes (16 KiB) hold staging; HISTORY's restore tried
    once: its 8 KiB read found no room and waits (`config`: SpillConfig fields to change)."""
    s = make_stack(size=1024, restore_reserve=reserve, **config)
    s.insert(HISTORY)
    s.evict_all()
    shrink_staging(s, STAGING)
    held = HeldWrites(monkeypatch, s.cache.controller.tier)
    for base in (1000, 2000):
        s.insert(turn(base))
    s.cache.evict(EvictParams(num_tokens=10**9))
    held.wait(s, 2)
    assert s.cache.controller.staging.used_bytes == 2 * packed_nbytes(s.cache.controller.view, TURN)
    params = admission(s, HISTORY, "r")
    assert s.cache.init_load_back(params) is None
    assert s.metrics.totals["restore_staging_waits"] == 1 and s.cache.controller.reads.room_wanted
    return s, held, params


@pytest.mark.parametrize("reserve", [True, False], ids=["reserve", "noreserve"])
def test_room_freed_by_a_write_goes_to_the_waiting_restore_not_the_next_eviction(
    make_stack: Any, monkeypatch: pytest.MonkeyPatch, reserve: bool
) -> None:
    s, held, params = waiting_restore(make_stack, monkeypatch, reserve)
    ctl, totals = s.cache.controller, s.metrics.totals
    held.release(1)  # one write finished: 8 KiB back, the read's room
    ctl.poll()
    evicted = turn(3000)
    s.insert(evicted)
    s.cache.evict(EvictParams(num_tokens=10**9))  # its 8 KiB would fit in the room given back
    if reserve:
        assert (totals["spills_refused_reserved"], totals["spills_refused_staging_full"]) == (1, 0)
        assert s.metrics.drops[DropReason.STAGING_FULL] == TURN and totals["spilled_tokens"] == 3 * TURN
        assert s.match(evicted).host_hit_length == 0, "dropped unwritten"
        s.cache.init_load_back(params)  # its read starts now, with one write still in flight
        assert not ctl.reads.room_wanted and len(held.held) == 1
    else:
        assert totals["spills_refused_reserved"] == 0 and totals["spilled_tokens"] == 4 * TURN
        assert s.cache.init_load_back(params) is None
        assert ctl.reads.room_wanted, "the eviction took the room: the read still waits"
        held.release()
    loaded, last = admit_all(s, {"r": params})["r"]
    assert loaded == TURN and read_kv(s.pool, last.value) == expected_kv(HISTORY)
    assert resident(s, HISTORY) == expected_kv(HISTORY)
    assert ctl.share.reserved(ctl.staging) == 0, "nothing is kept once no restore waits"
    held.release()
    ctl.wait_writes()
    s.cache.check_integrity()


def test_while_no_restore_waits_a_spill_may_fill_staging(
    make_stack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = make_stack(size=1024, restore_reserve=True)
    shrink_staging(s, STAGING)
    held = HeldWrites(monkeypatch, s.cache.controller.tier)
    for base in (1000, 2000, 3000):  # the last one: 32 tokens, staging's last 4 KiB
        s.insert(turn(base, TURN if base < 3000 else 32))
    s.cache.evict(EvictParams(num_tokens=10**9))
    totals = s.metrics.totals
    assert (totals["spills_refused_reserved"], totals["dropped_tokens"]) == (0, 0)
    assert totals["spilled_tokens"] == 2 * TURN + 32 and s.cache.controller.staging.used_bytes == STAGING
    held.release()
    s.cache.controller.wait_writes()
    s.cache.check_integrity()


@pytest.mark.parametrize(
    "tokens, background, wanted, refused, counter",
    [
        (8, False, 96, Refused.RESERVED, "spills_refused_reserved"),  # fits, but in the read's room
        (8, False, 0, None, None),  # no restore waits
        (8, False, None, None, None),  # restore_reserve off
        (8, False, 32, None, None),  # leaves the read's room: taken while it waits
        (8, True, 32, None, None),
        # fits by bytes (10 KiB of the 12 not kept), but the write's 9 KiB hold 12 KiB of blocks:
        # its 4 KiB block would leave no 8 KiB one for the read
        (8, False, 64, Refused.RESERVED, "spills_refused_reserved"),
        (8, True, 64, Refused.DEFERRED, "writes_through_deferred"),
        (96, False, 96, Refused.STAGING_FULL, "spills_refused_staging_full"),  # refused anyway
        (200, False, 96, Refused.TOO_LARGE, "spills_refused_too_large"),
        (8, True, 96, Refused.DEFERRED, "writes_through_deferred"),  # within its share, in the room
        (8, True, 0, None, None),
        (96, True, 96, Refused.TOO_LARGE_FOR_SHARE, "writes_through_too_large"),
    ],
)
def test_what_a_store_may_take_while_a_read_waits(
    make_stack: Any, tokens: int, background: bool, wanted: int | None, refused: Refused | None,
    counter: str | None,
) -> None:  # fmt: skip
    """Staging of 20 KiB, 9 KiB held by a write (in 12 KiB of 4 KiB blocks); a restore waits for a
    read of `wanted` tokens (96: 12 KiB, which does not fit beside it; 64: 8 KiB, which does; 32). A store is refused for the reservation only where
    its own limit would have taken it (counted apart), and counted as before otherwise."""
    view = make_stack().cache.controller.view
    metrics, staging = SpillMetrics(), StagingPool(STAGING)
    share = StagingShare(view, metrics, None if wanted is None else lambda: packed_nbytes(view, wanted))
    assert staging.acquire(packed_nbytes(view, 72)) is not None
    used = staging.used_bytes
    got = share.take(staging, tokens, background)
    if refused is None:
        assert isinstance(got, torch.Tensor) and staging.used_bytes == used + packed_nbytes(view, tokens)
    else:
        assert got is refused and staging.used_bytes == used
        assert {n for n, v in metrics.totals.items() if v} == {counter}
    if background:  # what clean-ahead asks before a write-ahead says the same
        if isinstance(got, torch.Tensor):
            staging.release(got)
        assert share.background_fit(staging, tokens) is refused


def test_tp_ranks_whose_restore_waits_on_one_only_keep_equal_trees(
    two_ranks: Callable[..., TwoRanks], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's restore waits for room (its writes held), rank 1's read starts: the same eviction
    is refused for the reservation on rank 0 and spilled on rank 1; the eviction's agreement drops
    it on both, so their trees stay equal, and the restore is exact on both once writes finish."""
    from sgl_hicache.cache.warm_start import tree_digest

    ranks = two_ranks(size=1024, restore_reserve=True)
    for s in ranks.stacks:  # HISTORY on both tiers (one rank each: nothing to agree yet)
        s.insert(HISTORY)
        s.evict_all()
    shrink_staging(ranks.stacks[0], STAGING)
    held = HeldWrites(monkeypatch, ranks.stacks[0].cache.controller.tier)
    evicted = turn(3000, 16)

    def work(r: int, s: Stack) -> list[Any]:
        for base in (1000, 2000):
            s.insert(turn(base))
        s.cache.evict(EvictParams(num_tokens=10**9))  # rank 0: its 16 KiB of writes held
        if r == 0:
            held.wait(s, 2)
        params = admission(s, HISTORY, "r")
        assert s.cache.init_load_back(params) is None  # agreed: rank 0's read waits
        s.insert(evicted)
        s.cache.evict(EvictParams(num_tokens=10**9))  # the restore's slots, then `evicted`
        spilled = (s.match(evicted).host_hit_length, tree_digest(s.cache.root_node))
        if r == 0:
            held.release()
        loaded, last = s.load_back(s.match(HISTORY), rid="r")
        return [spilled, (loaded, read_kv(s.pool, last.value), tree_digest(s.cache.root_node))]

    record = ranks.run(work)  # equal on both ranks
    assert record[0][0] == 0, "the evicted node was dropped on both ranks"
    assert record[1][:2] == (TURN, expected_kv(HISTORY))
    totals = [s.metrics.totals for s in ranks.stacks]
    assert (totals[0]["spills_refused_reserved"], totals[1]["spills_refused_reserved"]) == (1, 0)
    assert totals[1]["tp_disagreements"] >= 1, "rank 1 spilled it and had to drop it"


def test_the_room_kept_is_counted_in_the_blocks_staging_hands_out(
    make_stack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Staging hands out whole 4 KiB blocks: two 40-token spills (5 KiB each, an 8 KiB block each)
    leave 10 KiB of the 20 free by bytes, more than the 8 KiB read, but one 4 KiB block. The
    second is refused, so the read starts at its next try."""
    s, held, params = waiting_restore(make_stack, monkeypatch)
    ctl, totals = s.cache.controller, s.metrics.totals
    held.release()  # both writes done (their staging back) before the restore is tried again
    ctl.poll()
    assert ctl.staging.used_bytes == 0 and ctl.reads.room_wanted
    for base in (3000, 4000):
        s.insert(turn(base, 40))
    s.cache.evict(EvictParams(num_tokens=10**9))
    assert totals["spills_refused_reserved"] == 1 and totals["spilled_tokens"] == 3 * TURN + 40
    assert s.cache.init_load_back(params) is None  # its read starts now
    assert not ctl.reads.room_wanted, "the read found its room"
    held.release()
    loaded, last = admit_all(s, {"r": params})["r"]
    assert loaded == TURN and read_kv(s.pool, last.value) == expected_kv(HISTORY)
    held.release()
    ctl.wait_writes()
    s.cache.check_integrity()


def test_the_room_of_a_restore_whose_request_went_away_is_kept_no_longer_than_a_restore_waits(
    make_stack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request of a waiting restore is never tried again (aborted, or its chain changed): no
    restore can want its room once it would have given up (here the timeout policy's 0.2 s), so
    the next eviction's spill takes it, not only after prefetch_ttl_s (30 s)."""
    from sgl_hicache.config import PrefetchPolicy

    s, held, _ = waiting_restore(
        make_stack, monkeypatch, prefetch_policy=PrefetchPolicy.TIMEOUT, prefetch_timeout_s=0.2
    )
    ctl, totals = s.cache.controller, s.metrics.totals
    held.release(1)  # 8 KiB back: the room the read waited for
    threading.Event().wait(0.3)
    ctl.poll()
    evicted = turn(3000)
    s.insert(evicted)
    s.cache.evict(EvictParams(num_tokens=10**9))
    assert totals["spills_refused_reserved"] == 0 and totals["spilled_tokens"] == 4 * TURN
    assert s.match(evicted).host_hit_length == TURN
    held.release()
    ctl.wait_writes()
    s.cache.check_integrity()


def test_a_pinned_victim_is_spilled_into_the_room_a_waiting_read_needs(
    make_stack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pin promises that eviction spills its conversation rather than drop it, where it can be
    written: the reservation does not drop it (the read waits on for the next write to finish)."""
    from sgl_hicache.cache.hint_source import RetentionHint

    s, held, params = waiting_restore(make_stack, monkeypatch)
    ctl, totals = s.cache.controller, s.metrics.totals
    held.release(1)
    ctl.poll()
    pinned = turn(3000)
    s.insert(pinned)
    s.cache.retention.apply(RetentionHint("pin", pinned, None, None, 60.0))
    s.cache.evict(EvictParams(num_tokens=10**9))
    assert totals["spills_refused_reserved"] == 0 and totals["pinned_spilled_tokens"] == TURN
    assert s.match(pinned).host_hit_length == TURN, "spilled, not dropped"
    held.release()
    loaded, last = admit_all(s, {"r": params})["r"]
    assert loaded == TURN and read_kv(s.pool, last.value) == expected_kv(HISTORY)
    held.release()
    ctl.wait_writes()
    s.cache.check_integrity()


def test_a_victim_whose_children_are_spilled_is_spilled_into_the_room_not_dropped_with_them(
    make_stack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another conversation's last turn is spilled, its first still resident: evicting the first
    while a restore waits spills it (dropping it would drop its spilled turn with it, KV written
    to the tier and lost to every later restore), and both restores are exact."""
    s = make_stack(size=1024, restore_reserve=True)
    s.insert(HISTORY)
    s.evict_all()
    first, other = turn(5000), turn(5000) + turn(6000)
    s.insert(first)
    s.insert(other)
    s.cache.evict(EvictParams(num_tokens=TURN))  # its last turn, the only leaf
    s.cache.controller.wait_writes()
    assert s.match(other).host_hit_length == TURN
    shrink_staging(s, STAGING)
    held = HeldWrites(monkeypatch, s.cache.controller.tier)
    anchor = s.match(first).last_device_node
    s.cache.inc_lock_ref(anchor)  # not a victim yet
    for base in (1000, 2000):
        s.insert(turn(base))
    s.cache.evict(EvictParams(num_tokens=10**9))
    s.cache.dec_lock_ref(anchor)
    held.wait(s, 2)
    params = admission(s, HISTORY, "r")
    assert s.cache.init_load_back(params) is None and s.cache.controller.reads.room_wanted
    held.release(1)
    s.cache.controller.poll()
    s.cache.evict(EvictParams(num_tokens=10**9))  # the first turn: its spill takes the read's room
    totals = s.metrics.totals
    assert totals["spills_refused_reserved"] == 0 and s.metrics.drops[DropReason.STAGING_FULL] == 0
    assert s.match(other).host_hit_length == 2 * TURN, "both turns on the tier"
    held.release()
    loaded, last = admit_all(s, {"r": params})["r"]
    assert loaded == TURN and read_kv(s.pool, last.value) == expected_kv(HISTORY)
    held.release()
    s.cache.controller.wait_writes()
    loaded, last = s.load_back(s.match(other), rid="o")
    assert loaded == 2 * TURN and resident(s, other) == expected_kv(other)
    s.cache.check_integrity()


@pytest.mark.parametrize("yields", [True, False], ids=["yields", "pinned"])
def test_a_spill_that_does_not_yield_takes_back_reads_while_a_restore_waits(
    make_stack: Any, yields: bool
) -> None:
    """With a restore waiting for room, a spill that yields to it takes no reads back (the room
    given back is the restore's first); one whose drop would lose more than itself (a pinned
    conversation, spilled children) does."""
    view = make_stack().cache.controller.view
    staging = StagingPool(STAGING)
    asked: list[int] = []

    def take_back(pool: StagingPool, nbytes: int) -> torch.Tensor | None:
        asked.append(nbytes)
        return None

    share = StagingShare(view, SpillMetrics(), lambda: packed_nbytes(view, 32), take_back)
    assert staging.acquire(packed_nbytes(view, 150)) is not None  # 18.75 of 20 KiB
    got = share.take(staging, TURN, yields=yields)
    assert got is Refused.STAGING_FULL
    assert asked == ([] if yields else [packed_nbytes(view, TURN)])
