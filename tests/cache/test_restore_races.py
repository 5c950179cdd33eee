"""What happens between the steps of a restore (issue 24): a cross-server lookup landing while the
restore makes room, a fault after the restore took its slots, a clean eviction on a shared root,
and a slot free that raises. Each case was reproduced on main before its fix; each checks the KV
bytes (lossless markers) and that every slot has exactly one owner afterwards."""

from __future__ import annotations

import inspect
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from sgl_hicache.cache.agreement import SingleRank
from sgl_hicache.config import WritePolicy
from tests.cache.conftest import Stack, read_kv
from tests.cache.test_cross_server import PROMPT, settle
from tests.cache.test_early_unpack import B, admission, spilled_behind_a_slow_tier


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    from sgl_hicache.tier import path_lookup as lookup

    monkeypatch.setattr(lookup, "BLOCK_TOKENS", 16)


def owners_are_unique(s: Stack) -> None:
    """No slot is both free and owned, nor free twice (a double free hands one slot to two owners)."""
    free = s.allocator.free_pages if hasattr(s.allocator, "free_pages") else torch.empty(0)
    free_list = [int(x) for x in free.tolist()]
    assert len(free_list) == len(set(free_list)), "a slot is in the free list twice"
    owned: list[int] = []
    stack = list(s.cache.root_node.children.values())
    while stack:
        node = stack.pop()
        if not node.evicted:
            owned.extend(int(x) for x in node.value.tolist())
        stack.extend(node.children.values())
    assert not set(owned) & set(free_list), "a slot owned by a node is also free"


