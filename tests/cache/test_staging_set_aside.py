"""Staging set aside for good (`StagingPool.spoil`: a tier read's transfer may still write its
block) leaves the arena in runs between those blocks. What is larger than the longest run can never
start there: a spill of it is refused as too large (not "staging full", a moment's wait), and a
restore needing such a read recomputes at once (not after waiting for room that never comes)."""

from __future__ import annotations

from collections.abc import Callable

from sgl_hicache_kernels import packed_nbytes

from sgl_hicache.cache.metrics import SpillMetrics
from sgl_hicache.cache.staging import StagingPool
from sgl_hicache.cache.staging_share import Refused, StagingShare
from tests.cache.conftest import Stack, shrink_staging

PAGE = StagingPool.block_bytes(1)
A = list(range(100, 164))  # 64 tokens


def split_by_a_block_set_aside(staging: StagingPool) -> None:
    """Of 8 pages, page 3 set aside: runs of 3 and 4 pages."""
    blocks = [staging.acquire(PAGE) for _ in range(8)]
    assert all(b is not None for b in blocks)
    staging.spoil(blocks[3])  # type: ignore[arg-type]
    for b in blocks[:3] + blocks[4:]:
        staging.release(b)  # type: ignore[arg-type]


def tokens_over(view: object, nbytes: int) -> int:
    """The fewest tokens whose packed KV is larger than `nbytes`."""
    tokens = 1
    while packed_nbytes(view, tokens) <= nbytes:  # type: ignore[arg-type]
        tokens += 1
    return tokens


def test_the_largest_block_is_the_longest_run_between_blocks_set_aside() -> None:
    staging = StagingPool(8 * PAGE)
    assert staging.largest_bytes == 8 * PAGE
    split_by_a_block_set_aside(staging)
    assert staging.largest_bytes == 4 * PAGE and staging.capacity_bytes == 7 * PAGE
    assert staging.acquire(4 * PAGE + 1) is None
    assert staging.acquire(4 * PAGE) is not None
    staging.check_integrity()


def test_the_longest_run_counts_the_ends_adjacent_blocks_and_a_capacity_of_part_pages() -> None:
    """Blocks set aside at either end and side by side; a capacity that is not whole pages caps the
    run that holds its last part page."""
    staging = StagingPool(8 * PAGE - 100)
    blocks = [*(staging.acquire(PAGE) for _ in range(7)), staging.acquire(PAGE - 100)]
    assert all(b is not None for b in blocks)
    staging.spoil(blocks[0])  # type: ignore[arg-type]
    for b in blocks[1:]:
        staging.release(b)  # type: ignore[arg-type]
    assert staging.largest_bytes == staging.capacity_bytes == 7 * PAGE - 100
    staging = StagingPool(8 * PAGE)
    blocks = [staging.acquire(PAGE) for _ in range(8)]
    for i in (2, 3, 7):
        staging.spoil(blocks[i])  # type: ignore[arg-type]
    for i in (0, 1, 4, 5, 6):
        staging.release(blocks[i])  # type: ignore[arg-type]
    assert staging.largest_bytes == 3 * PAGE  # pages 4-6; 0-1 is 2 pages, 2-3 and 7 set aside
    staging.check_integrity()


def test_a_write_through_larger_than_the_longest_run_is_too_large_for_its_share_not_deferred(
    make_stack: Callable[..., Stack],
) -> None:
    """A background store (its share: half of staging) that fits its share but no run left is never
    going to start: TOO_LARGE_FOR_SHARE (clean-ahead skips it) rather than DEFERRED for ever."""
    view = make_stack().cache.controller.view
    metrics, staging = SpillMetrics(), StagingPool(16 * PAGE)
    blocks = [staging.acquire(PAGE) for _ in range(16)]
    for i in (3, 7, 11):  # runs of 3, 3, 3 and 4 pages
        staging.spoil(blocks[i])  # type: ignore[arg-type]
    for i, b in enumerate(blocks):
        if i not in (3, 7, 11):
            staging.release(b)  # type: ignore[arg-type]
    share = StagingShare(view, metrics, None)
    tokens = tokens_over(view, 4 * PAGE)
    assert packed_nbytes(view, tokens) <= share.background_limit(staging), "it fits its share"
    assert share.background_fit(staging, tokens) is Refused.TOO_LARGE_FOR_SHARE
    assert share.take(staging, tokens, True) is Refused.TOO_LARGE_FOR_SHARE
    assert metrics.totals["writes_through_deferred"] == 0


def test_a_spill_larger_than_the_longest_run_is_too_large_not_staging_full(
    make_stack: Callable[..., Stack],
) -> None:
    view = make_stack().cache.controller.view
    metrics, staging = SpillMetrics(), StagingPool(8 * PAGE)
    split_by_a_block_set_aside(staging)
    tokens = tokens_over(view, 4 * PAGE)
    assert packed_nbytes(view, tokens) <= staging.capacity_bytes, "fits all of staging left, not one run"
    got = StagingShare(view, metrics, None).take(staging, tokens, False)
    assert got is Refused.TOO_LARGE
    assert metrics.totals["spills_refused_too_large"] == 1
    assert metrics.totals["spills_refused_staging_full"] == 0


def test_a_restore_needing_more_than_the_longest_run_recomputes_at_once(
    make_stack: Callable[..., Stack],
) -> None:
    s = make_stack(size=256)
    s.insert(A)
    s.evict_all()  # A on the tier only
    ctl = s.cache.controller
    nbytes = packed_nbytes(ctl.view, len(A))
    runs = -(-nbytes // PAGE)  # A's read in pages: staging of 2 runs of that less one page
    shrink_staging(s, (2 * runs - 1) * PAGE)
    blocks = [ctl.staging.acquire(PAGE) for _ in range(2 * runs - 1)]
    ctl.retiring.spoil(blocks[runs - 1])  # type: ignore[arg-type]
    for b in blocks[: runs - 1] + blocks[runs:]:
        ctl.staging.release(b)  # type: ignore[arg-type]
    assert ctl.staging.largest_bytes < nbytes <= ctl.staging.capacity_bytes
    m = s.match(A)
    assert m.host_hit_length == len(A)
    loaded, _ = s.load_back(m)
    assert loaded == 0
    assert s.metrics.totals["restores_too_large"] == 1
    assert s.metrics.totals["restore_staging_waits"] == 0, "it never waited for room"
    s.cache.check_integrity()
