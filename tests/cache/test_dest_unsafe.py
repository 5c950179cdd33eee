"""A read whose transfer the tier gave up on may still write its staging block after its completion
(`Completion.dest_unsafe`: a Mooncake transfer past its timeout lands late). That block is set aside
for good: never handed to another read or a spill's pack (a late write there would change bytes
after they were verified or packed: wrong KV), counted in `staging_spoiled_bytes`, and staging is
that much smaller. The restore recomputes; later restores through staging stay exact while the late
write lands. With TP > 1 each rank sets aside its own block, and the ranks still agree. The same
holds wherever the cache gave the read up before, or as, its completion arrives: at its time to live,
at a flush, after spill was disabled, replaced by a longer read, finished by a restore that gave up
waiting, or with a failed layer-wise restore."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from sgl_hicache.cache.staging import StagingPool
from sgl_hicache.tier import Status
from tests.cache.conftest import Stack, TwoRanks, expected_kv, read_kv
from tests.cache.test_ordering import reads_ready

A = list(range(100, 164))  # 64 tokens
B = list(range(2000, 2064))


class GaveUp:
    """A tier whose next load fails IO_ERROR, `dest_unsafe` (the store gave up on its transfer) or
    not (`unsafe` False: it ended); `dest`: that load's destination, which the test writes late.
    `held`: its completion is kept back from `get_finished` until `release` (the cache may give the
    read up meanwhile); `shown`: the share of its bytes `landed` shows verified once the wrapped
    tier has read them (0: none; 0.5: the first of two layer groups, so a layer-wise restore may
    start from it)."""

    def __init__(self, inner: Any, unsafe: bool = True, held: bool = False, shown: float = 0.0) -> None:
        self.inner, self.unsafe, self.held, self.shown = inner, unsafe, held, shown
        self.ticket: Any = None
        self.dest: np.ndarray | None = None
        self.read = False  # the wrapped tier has read it (its completion taken)
        self.kept: list[Any] = []  # its completion, held back

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def release(self) -> None:
        """Post its completion from now (the next `get_finished`)."""
        self.held = False

    def submit_load(self, key: Any, dest: Any, *args: Any, **kw: Any) -> Any:
        ticket = self.inner.submit_load(key, dest, *args, **kw)
        if self.ticket is None:
            self.ticket, self.dest = ticket, dest
        return ticket

    def landed(self, ticket: Any) -> int:
        if ticket != self.ticket:
            return int(self.inner.landed(ticket))
        assert self.dest is not None
        return int(self.shown * self.dest.nbytes) if self.read else 0

    def get_finished(self) -> list[Any]:
        done = []
        for c in self.inner.get_finished():
            if c.ticket == self.ticket:
                self.read = True
                self.kept.append(self._gave_up(c))
            else:
                done.append(c)
        if not self.held:
            done, self.kept = done + self.kept, []
        return done

    def _gave_up(self, c: Any) -> Any:
        return replace(c, status=Status.IO_ERROR, nbytes=0, detail="transfer failed", dest_unsafe=self.unsafe)


def handed_out(staging: StagingPool) -> list[tuple[int, int]]:
    """Every block `staging` hands out from now: (address, bytes)."""
    blocks: list[tuple[int, int]] = []
    acquire = staging.acquire

    def recorded(nbytes: int, limit_bytes: int | None = None) -> torch.Tensor | None:
        buf = acquire(nbytes, limit_bytes)
        if buf is not None and buf.numel():
            blocks.append((buf.data_ptr(), buf.numel()))
        return buf

    staging.acquire = recorded  # type: ignore[method-assign]
    return blocks


def overlaps(blocks: list[tuple[int, int]], dest: np.ndarray) -> bool:
    start = dest.ctypes.data
    return any(at < start + dest.nbytes and start < at + n for at, n in blocks)


def fail_a_restore(s: Stack, unsafe: bool = True) -> tuple[GaveUp, int]:
    """A spilled, its restore's read failing (`dest_unsafe` if `unsafe`): recomputed. The tier
    wrapper, and the staging capacity before."""
    s.insert(A)
    s.evict_all()  # A is on the tier only; staging all free
    ctl = s.cache.controller
    tier = ctl.tier = GaveUp(ctl.tier, unsafe)
    capacity = ctl.staging.capacity_bytes
    m = s.match(A)
    assert m.host_hit_length == len(A)
    loaded, _ = s.load_back(m)
    assert loaded == 0, "the failed read recomputes"
    return tier, capacity


def restore_b_while_the_late_write_lands(s: Stack, tier: GaveUp) -> list[int]:
    """B spilled and read back through staging; the late write lands once B's bytes are verified in
    staging, before they are unpacked. B's KV as restored."""
    s.insert(B)
    s.evict_all()
    m = reads_ready(s, B)
    assert tier.dest is not None
    tier.dest[:] = 0x55  # the transfer the store gave up on lands now
    loaded, node = s.load_back(m)
    assert loaded == len(B)
    return read_kv(s.pool, node.value)