class HeldLookups:
    """B's finished lookups, held back until a call made from inside `evict` (the moment a restore
    makes room for itself): what a lookup finishing on the I/O thread during the restore looks like."""

    def __init__(self, tier: Any) -> None:
        self.real = tier.lookups_finished
        self.held: list[Any] = []
        self.armed = False  # released to a call from inside `evict`
        self.free = False  # released to any call
        tier.lookups_finished = self

    def __call__(self) -> list[Any]:
        self.held.extend(self.real())
        inside_evict = any(frame.function == "evict" for frame in inspect.stack()[1:])
        if not (self.free or (self.armed and inside_evict)):
            return []
        out, self.held = self.held, []
        return out

    def wait_finished(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.held:
            assert time.monotonic() < deadline, "lookup did not finish"
            self.held.extend(self.real())
            time.sleep(0.002)


def test_a_lookup_landing_while_a_restore_makes_room_never_splits_its_chain(
    make_stack: Any, tmp_path: Path
) -> None:
    """B restores P1 (one spilled node of 64 tokens) and must evict to make room; meanwhile a lookup
    B started for P2, which leaves P1 inside that node, finishes. Attaching it there would split the
    node being restored (on main: the tail got the slots of the whole range, and the path's head
    stayed spilled above it: `path_device_indices` raised inside sglang)."""
    a = make_stack(tmp_path / "shared", size=512)
    b = make_stack(tmp_path / "shared", size=200)
    p2 = PROMPT  # A computes and spills all of it
    p1 = PROMPT[:32] + [77] * 32  # shares 32 tokens with P2, then leaves it
    a.insert(p2)
    a.evict_all()
    held = HeldLookups(b.cache.controller.tier)
    b.cache.prefetch(p2, None, None, rid="r2")  # B's tree is empty: the lookup starts at 0
    held.wait_finished()
    b.insert(p1)
    b.evict_all()  # P1 is one spilled node of 64 tokens on B
    b.insert([90 + i % 30 for i in range(190)])  # B's pool is full of something else
    m = b.match(p1)
    assert (m.device_prefix_len, m.host_hit_length) == (0, 64)
    held.armed = True
    n, node = b.load_back(m, "r1")
    assert n == 64
    assert read_kv(b.pool, b.cache.path_device_indices(node)) == p1
    b.cache.check_integrity(with_tier=False)
    owners_are_unique(b)
    held.free = True
    settle(b)  # the held lookup attaches at the next round, where it may split what it needs
    m = b.match(p2)
    n, node = b.load_back(m, "r2")
    assert m.device_prefix_len + n == len(p2)
    assert read_kv(b.pool, b.cache.path_device_indices(node)) == p2
    b.cache.check_integrity(with_tier=False)


class FaultOnCall:
    """Wraps a callable: raises on its `at`-th call (1-based), works otherwise."""

    def __init__(self, real: Any, at: int) -> None:
        self.real, self.at, self.calls = real, at, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("injected")
        return self.real(*args, **kwargs)


@pytest.mark.parametrize("at", [1, 2, 3, 4, 6])
def test_a_fault_anywhere_in_an_early_unpack_leaks_no_slot(make_stack: Any, at: int) -> None:
    """The restore's reads land slowly; the tier's `landed` (read by the early unpack before and
    after it takes its slots) raises on one call. On main, a raise after the slots were taken left
    them owned by nothing (never free again)."""
    s = spilled_behind_a_slow_tier(make_stack)
    tier = s.cache.controller.tier
    landed = FaultOnCall(tier.landed, at)
    tier.landed = landed
    _, params = admission(s)
    deadline = time.monotonic() + 30
    while (answer := s.cache.init_load_back(params)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert landed.calls >= at, "the fault was never reached"
    assert answer[0] in (0, len(B))
    s.cache.check_integrity()
    owners_are_unique(s)
    if answer[0]:
        assert read_kv(s.pool, s.cache.path_device_indices(answer[1])) == B


class RaisingAgreement(SingleRank):
    def __init__(self, at: int) -> None:
        self.fault = FaultOnCall(lambda values: values, at)

    def _reduce(self, values: list[int]) -> list[int]:
        return self.fault(values)  # type: ignore[no-any-return]


@pytest.mark.parametrize("at", [1, 2, 3])
def test_an_agreement_that_raises_inside_a_restore_leaks_no_slot(make_stack: Any, at: int) -> None:
    s = make_stack(size=512)
    s.insert(B)
    s.evict_all()
    s.cache.agreement = RaisingAgreement(at)
    _, params = admission(s)
    deadline = time.monotonic() + 30
    while (answer := s.cache.init_load_back(params)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert s.cache.agreement.fault.calls >= at, "the fault was never reached"
    s.cache.check_integrity()
    owners_are_unique(s)
    if answer[0]:
        assert read_kv(s.pool, s.cache.path_device_indices(answer[1])) == B


@pytest.mark.parametrize("policy", list(WritePolicy))
def test_a_foreign_evictor_on_a_shared_root_loses_nothing_write_back_keeps(
    make_stack: Any, tmp_path: Path, policy: WritePolicy
) -> None:
    """A computes PROMPT (resident; written through under WRITE_THROUGH); B, sharing the root's
    budget, then fills it, evicting the oldest foreign file first; then A evicts PROMPT from its
    device pool and resumes it. Write-back writes it at that eviction: restored whole. On main,
    write-through took its old file for a clean copy (B had evicted it): nothing restored."""
    root = tmp_path / "shared"
    capacity = 120_000  # about four extents of 160 tokens
    a = make_stack(root, size=512, write_policy=policy, capacity_bytes=capacity)
    a.insert(PROMPT)
    a.cache.controller.wait_writes()
    b = make_stack(root, size=1024, capacity_bytes=capacity)
    for i in range(6):  # B's own histories, more than the budget holds
        b.insert([200 + i] + PROMPT[1:])
        b.evict_all()
    time.sleep(1.1)  # A lists others' files again at most once a second (docs/DESIGN.md, one budget)
    a.evict_all()
    m = a.match(PROMPT)
    assert m.host_hit_length == len(PROMPT)
    n, node = a.load_back(m)
    assert n == len(PROMPT)
    assert read_kv(a.pool, a.cache.path_device_indices(node)) == PROMPT
    a.cache.check_integrity(with_tier=False)


def test_a_slot_free_that_raises_never_frees_twice(make_stack: Any) -> None:
    """The allocator's free raises after freeing (a fault after its side effect) while a victim
    spills: its slots are freed once, and no node keeps slots that are free."""
    s = make_stack()
    s.insert(B[:64])
    allocator = s.allocator
    fault = FaultOnCall(allocator.free, 1)

    def free_then_raise(slots: Any) -> None:
        type(allocator).free(allocator, slots)
        fault(slots)

    allocator.free = free_then_raise
    s.evict_all()
    del allocator.free
    owners_are_unique(s)
    s.cache.check_integrity()
