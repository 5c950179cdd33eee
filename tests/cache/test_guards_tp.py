"""Contained faults on one TP rank only keep the ranks in lockstep (issue 12): the inner steps that
raise (a node's spill, a restore's readiness, a restore's unpack) take their fallback where they
run, so every rank still meets the agreement collectives and all take the same safe decision."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from tests.cache.conftest import build_stack, close_stack, run_ranks
from tests.cache.test_tp_agreement import ThreadedAgreement, conversation_steps, run_rank


def every(n: int, method: Any) -> Any:
    """`method`, raising on every `n`th call instead."""
    calls = itertools.count(1)

    def call(*args: Any, **kwargs: Any) -> Any:
        if next(calls) % n == 0:
            raise RuntimeError("injected on one rank")
        return method(*args, **kwargs)

    return call


def test_faults_contained_on_one_rank_keep_the_ranks_identical(tmp_path: Path) -> None:
    group = ThreadedAgreement.Group(2)
    stacks = [build_stack(tmp_path / f"rank{r}", size=160) for r in range(2)]
    try:
        for rank, stack in enumerate(stacks):
            stack.cache.agreement = ThreadedAgreement(group, rank)
        io = stacks[1].cache.controller
        io.store = every(3, io.store)
        io.complete = every(2, io.complete)
        io.reads.readiness = every(4, io.reads.readiness)
        steps = conversation_steps(7)
        records: list[list[Any]] = [[], []]
        run_ranks(group, lambda r: run_rank(stacks[r], steps, records[r]), timeout_s=300)
        assert records[0] == records[1]
        assert stacks[1].metrics.totals["internal_errors"] > 0 == stacks[0].metrics.totals["internal_errors"]
        assert stacks[0].metrics.totals["restored_tokens"] > 0  # restores still happened
        for stack in stacks:
            stack.cache.controller.wait_writes()
            stack.cache.check_integrity()
    finally:
        for stack in stacks:
            close_stack(stack)


def test_hints_whose_reads_fail_on_one_rank_keep_the_trees_identical(tmp_path: Path) -> None:
    """Each rank applies the same hints in the same iteration (server/hooks.py apply_hints); a hint's
    walk may split nodes, its reads are local I/O. Rank 1's reads failing must not skip the walks
    of the hints after it there (the trees would part, then the evict agreements would pair wrong)."""
    from types import SimpleNamespace

    from sgl_hicache.cache.hint_source import ResumeHint
    from sgl_hicache.server import hooks

    group = ThreadedAgreement.Group(2)
    stacks = [build_stack(tmp_path / f"rank{r}", size=160) for r in range(2)]
    try:
        for rank, stack in enumerate(stacks):
            stack.cache.agreement = ThreadedAgreement(group, rank)
            match = stack.match

            def hinted(
                tokens: list[int], salt: str | None = None, stack: Any = stack, match: Any = match
            ) -> Any:
                hints = [ResumeHint(tokens[: len(tokens) * k // 4], None, None) for k in (1, 2, 3)]
                hooks.apply_hints(SimpleNamespace(tree_cache=stack.cache), [*hints, "a request"])
                return match(tokens, salt)

            stack.match = hinted  # type: ignore[method-assign]
        reads = stacks[1].cache.controller.reads
        reads.prefetch = every(2, reads.prefetch)
        steps = conversation_steps(11)
        records: list[list[Any]] = [[], []]
        run_ranks(group, lambda r: run_rank(stacks[r], steps, records[r]), timeout_s=300)
        assert records[0] == records[1]
        assert stacks[1].metrics.totals["internal_errors"] > 0, "the fault was never hit"
    finally:
        for stack in stacks:
            close_stack(stack)


def test_a_warm_start_that_fails_on_one_rank_starts_every_rank_empty(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """The warm-start agreement is a collective: a rank whose attach raised must still reach it
    (else the other rank waits in it, then pairs it with an unrelated collective)."""
    group = ThreadedAgreement.Group(2)
    stacks = [build_stack(tmp_path / f"rank{r}", size=160) for r in range(2)]
    try:
        for rank, stack in enumerate(stacks):
            stack.insert(list(range(10, 60)))
            stack.evict_all()  # the same spilled tree on both ranks' tiers
            stack.cache.agreement = ThreadedAgreement(group, rank)
            stack.cache.epoch = None  # the next reset is a start: it attaches the tier's extents
        warm = stacks[1].cache.warm
        attach = warm.attach_all

        def fails_on_rank_1(tier: Any, epoch: bytes) -> int:
            attach(tier, epoch)
            raise RuntimeError("injected on one rank, after part of the attach")

        monkeypatch.setattr(warm, "attach_all", fails_on_rank_1)
        run_ranks(group, lambda r: stacks[r].cache.reset(), timeout_s=60)
        assert [s.cache.spilled_tokens for s in stacks] == [0, 0], "the ranks start from different trees"
        assert stacks[1].metrics.totals["internal_errors"] == 1
        for stack in stacks:
            stack.cache.check_integrity()
    finally:
        for stack in stacks:
            close_stack(stack)


def test_a_rank_whose_spill_was_disabled_takes_the_same_tree_decisions(tmp_path: Path) -> None:
    """Issue 38.4: a fallback that failed on rank 1 only turns its spill off (guard.fallback_failed).
    Every rank still walks every arriving request's prompt (sglang's prefetch hook, which may split
    nodes) and every pin and drop hint, so the trees stay identical and every collective pairs
    (before: rank 1 skipped the walks, its next eviction had fewer victims, and the MIN collective
    met vectors of different lengths)."""
    from types import SimpleNamespace

    from sgl_hicache.cache.hint_source import ResumeHint, RetentionHint
    from sgl_hicache.server import hooks

    group = ThreadedAgreement.Group(2)
    stacks = [build_stack(tmp_path / f"rank{r}", size=160) for r in range(2)]
    seen: list[list[int]] = [[], []]
    try:
        for rank, stack in enumerate(stacks):
            agreement = ThreadedAgreement(group, rank)
            reduce = agreement._reduce

            def recorded(values: list[int], rank: int = rank, reduce: Any = reduce) -> Any:
                seen[rank].append(len(values))
                return reduce(values)

            agreement._reduce = recorded  # type: ignore[method-assign]
            stack.cache.agreement = agreement
            match = stack.match

            def hinted(
                tokens: list[int], salt: str | None = None, stack: Any = stack, match: Any = match
            ) -> Any:
                hints = [
                    ResumeHint(tokens[: len(tokens) // 2], None, None),
                    RetentionHint("pin", tokens[: len(tokens) * 3 // 4], None, None, 60.0),
                    RetentionHint("drop", tokens[:3] + [999], None, None, None),
                ]
                hooks.apply_hints(SimpleNamespace(tree_cache=stack.cache), [*hints, "a request"])
                stack.cache.prefetch(tokens, rid="arriving")  # sglang's hook for an arriving request
                return match(tokens, salt)

            stack.match = hinted  # type: ignore[method-assign]
        stacks[1].cache.disable_spill()
        steps = conversation_steps(5)
        records: list[list[Any]] = [[], []]
        run_ranks(group, lambda r: run_rank(stacks[r], steps, records[r]), timeout_s=300)
        assert records[0] == records[1]
        assert seen[0] == seen[1] and max(seen[0]) > 1, "no eviction agreement met several victims"
        assert stacks[0].metrics.totals.get("internal_errors", 0) == 0
        assert stacks[1].metrics.totals.get("internal_errors", 0) == 0
    finally:
        for stack in stacks:
            close_stack(stack)
