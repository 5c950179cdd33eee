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
    assert ctl.staging.largest_bytes < nbytes <= ctl.staging.capacity_bytes + PAGE
    m = s.match(A)
    assert m.host_hit_length == len(A)
    loaded, _ = s.load_back(m)
    assert loaded == 0
    assert s.metrics.totals["restores_too_large"] == 1
    assert s.metrics.totals["restore_staging_waits"] == 0, "it never waited for room"
    s.cache.check_integrity()