def test_a_read_whose_transfer_may_still_write_its_block_never_gives_it_back(
    make_stack: Callable[..., Stack],
) -> None:
    s = make_stack(size=256)
    blocks = handed_out(s.cache.controller.staging)
    tier, capacity = fail_a_restore(s)
    ctl = s.cache.controller
    assert tier.dest is not None and overlaps(blocks, tier.dest), "A's read took a block of staging"
    assert ctl.staging.used_bytes == 0, "the failed restore let go of its read"
    spoiled = StagingPool.block_bytes(tier.dest.nbytes)
    assert s.metrics.totals["staging_spoiled_bytes"] == spoiled
    assert ctl.staging.capacity_bytes == capacity - spoiled
    assert s.metrics.totals["restore_failures"] == 1
    s.cache.check_integrity()

    blocks.clear()
    assert restore_b_while_the_late_write_lands(s, tier) == expected_kv(B)
    assert blocks and not overlaps(blocks, tier.dest), "the set-aside block was handed out again"
    assert s.metrics.totals["staging_spoiled_bytes"] == spoiled
    s.cache.check_integrity()


def test_a_failed_read_whose_transfer_ended_gives_its_block_back(make_stack: Callable[..., Stack]) -> None:
    """The same failure without `dest_unsafe` (a file tier's, a missing object): its block is reused."""
    s = make_stack(size=256)
    blocks = handed_out(s.cache.controller.staging)
    tier, capacity = fail_a_restore(s, unsafe=False)
    assert s.metrics.totals["staging_spoiled_bytes"] == 0
    assert s.cache.controller.staging.capacity_bytes == capacity
    blocks.clear()
    s.insert(B)
    s.evict_all()
    assert tier.dest is not None and overlaps(blocks, tier.dest), "first fit takes the block given back"


def test_tp_ranks_where_one_sets_a_block_aside_keep_equal_trees_and_exact_kv(
    two_ranks: Callable[..., TwoRanks],
) -> None:
    """Rank 0's read fails `dest_unsafe`, rank 1's is fine: both recompute (agreed), only rank 0's
    staging shrinks, and B is then restored exact on both, the trees equal."""
    from sgl_hicache.cache.warm_start import tree_digest

    ranks = two_ranks(size=256)
    tiers: list[GaveUp | None] = [None, None]

    def work(r: int, s: Stack) -> list[Any]:
        s.insert(A)
        s.evict_all()
        if r == 0:
            tier = tiers[0] = GaveUp(s.cache.controller.tier)
            s.cache.controller.tier = tier
        loaded, _ = s.load_back(s.match(A))
        first = (loaded, tree_digest(s.cache.root_node))
        s.insert(B)
        s.evict_all()
        m = reads_ready(s, B)
        if r == 0:
            assert tiers[0] is not None and tiers[0].dest is not None
            tiers[0].dest[:] = 0x55  # the late write
        loaded, node = s.load_back(m)
        return [first, (loaded, read_kv(s.pool, node.value), tree_digest(s.cache.root_node))]

    record = ranks.run(work)  # equal on both ranks
    assert record[0][0] == 0, "both ranks recomputed A"
    assert record[1][:2] == (len(B), expected_kv(B))
    spoiled = [s.metrics.totals["staging_spoiled_bytes"] for s in ranks.stacks]
    assert spoiled[0] > 0 and spoiled[1] == 0


