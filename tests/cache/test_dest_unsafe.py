"""A read whose transfer the tier gave up on may still write its staging block after its completion
(`Completion.dest_unsafe`: a Mooncake transfer past its timeout lands late). That block is set aside
for good: never handed to another read or a spill's pack (a late write there would change bytes
after they were verified or packed: wrong KV), counted in `staging_spoiled_bytes`, and staging is
that much smaller. The restore recomputes; later restores through staging stay exact while the late
write lands. With TP > 1 each rank sets aside its own block, and the ranks still agree."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from sgl_hicache.cache.staging import StagingPool
from sgl_hicache.tier import Status
from tests.cache.conftest import Stack, TwoRanks, expected_kv, read_kv
from tests.cache.test_ordering import reads_ready

A = list(range(100, 164))  # 64 tokens
B = list(range(2000, 2064))


class GaveUp:
    """A tier whose next load fails IO_ERROR, `dest_unsafe` (the store gave up on its transfer) or
    not (`unsafe` False: it ended), nothing of it shown by `landed`; `dest`: that load's
    destination, which the test writes late."""

    def __init__(self, inner: Any, unsafe: bool = True) -> None:
        self.inner, self.unsafe = inner, unsafe
        self.ticket: Any = None
        self.dest: np.ndarray | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def submit_load(self, key: Any, dest: Any, *args: Any, **kw: Any) -> Any:
        ticket = self.inner.submit_load(key, dest, *args, **kw)
        if self.ticket is None:
            self.ticket, self.dest = ticket, dest
        return ticket

    def landed(self, ticket: Any) -> int:
        return 0 if ticket == self.ticket else int(self.inner.landed(ticket))

    def get_finished(self) -> list[Any]:
        return [self._gave_up(c) if c.ticket == self.ticket else c for c in self.inner.get_finished()]

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
