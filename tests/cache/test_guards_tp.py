"""Contained faults on one TP rank only keep the ranks in lockstep (issue 12): the inner steps that
raise (a node's spill, a restore's readiness, a restore's unpack) take their fallback where they
run, so every rank still meets the agreement collectives and all take the same safe decision."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path
from typing import Any

from tests.cache.conftest import build_stack, close_stack
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
        io = stacks[1].cache.spill_io
        io.store = every(3, io.store)
        io.restore = every(2, io.restore)
        io.reads.readiness = every(4, io.reads.readiness)
        steps = conversation_steps(7)
        records: list[list[Any]] = [[], []]
        errors: list[BaseException] = []

        def target(r: int) -> None:
            try:
                run_rank(stacks[r], steps, records[r])  # asserts every restored KV is exact
            except BaseException as e:
                errors.append(e)
                group.barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads), "a rank hung"
        assert not errors, errors
        assert records[0] == records[1]
        assert stacks[1].metrics.totals["internal_errors"] > 0 == stacks[0].metrics.totals["internal_errors"]
        assert stacks[0].metrics.totals["restored_tokens"] > 0  # restores still happened
        for stack in stacks:
            stack.cache.spill_io.wait_writes()
            stack.cache.check_integrity()
    finally:
        for stack in stacks:
            close_stack(stack)