def test_an_error_is_logged_once_when_a_quarter_of_staging_is_set_aside(caplog: Any) -> None:
    """Blocks set aside never come back while the server lives: past a quarter of staging an error
    says so (once), beside the first warning (once); what is left is staging's capacity."""
    import logging

    from sgl_hicache.cache.metrics import SpillMetrics
    from sgl_hicache.cache.retiring import Retiring

    page = StagingPool.block_bytes(1)
    staging = StagingPool(8 * page)
    retiring = Retiring(staging, SpillMetrics())
    blocks = [staging.acquire(page) for _ in range(4)]
    with caplog.at_level(logging.WARNING, logger="sgl_hicache"):
        for i, buf in enumerate(blocks):
            assert buf is not None
            retiring.spoil(buf)
            errors = [r for r in caplog.records if r.levelno == logging.ERROR]
            assert len(errors) == (1 if i >= 2 else 0), (i, errors)  # 3 of 8 pages: past a quarter
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert staging.capacity_bytes == 4 * page and staging.spoiled_bytes == 4 * page
    staging.check_integrity()


# ---- the read given up by the cache before (or as) its `dest_unsafe` completion arrives ------------
# Every give-up ends in `ExtentReads._abandon`: a read whose completion was taken goes at once
# (`_give_back`), one still in flight once its completion arrives (`completed`). "before": the
# completion was taken while the cache still kept the read; "after": it arrives once the read was
# given up, the block held by the transfer meanwhile.

ARRIVALS = ["before", "after"]


def take_completions(s: Stack, ctl: Any = None) -> None:
    """The scheduler's polls until every read's completion is taken."""
    ctl = ctl or s.cache.controller
    deadline = time.monotonic() + 10
    s.cache.poll()
    while ctl.reads.in_flight:
        assert time.monotonic() < deadline, "a read's completion never came"
        time.sleep(0.005)
        s.cache.poll()


def ttl_passes(s: Stack, ctl: Any = None) -> None:
    """Every read outlives its time to live: the scheduler's next poll expires them (`expire`)."""
    reads = (ctl or s.cache.controller).reads
    ttl, reads.ttl_s = reads.ttl_s, 0.001
    try:
        time.sleep(0.01)
        s.cache.poll()
    finally:
        reads.ttl_s = ttl


def spilled_a(s: Stack, arrives: str, **gave_up: Any) -> tuple[GaveUp, int, list[tuple[int, int]]]:
    """A spilled, its next load failing `dest_unsafe`, its completion held if it `arrives` after the
    give-up. The tier wrapper, staging's capacity before, and the blocks staging hands out."""
    s.insert(A)
    s.evict_all()
    ctl = s.cache.controller
    blocks = handed_out(ctl.staging)
    tier = ctl.tier = GaveUp(ctl.tier, held=arrives == "after", **gave_up)
    return tier, ctl.staging.capacity_bytes, blocks


def completion_arrives_late(s: Stack, tier: GaveUp) -> None:
    """The read was given up before its completion: the block stays the transfer's until the
    completion, held back till now, arrives and is taken."""
    assert_held_by_the_transfer(s, tier)
    tier.release()
    take_completions(s)


