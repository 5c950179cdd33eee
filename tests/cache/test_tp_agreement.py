"""Two tensor-parallel ranks take the same cache decisions although only one of them has faults (issue 14).

Each rank is a real sglang pool under its own SpillRadixCache and tier, driven in its own thread by
the same request sequence, the way sglang's lockstep schedulers drive theirs; rank 1's tier fails,
corrupts or delays some operations. `ThreadedAgreement` is the MIN collective between the threads.
After every turn each rank records its tree digest, its free slots and what its restore answered:
the two records must be identical, every restored KV exact, and nothing may hang. The same run with
no agreement diverges, so the test can fail.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import pytest

from sgl_hicache.cache.agreement import Agreement, SingleRank
from tests.cache.conftest import Stack, build_stack, close_stack, expected_kv, read_kv


class ThreadedAgreement(Agreement):
    """The MIN collective among `size` threads (one per simulated rank), through a barrier."""

    class Group:
        def __init__(self, size: int) -> None:
            self.size = size
            self.barrier = threading.Barrier(size, timeout=60)
            self.slots: list[list[int]] = [[] for _ in range(size)]

    def __init__(self, group: ThreadedAgreement.Group, rank: int) -> None:
        self.group, self.rank, self.size = group, rank, group.size

    def _reduce(self, values: list[int]) -> list[int]:
        self.group.slots[self.rank] = values
        self.group.barrier.wait()
        out = [min(column) for column in zip(*self.group.slots, strict=True)]
        self.group.barrier.wait()  # nobody writes the next call's values before all have read
        return out


def conversation_steps(seed: int, n: int = 50) -> list[list[int]]:
    rng = random.Random(seed)
    clients: list[list[int]] = [[] for _ in range(5)]
    steps = []
    for _ in range(n):
        c = rng.randrange(len(clients))
        if len(clients[c]) > 110 or rng.random() < 0.1:
            clients[c] = []
        if clients[c] and rng.random() < 0.3:  # a fork inside an earlier turn
            clients[c] = clients[c][: rng.randrange(1, len(clients[c]) + 1)]
        clients[c] = clients[c] + [rng.randrange(5, 900) for _ in range(rng.randrange(6, 24))]
        steps.append(list(clients[c]))
    return steps


def run_rank(stack: Stack, steps: list[list[int]], record: list[Any]) -> None:
    """What each rank's scheduler does with the same requests: match, restore, compute, insert."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sgl_hicache.cache.warm_start import tree_digest

    for i, tokens in enumerate(steps):
        m = stack.match(tokens)
        loaded = -1
        if m.host_hit_length:
            loaded, last = stack.load_back(m, rid=f"r{i}")
            path = stack.cache.path_device_indices(last)
            assert read_kv(stack.pool, path) == expected_kv(tokens[: len(path)]), "restored wrong KV"
        need = len(tokens)
        if stack.allocator.available_size() < need:
            stack.cache.evict(EvictParams(num_tokens=need - stack.allocator.available_size()))
        stack.insert(tokens)
        if i % 4 == 0 and stack.cache.controller is not None:  # None: spill disabled on this rank
            stack.cache.controller.wait_writes()  # a local event: when each rank's writes land
        record.append((i, loaded, stack.allocator.available_size(), tree_digest(stack.cache.root_node)))


