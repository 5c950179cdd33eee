"""The WRITE_THROUGH policy: KV goes to the tier when the tree takes it, not only when it is evicted.

What it is for: two servers sharing a tier behind a router that moves a conversation to the other
server while its history is still resident (never evicted) on the first. Under WRITE_BACK the tier
holds nothing of it and the other server recomputes; under WRITE_THROUGH it finds the history by
lookup. Every restored slot is checked against its lossless marker."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sgl_hicache_kernels import packed_nbytes
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from sgl_hicache.cache.staging_share import BACKGROUND_SHARE, Refused
from sgl_hicache.config import WritePolicy
from tests.cache.conftest import Stack, read_kv
from tests.cache.test_cross_server import PROMPT, restore_on


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    from sgl_hicache.tier import path_lookup as lookup

    monkeypatch.setattr(lookup, "BLOCK_TOKENS", 16)


def _pair(make_stack: Any, tmp_path: Path, policy: WritePolicy) -> tuple[Stack, Stack]:
    return tuple(make_stack(tmp_path / "shared", size=512, write_policy=policy) for _ in range(2))  # type: ignore[return-value]


def _files(stack: Stack) -> int:
    return len(list(stack.tier_dir.rglob("*.ext")))


@pytest.mark.parametrize("policy", list(WritePolicy))
def test_a_history_still_resident_on_a_is_found_by_b_only_written_through(
    make_stack: Any, tmp_path: Path, policy: WritePolicy
) -> None:
    a, b = _pair(make_stack, tmp_path, policy)
    for end in (48, 112, len(PROMPT)):  # three turns on A, never evicted
        a.insert(PROMPT[:end])
    a.cache.controller.wait_writes()
    assert a.cache.spilled_tokens == 0  # all of it is resident on A
    n, kv = restore_on(b, PROMPT + [9, 9, 9, 9])
    if policy is WritePolicy.WRITE_BACK:
        assert (n, _files(a)) == (0, 0)  # nothing on the tier: B recomputes
        return
    assert a.metrics.totals["written_through_tokens"] == len(PROMPT)
    assert n == len(PROMPT)
    assert kv == PROMPT  # the markers A computed, every element of every layer
    b.cache.check_integrity(with_tier=False)
    a.cache.check_integrity(with_tier=False)


def test_evicting_a_written_through_node_rewrites_only_what_its_file_lacks_and_restores_exactly(
    make_stack: Any, tmp_path: Path
) -> None:
    """Write-through assumes a shared root, where another server may have evicted our file since we
    wrote it: an eviction stores each node again, and the tier writes nothing where the node's own
    extent is still there (it refreshes its age). The halves of a split node have no extent of
    their own: they are written. Every restored byte is the one computed."""
    a = make_stack(tmp_path / "tier", size=512, write_policy=WritePolicy.WRITE_THROUGH)
    a.insert(PROMPT[:64])
    a.insert(PROMPT[:32] + [7] * 40)  # splits A's written-through node at 32: refs split with it
    a.cache.controller.wait_writes()
    tier = a.cache.controller.tier
    stores = tier.stats().stores
    assert stores == 2
    a.evict_all()
    assert tier.stats().stores == stores + 2  # the two halves; the 40-token node's file was there
    assert a.metrics.totals["spilled_tokens"] == 64 + 40  # all submitted: the tier decides
    assert a.cache.spilled_tokens == 64 + 40
    for tokens in (PROMPT[:64], PROMPT[:32] + [7] * 40):
        m = a.match(tokens)  # the second shares 32 tokens the first restore made resident
        assert m.device_prefix_len + m.host_hit_length == len(tokens)
        n, node = a.load_back(m)
        assert n == m.host_hit_length > 0
        assert read_kv(a.pool, a.cache.path_device_indices(node)) == tokens
    a.cache.check_integrity()


def test_a_refused_write_stops_the_path_and_the_next_insert_fills_it_without_a_gap(
    make_stack: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = make_stack(tmp_path / "tier", size=512, write_policy=WritePolicy.WRITE_THROUGH)
    a.insert(PROMPT[:48])
    real_store = a.cache.controller.store
    monkeypatch.setattr(
        a.cache.controller, "store", lambda *args, **kw: Refused.DEFERRED
    )  # its share is full
    a.insert(PROMPT[:112])
    a.insert(PROMPT)
    assert a.metrics.totals["written_through_tokens"] == 48  # nothing below the refused node
    monkeypatch.setattr(a.cache.controller, "store", real_store)
    a.insert(PROMPT + [3] * 16)  # the next turn's insert writes what is missing on its path, top down
    a.cache.controller.wait_writes()
    assert a.metrics.totals["written_through_tokens"] == len(PROMPT) + 16
    a.evict_all()
    m = a.match(PROMPT + [3] * 16)
    n, node = a.load_back(m)
    assert n == len(PROMPT) + 16
    assert read_kv(a.pool, a.cache.path_device_indices(node)) == PROMPT + [3] * 16
    a.cache.check_integrity()


def test_a_failed_write_through_is_contained_and_never_served(
    make_stack: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = make_stack(tmp_path / "tier", size=512, write_policy=WritePolicy.WRITE_THROUGH)

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(a.cache.controller, "store", broken)
    a.insert(PROMPT)  # the insert itself succeeds: sglang never sees our exception
    assert a.metrics.totals["internal_errors"] == 1
    assert a.match(PROMPT).device_prefix_len == len(PROMPT)
    assert getattr(next(iter(a.cache.root_node.children.values())), "spill", None) is None
    a.cache.check_integrity()


def test_a_write_refused_midway_writes_nothing_below_it(
    make_stack: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refusal of one node (staging momentarily full), not of all: the nodes below it on the
    path are not written (their extents would follow a gap), and the next insert fills the path
    top down. (With every store refused, as above, skipping past the refused node looks the same.)"""
    a = make_stack(tmp_path / "tier", size=512, write_policy=WritePolicy.WRITE_THROUGH)
    real_store = a.cache.controller.store
    monkeypatch.setattr(a.cache.controller, "store", lambda *args, **kw: Refused.DEFERRED)
    a.insert(PROMPT[:48])  # [0, 48) resident, no copy
    tried: list[int] = []

    def refuse_the_first(*args: Any, **kwargs: Any) -> Any:
        tried.append(len(args[2]))  # the node's tokens
        return Refused.DEFERRED if len(tried) == 1 else real_store(*args, **kwargs)

    monkeypatch.setattr(a.cache.controller, "store", refuse_the_first)
    a.insert(PROMPT[:112])  # the path: [0, 48) refused now, then [48, 112) must not be tried
    assert tried == [48]
    assert a.metrics.totals["written_through_tokens"] == 0
    a.insert(PROMPT)  # both accepted now: the whole path, top down
    assert tried == [48, 48, 64, 48]
    a.cache.controller.wait_writes()
    assert a.metrics.totals["written_through_tokens"] == len(PROMPT)
    a.cache.check_integrity()