def assert_held_by_the_transfer(s: Stack, tier: GaveUp, ctl: Any = None) -> None:
    """Given up, its completion due but held back (the scheduler polls meanwhile): the block stays
    the transfer's, neither back nor set aside."""
    ctl = ctl or s.cache.controller
    deadline = time.monotonic() + 10
    while not tier.kept:
        assert time.monotonic() < deadline, "the load never ended"
        time.sleep(0.005)
        s.cache.poll()
    assert tier.dest is not None
    assert ctl.staging.used_bytes == tier.dest.nbytes, "given back before its transfer ended"
    assert s.metrics.totals["staging_spoiled_bytes"] == 0


def assert_set_aside(s: Stack, tier: GaveUp, capacity: int, blocks: list[tuple[int, int]]) -> None:
    """The load's block is set aside: counted, page-rounded, staging that much smaller; it is never
    handed out again while B is restored through staging, exact, as the late write lands."""
    ctl = s.cache.controller
    assert tier.dest is not None and overlaps(blocks, tier.dest), "the load took a block of staging"
    spoiled = StagingPool.block_bytes(tier.dest.nbytes)
    assert s.metrics.totals["staging_spoiled_bytes"] == spoiled
    assert ctl.staging.capacity_bytes == capacity - spoiled
    assert ctl.staging.used_bytes == 0
    s.cache.check_integrity()
    blocks.clear()
    assert restore_b_while_the_late_write_lands(s, tier) == expected_kv(B)
    assert blocks and not overlaps(blocks, tier.dest), "the set-aside block was handed out again"
    assert s.metrics.totals["staging_spoiled_bytes"] == spoiled
    s.cache.check_integrity()


@pytest.mark.parametrize("arrives", ARRIVALS)
def test_a_prefetch_given_up_at_its_ttl_sets_its_block_aside(
    make_stack: Callable[..., Stack], arrives: str
) -> None:
    """A prefetch nobody restores: `expire` gives its read up after its time to live."""
    s = make_stack(size=256)
    tier, capacity, blocks = spilled_a(s, arrives)
    assert s.cache.prefetch(A) == len(A)
    if arrives == "before":
        take_completions(s)  # failed: kept for a restore until its time to live
        assert s.metrics.totals["staging_spoiled_bytes"] == 0
    ttl_passes(s)
    assert s.metrics.totals["prefetch_abandoned"] == 1
    if arrives == "after":
        completion_arrives_late(s, tier)
    assert_set_aside(s, tier, capacity, blocks)


@pytest.mark.parametrize("arrives", ARRIVALS)
def test_a_read_given_up_by_a_flush_sets_its_block_aside(
    make_stack: Callable[..., Stack], arrives: str
) -> None:
    """sglang's flush (`reset`): `ExtentReads.clear` gives up every read."""
    s = make_stack(size=256)
    tier, capacity, blocks = spilled_a(s, arrives)
    assert s.cache.prefetch(A) == len(A)
    if arrives == "before":
        take_completions(s)
    s.cache.reset()
    s.allocator.clear()  # what sglang does after a flush
    assert s.metrics.totals["flushes"] == 1
    if arrives == "after":
        completion_arrives_late(s, tier)
    assert s.match(A).host_hit_length == 0
    assert_set_aside(s, tier, capacity, blocks)


def test_a_read_left_when_spill_is_disabled_sets_its_block_aside_at_its_ttl(
    make_stack: Callable[..., Stack],
) -> None:
    """`disable_spill` gives no read up (it frees the restores' slots only): the controller's poll
    (`io_to_close`) still takes the completion and expires the read after its time to live. Nothing
    spills or restores after it, so nothing could take the block again."""
    s = make_stack(size=256)
    tier, capacity, _ = spilled_a(s, "after")
    ctl = s.cache.controller
    assert s.cache.prefetch(A) == len(A)
    s.cache.disable_spill()
    assert_held_by_the_transfer(s, tier, ctl)
    tier.release()
    take_completions(s, ctl)  # failed, still kept until its time to live
    assert s.metrics.totals["staging_spoiled_bytes"] == 0 and ctl.staging.used_bytes > 0
    ttl_passes(s, ctl)
    assert tier.dest is not None
    spoiled = StagingPool.block_bytes(tier.dest.nbytes)
    assert s.metrics.totals["staging_spoiled_bytes"] == spoiled
    assert ctl.staging.capacity_bytes == capacity - spoiled and ctl.staging.used_bytes == 0
    ctl.check_integrity()
    s.cache.check_integrity()