def run_pair(
    tmp_path: Path, agreements: list[Agreement], seed: int
) -> tuple[list[Any], list[Any], list[Stack]]:
    from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier

    stacks = [build_stack(tmp_path / f"rank{r}", size=160) for r in range(2)]
    spec = FaultSpec(seed=seed, fail_rate=0.25, corrupt_rate=0.15, latency_s=0.01, jitter_s=0.02)
    stacks[1].cache.controller.tier = FaultyTier(stacks[1].cache.controller.tier, spec)
    for stack, agreement in zip(stacks, agreements, strict=True):
        stack.cache.agreement = agreement
    steps = conversation_steps(seed)
    records: list[list[Any]] = [[], []]
    errors: list[BaseException] = []

    def target(r: int) -> None:
        try:
            run_rank(stacks[r], steps, records[r])
        except BaseException as e:  # reported by the main thread
            errors.append(e)
            if isinstance(agreements[r], ThreadedAgreement):
                agreements[r].group.barrier.abort()  # the other rank must not wait forever

    threads = [threading.Thread(target=target, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return records[0], records[1], stacks


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ranks_agree_although_only_one_has_faults(tmp_path: Path, seed: int) -> None:
    group = ThreadedAgreement.Group(2)
    rank0, rank1, stacks = run_pair(
        tmp_path, [ThreadedAgreement(group, 0), ThreadedAgreement(group, 1)], seed
    )
    try:
        assert rank0 == rank1, "the ranks' trees, pools or restores diverged"
        assert any(loaded > 0 for _, loaded, _, _ in rank0), "nothing was restored: the test proves nothing"
        assert stacks[1].cache.controller.tier.injected["failures"] > 0
        for stack in stacks:
            stack.cache.controller.wait_writes()
            stack.cache.check_integrity()
        assert stacks[0].metrics.totals["tp_disagreements"] > 0, "rank 0 never had to follow rank 1"
        restored = sum(loaded for _, loaded, _, _ in rank0 if loaded > 0)
        for stack in stacks:  # a restore one rank completed and the agreement undid restored nothing
            assert stack.metrics.totals["restored_tokens"] == restored
    finally:
        for stack in stacks:
            close_stack(stack)


def test_without_agreement_the_same_faults_make_ranks_diverge(tmp_path: Path) -> None:
    rank0, rank1, stacks = run_pair(tmp_path, [SingleRank(), SingleRank()], seed=0)
    try:
        assert rank0 != rank1
    finally:
        for stack in stacks:
            close_stack(stack)


def test_a_rank_short_of_staging_streams_and_the_other_follows(tmp_path: Path) -> None:
    """Rank 1's staging holds two of the history's five extents, rank 0's all of them: both agree
    the restore streams (the least ready level), take its slots in the same attempt, and restore
    the whole history with the same trees and pools."""
    from sgl_hicache.cache.warm_start import tree_digest
    from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier
    from tests.cache.conftest import shrink_staging

    group = ThreadedAgreement.Group(2)
    stacks = [build_stack(tmp_path / f"rank{r}", size=1024) for r in range(2)]
    tokens = list(range(100, 420))  # five 64-token turns: 8 KiB of KV each
    records: list[list[Any]] = [[], []]
    errors: list[BaseException] = []

    def target(r: int) -> None:
        stack = stacks[r]
        try:
            for end in range(64, len(tokens) + 1, 64):
                stack.insert(tokens[:end])
            stack.evict_all()
            if r == 1:
                shrink_staging(stack, 20 << 10)
            stack.cache.controller.tier = FaultyTier(stack.cache.controller.tier, FaultSpec(latency_s=0.02))
            stack.cache.agreement = ThreadedAgreement(group, r)
            loaded, last = stack.load_back(stack.match(tokens), rid="r")
            path = stack.cache.path_device_indices(last)
            records[r].append((loaded, read_kv(stack.pool, path), tree_digest(stack.cache.root_node)))
        except BaseException as e:  # reported by the main thread
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a rank hung"
        if errors:
            raise errors[0]
        assert records[0] == records[1], "the ranks' restores diverged"
        assert records[1][0][:2] == (len(tokens), expected_kv(tokens))
        assert stacks[1].metrics.totals["restores_streamed"] == 1
        for stack in stacks:  # rank 0 waited for rank 1's windows: timing, not a disagreement
            assert stack.metrics.totals["restore_failures"] == stack.metrics.totals["tp_disagreements"] == 0
            stack.cache.check_integrity()
    finally:
        for stack in stacks:
            close_stack(stack)
