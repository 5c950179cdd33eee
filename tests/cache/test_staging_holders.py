"""Who holds host staging (`SpillController.staging_held`, cache/staging_holders.py): each block in
use counts under what holds it (a write on its way to the tier, a read of a restore in progress,
one a deferred restore asked for, an unconsumed prefetch, an abandoned read), the split sums to
`staging.used_bytes`, and a released block leaves it. Over time (`HeldTime`), each holder's bytes
are integrated into byte-seconds and staging's use into seconds per quarter of its capacity."""

from __future__ import annotations

import time
from typing import Any

import pytest
from sgl_hicache_kernels import packed_nbytes
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from sgl_hicache.cache.metrics import SpillMetrics, StagingHolder
from sgl_hicache.cache.staging_holders import HeldTime, used_band
from tests.cache.test_restore_reserve import HeldWrites

A = list(range(100, 140))
H = StagingHolder


def only(held: dict[StagingHolder, int]) -> dict[StagingHolder, int]:
    """The holders that hold something."""
    return {h: n for h, n in held.items() if n}


def settle_reads(s: Any) -> None:
    ctl, deadline = s.cache.controller, time.monotonic() + 30
    while ctl.reads.in_flight:
        ctl.poll()
        assert time.monotonic() < deadline, "reads still in flight after 30 s"
        time.sleep(0.005)


def spilled(s: Any, tokens: list[int]) -> Any:
    """The refs of `tokens`' spilled node (one extent)."""
    node = s.match(tokens).best_match_node
    assert node.value is None and node.spill is not None
    return (node.spill,)


def test_a_spill_in_flight_is_held_by_its_write(make_stack: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    s = make_stack()
    ctl = s.cache.controller
    held = HeldWrites(monkeypatch, ctl.tier)
    s.insert(A)
    s.cache.evict(EvictParams(num_tokens=10**9))
    held.wait(s, 1)  # written, its completion kept from the cache: staging still held
    assert only(ctl.staging_held()) == {H.WRITE: packed_nbytes(ctl.view, len(A))}
    held.release()
    ctl.poll()
    assert only(ctl.staging_held()) == {} and ctl.staging.used_bytes == 0


def test_an_unconsumed_prefetch_is_held_by_the_prefetch_until_its_ttl(make_stack: Any) -> None:
    s = make_stack()
    s.insert(A)
    s.evict_all()
    ctl = s.cache.controller
    assert s.cache.prefetch(A) == len(A)
    settle_reads(s)  # landed, verified: nobody consumed it
    assert only(ctl.staging_held()) == {H.PREFETCH: packed_nbytes(ctl.view, len(A))}
    ctl.reads.ttl_s = 0.0
    ctl.poll()
    assert s.metrics.totals["prefetch_abandoned"] == 1
    assert only(ctl.staging_held()) == {} and ctl.staging.used_bytes == 0


def test_a_read_is_the_restores_once_it_took_slots_and_leaves_when_finished(make_stack: Any) -> None:
    """A restore attempt that starts a read but is deferred (no slots) holds it as `restore_deferred`;
    once the restore opens (slots taken) the read is `restore`'s; finished, it leaves."""
    s = make_stack()
    s.insert(A)
    s.evict_all()
    ctl, refs = s.cache.controller, spilled(s, A)
    nbytes = packed_nbytes(ctl.view, len(A))
    ctl.readiness(refs)  # starts the read on demand: no prefetch
    settle_reads(s)
    assert only(ctl.staging_held()) == {H.RESTORE_DEFERRED: nbytes}
    slots = s.allocator.alloc(len(A))
    ctl.restores.open("r", refs, slots)
    assert only(ctl.staging_held()) == {H.RESTORE: nbytes}
    assert ctl.complete("r")
    assert only(ctl.staging_held()) == {} and ctl.staging.used_bytes == 0
    ctl.restores.drop("r")


def test_a_prefetch_a_restore_found_is_no_longer_the_prefetchs(make_stack: Any) -> None:
    s = make_stack()
    s.insert(A)
    s.evict_all()
    ctl = s.cache.controller
    s.cache.prefetch(A)
    ctl.readiness(spilled(s, A))  # the request's first admission attempt found the read
    assert set(only(ctl.staging_held())) == {H.RESTORE_DEFERRED}


def test_an_abandoned_read_is_held_until_its_completion_arrives(make_stack: Any) -> None:
    from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier

    s = make_stack()
    s.insert(A)
    s.evict_all()
    ctl = s.cache.controller
    ctl.tier = FaultyTier(ctl.tier, FaultSpec(latency_s=0.3))
    s.cache.prefetch(A)
    ctl.reads.clear()  # a flush while the read is in flight: its buffer goes back once it completes
    assert only(ctl.staging_held()) == {H.ABANDONED: packed_nbytes(ctl.view, len(A))}
    settle_reads(s)
    assert only(ctl.staging_held()) == {} and ctl.staging.used_bytes == 0


def test_the_split_sums_to_staging_in_use(make_stack: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write in flight and a prefetch at once: each under its holder, together all of staging in use."""
    s = make_stack()
    s.insert(A)
    s.evict_all()
    ctl = s.cache.controller
    held = HeldWrites(monkeypatch, ctl.tier)
    s.cache.prefetch(A)
    settle_reads(s)
    s.insert(list(range(500, 520)))
    s.cache.evict(EvictParams(num_tokens=10**9))
    held.wait(s, 1)
    split = only(ctl.staging_held())
    assert split == {H.WRITE: packed_nbytes(ctl.view, 20), H.PREFETCH: packed_nbytes(ctl.view, len(A))}
    assert sum(split.values()) == ctl.staging.used_bytes
    held.release()
    ctl.wait_writes()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_held_time_integrates_each_holders_bytes_and_the_time_per_quarter_of_use() -> None:
    metrics, clock = SpillMetrics(), Clock()
    held_time = HeldTime(metrics, clock)
    clock.now += 2.0
    held_time.add({H.WRITE: 300, H.PREFETCH: 500}, capacity=1000)  # 80% used for 2 s
    clock.now += 3.0
    held_time.add({H.RESTORE: 100}, capacity=1000)  # 10% for 3 s
    assert metrics.held_byte_seconds[H.WRITE] == 600 and metrics.held_byte_seconds[H.PREFETCH] == 1000
    assert metrics.held_byte_seconds[H.RESTORE] == 300
    assert metrics.used_seconds == {"0-25%": 3.0, "25-50%": 0.0, "50-75%": 0.0, "75-100%": 2.0}


@pytest.mark.parametrize(
    ("used", "band"), [(0, "0-25%"), (249, "0-25%"), (250, "25-50%"), (749, "50-75%"), (1000, "75-100%")]
)
def test_used_bands(used: int, band: str) -> None:
    assert used_band(used, 1000) == band


def test_the_controllers_poll_integrates_what_staging_held_since_the_last(
    make_stack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = make_stack()
    ctl = s.cache.controller
    held = HeldWrites(monkeypatch, ctl.tier)
    s.insert(A)
    s.cache.evict(EvictParams(num_tokens=10**9))
    held.wait(s, 1)
    before = s.metrics.held_byte_seconds[H.WRITE]
    time.sleep(0.05)
    ctl.poll()
    grown = s.metrics.held_byte_seconds[H.WRITE] - before
    assert grown >= 0.05 * packed_nbytes(ctl.view, len(A))
    assert s.metrics.held_byte_seconds[H.PREFETCH] == 0
    held.release()
    ctl.wait_writes()