def _hold_store_completions(monkeypatch: pytest.MonkeyPatch, tier: Any) -> Callable[[], None]:
    """Keep the tier's finished stores from the cache (their staging stays held, as behind a slow
    disk) until the returned function is called."""
    from sgl_hicache.tier.results import Op

    held: list[Any] = []
    released = False
    inner = tier.get_finished

    def get_finished() -> list[Any]:
        done = inner()
        if released:
            out, held[:] = held + done, []
            return out
        held.extend(d for d in done if d.op is Op.STORE)
        return [d for d in done if d.op is not Op.STORE]

    def release() -> None:
        nonlocal released
        released = True

    monkeypatch.setattr(tier, "get_finished", get_finished)
    return release


def test_write_through_fills_only_its_share_of_staging(
    make_stack: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Write-throughs are background work (nothing is lost without them): while the disk is slow
    they may hold only `BACKGROUND_SHARE` of staging, so a restore still finds staging to read into.
    Without the bound the three write-throughs below would hold all of it and the restore would
    recompute."""
    a = make_stack(tmp_path / "tier", size=512, write_policy=WritePolicy.WRITE_THROUGH)
    io = a.cache.controller
    one = packed_nbytes(io.view, 48)
    io.staging.capacity_bytes = 3 * one  # three 48-token nodes; write-through may hold one of them
    assert one <= 3 * one * BACKGROUND_SHARE < 2 * one
    old = [7000 + i for i in range(48)]
    a.insert(old)
    a.evict_all()  # written through, then evicted: on the tier only
    assert io.staging.used_bytes == 0 and a.cache.spilled_tokens == 48
    release = _hold_store_completions(monkeypatch, io.tier)
    prompts = [[base + i for i in range(48)] for base in (1000, 2000, 3000)]
    for tokens in prompts:  # the disk never reports these writes: the first holds its staging
        a.insert(tokens)
    assert io.staging.used_bytes == one
    assert a.metrics.totals["written_through_tokens"] == 48 + 48
    assert a.metrics.totals["writes_through_deferred"] == 2
    assert io.staging.refused == 0  # a deferral is not a refusal for lack of staging
    n, node = a.load_back(a.match(old))  # reads into staging write-through left
    assert n == 48
    assert read_kv(a.pool, a.cache.path_device_indices(node)) == old
    release()
    # The three prompts (least recently used; the restored node stays): the two deferred ones are
    # written at eviction, as under write_back; the written-through one is stored again too (the
    # tier finds its file and writes nothing). Each takes staging until its store completes.
    a.cache.evict(EvictParams(num_tokens=3 * 48))
    a.cache.controller.wait_writes()
    # `old`'s first eviction (its write-through still staged: clean) counts too
    assert a.metrics.totals["spilled_tokens"] == 48 + 96 + 48 and a.metrics.totals["dropped_tokens"] == 0
    for tokens in prompts:
        n, node = a.load_back(a.match(tokens))
        assert n == 48
        assert read_kv(a.pool, a.cache.path_device_indices(node)) == tokens
    a.cache.check_integrity()


def test_a_node_larger_than_write_throughs_share_is_written_at_eviction(
    make_stack: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A node that can never fit write-through's share (but fits staging) is counted apart from a
    momentary deferral and logged once with the flag to raise; its eviction writes it exactly."""
    a = make_stack(tmp_path / "tier", size=512, write_policy=WritePolicy.WRITE_THROUGH)
    io = a.cache.controller
    io.staging.capacity_bytes = packed_nbytes(io.view, 64)  # share: 32 tokens
    big = [[base + i for i in range(48)] for base in (1000, 2000)]
    for tokens in big:
        a.insert(tokens)  # staging is empty: only the share refuses it
        a.evict_all()  # one node at a time: two would not fit staging together
    totals = a.metrics.totals
    assert (totals["written_through_tokens"], totals["writes_through_deferred"]) == (0, 0)
    assert totals["writes_through_too_large"] == 2
    assert len([r for r in caplog.records if "never written through" in r.getMessage()]) == 1
    assert totals["spilled_tokens"] == 96 and totals["dropped_tokens"] == 0
    for tokens in big:
        n, node = a.load_back(a.match(tokens))
        assert n == 48
        assert read_kv(a.pool, a.cache.path_device_indices(node)) == tokens
    a.cache.check_integrity()