@pytest.mark.parametrize("arrives", ARRIVALS)
def test_a_shorter_read_replaced_by_a_restores_longer_one_sets_its_block_aside(
    make_stack: Callable[..., Stack], arrives: str
) -> None:
    """A prefetch of A's first half reads that much of A's extent; A's restore needs all of it: a
    longer read replaces the shorter one (`start` → `_abandon`), and the restore is exact."""
    s = make_stack(size=256)
    tier, capacity, blocks = spilled_a(s, arrives)
    half = len(A) // 2
    assert s.cache.prefetch(A[:half]) == half  # splits A's node: its head's read
    if arrives == "before":
        take_completions(s)
    loaded, node = s.load_back(s.match(A))
    assert loaded == len(A) and read_kv(s.pool, s.cache.path_device_indices(node)) == expected_kv(A)
    assert tier.dest is not None and tier.dest.nbytes < s.metrics.totals["restored_bytes"]
    if arrives == "after":
        completion_arrives_late(s, tier)
    s.evict_all()  # A back on the tier only, so that B's restore has the pool's room
    assert_set_aside(s, tier, capacity, blocks)


def test_a_read_finished_by_a_restore_that_gave_up_waiting_sets_its_block_aside(
    make_stack: Callable[..., Stack],
) -> None:
    """A restore that may not wait (best effort) recomputes and gives its read up in flight
    (`finish_reads` → `finish_extent`); the read's transfer then ends `dest_unsafe`. (A completion
    taken before the restore asks is the restore's own failure: the first test.)"""
    from sgl_hicache.config import PrefetchPolicy

    s = make_stack(size=256, prefetch_policy=PrefetchPolicy.BEST_EFFORT)
    tier, capacity, blocks = spilled_a(s, "after")
    loaded, _ = s.load_back(s.match(A))
    assert loaded == 0 and s.metrics.totals["restores_too_late"] == 1
    completion_arrives_late(s, tier)
    assert_set_aside(s, tier, capacity, blocks)


@pytest.mark.parametrize("arrives", ["during", "after"])
def test_a_failed_layerwise_restore_sets_its_reads_block_aside(
    make_stack: Callable[..., Stack], arrives: str
) -> None:
    """A layer-wise restore admitted on A's first layer group fails (`_failed_one` →
    `finish_reads`): "during", the read's `dest_unsafe` completion comes while it lands (the
    scheduler's poll finds the read failed); "after", the second group never lands by the
    restore's deadline and the completion comes once the restore has failed."""
    from tests.cache.test_layerwise_review import admit

    s = make_stack(size=256, layerwise_restore=True)
    assert s.cache.controller.layout.count == 2
    tier, capacity, blocks = spilled_a(s, "after", shown=0.5)  # the first of two groups
    if arrives == "after":
        s.cache.layerwise.timeout_s = 0.3  # the I/O timeout in a test's time
    (loaded, _), req = admit(s, A, "layerwise")
    assert loaded == len(A) and len(s.cache.layerwise.active) == 1, "not admitted layer-wise"
    if arrives == "during":
        tier.release()
        s.cache.poll()
    assert s.cache.after_forward([req]) == [req]
    totals = s.metrics.totals
    assert totals["layerwise_failed_restores"] == 1
    assert totals["restores_too_late"] == int(arrives == "after")
    s.cache.dec_lock_ref(req.last_node)  # the retraction releases the request's lock
    s.cache.drop_failed_layerwise()
    if arrives == "after":
        completion_arrives_late(s, tier)
    assert_set_aside(s, tier, capacity, blocks)
