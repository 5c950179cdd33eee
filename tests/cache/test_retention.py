"""Retention hints on a real sglang stack (issue 27): a pinned conversation is spilled where it
would be dropped and kept by the tier until its TTL; a drop removes a conversation from device,
staging and tier (but not what others share, nor what a running request uses); a purge leaves
nothing of a cache_salt for fsck, a lookup or a restart, on files and on a Mooncake Store (issue
40); pins are refused over their budget."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from sgl_hicache.cache.hint_source import HintRefused, RetentionHint
from sgl_hicache.cache.spill_state import ExtentState
from sgl_hicache.cli import main as cli_main
from sgl_hicache.tier.keys import tenant_of
from sgl_hicache.tier.results import LookupRequest
from tests.cache.conftest import Stack, read_kv

SYS = list(range(2000, 2032))
A = SYS + list(range(3000, 3032))
B = SYS + list(range(4000, 4032))


def pin(s: Stack, tokens: list[int], ttl_s: float, salt: str | None = None) -> None:
    s.cache.retention.apply(RetentionHint("pin", tokens, None, salt, ttl_s))


def drop(s: Stack, tokens: list[int], salt: str | None = None) -> None:
    s.cache.retention.apply(RetentionHint("drop", tokens, None, salt, None))


def purge(s: Stack, salt: str) -> None:
    s.cache.retention.apply(RetentionHint("purge", [], None, salt, None))


def restored(s: Stack, tokens: list[int], salt: str | None = None) -> int:
    """Tokens matched (device + restored), after checking the restored KV is exactly theirs."""
    m = s.match(tokens, salt)
    n, node = s.load_back(m)
    held = m.device_prefix_len + n
    assert read_kv(s.pool, s.cache.path_device_indices(node)) == tokens[:held]
    return held


def extent_key(s: Stack, tokens: list[int], salt: str | None = None) -> bytes:
    node = s.match(tokens, salt).best_match_node
    return bytes(node.spill.extent.key)


def on_disk(s: Stack) -> set[bytes]:
    return {bytes.fromhex(p.name.split(".")[0]) for p in s.tier_dir.rglob("*.ext")}


def eventually(cond: Callable[[], bool], s: Stack | None = None) -> None:
    deadline = time.monotonic() + 20
    while not cond():
        assert time.monotonic() < deadline, "not within 20 s"
        if s is not None:
            s.cache.poll()
        time.sleep(0.01)


def looked_up(s: Stack, tokens: list[int], salt: str) -> int:
    """Tokens a cross-server lookup of `tokens` (of `salt`) finds on the tier, from the start."""
    tier = s.cache.controller.tier
    ids = np.asarray(tokens, dtype="<u4")
    tier.submit_lookup(LookupRequest(ids, 0, tenant_of(None, salt), s.cache.epoch or b"", cache_salt=salt))
    deadline = time.monotonic() + 20
    while not (results := tier.lookups_finished()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return results[0].end


def test_a_pinned_short_conversation_is_spilled_where_it_would_be_dropped(make_stack: Any) -> None:
    s = make_stack()  # min_spill_tokens 4
    short, other = [7, 8, 9], [17, 18, 19]
    s.insert(short)
    s.insert(other)
    pin(s, short, 60)
    s.evict_all()
    assert restored(s, short) == 3
    assert restored(s, other) == 0  # unpinned: dropped, as before
    assert s.metrics.totals["pinned_spilled_tokens"] == 3
    s.cache.check_integrity()


def test_the_tier_keeps_a_pinned_conversation_until_its_ttl(make_stack: Any) -> None:
    s = make_stack(capacity_bytes=80_000)  # ~6 extents of 64 tokens (8 KiB of KV + a 4 KiB header)
    pinned, unpinned = list(range(1000, 1064)), list(range(5000, 5064))
    for tokens in (pinned, unpinned):
        s.insert(tokens)
    pin(s, pinned, 1.5)
    s.evict_all()
    keys = extent_key(s, pinned), extent_key(s, unpinned)
    tier = s.cache.controller.tier

    def fill(first: int) -> None:
        for i in range(first, first + 8):  # more than the budget holds: LRU would take both first
            s.insert(list(range(10_000 + 100 * i, 10_064 + 100 * i)))
            s.evict_all()

    fill(0)
    assert tier.contains(keys[0]) and not tier.contains(keys[1])
    assert restored(s, pinned) == 64
    s.evict_all()
    time.sleep(1.6)
    fill(10)
    assert not tier.contains(keys[0]), "kept past its TTL"


def test_a_pin_over_its_budget_is_refused_with_the_numbers(make_stack: Any) -> None:
    s = make_stack(capacity_bytes=100_000, pin_share=0.15)  # 15,000 B: one file of 64 tokens (12 KiB)
    taken: list[Any] = []
    assert s.cache.retention.take(taken, list(range(64)), None, None, "pin", 30.0) is None
    refused = s.cache.retention.take(taken, list(range(100, 164)), None, None, "pin", 30.0)
    assert (
        isinstance(refused, HintRefused)
        and "(12288 B of extent files) would exceed the pin budget of 15000 B" in refused.reason
    )
    assert [h.kind for h in taken] == ["pin"]
    # The answer never depends on what exactly is pinned (an oracle): a re-pin of the same tokens is
    # charged in full, as another prefix of the same size is.
    again = s.cache.retention.take(taken, list(range(64)), None, None, "pin", 60.0)
    assert isinstance(again, HintRefused) and again.reason == refused.reason
    assert make_stack(spill=False).cache.retention.take([], [1], None, None, "pin", 1.0) is not None


def test_drop_removes_a_conversation_from_device_and_tier_but_not_what_others_share(
    make_stack: Any,
) -> None:
    s = make_stack()
    s.insert(A)
    s.insert(B)
    s.evict_all()
    a_tail, b_tail, sys = extent_key(s, A), extent_key(s, B), extent_key(s, SYS)
    assert {a_tail, b_tail, sys} <= on_disk(s)
    drop(s, A)
    eventually(lambda: a_tail not in on_disk(s))
    assert {b_tail, sys} <= on_disk(s)
    assert restored(s, A) == len(SYS)
    assert restored(s, B) == len(B)
    resident = list(range(6000, 6040))
    s.insert(resident)
    free = s.allocator.available_size()
    drop(s, resident)
    assert s.match(resident).device_prefix_len == 0 and s.allocator.available_size() == free + 40
    s.cache.check_integrity()


def test_drop_of_a_conversation_still_being_written_removes_it_once_written(make_stack: Any) -> None:
    s = make_stack()
    s.insert(A)
    s.cache.evict(EvictParams(num_tokens=10**9))  # writes submitted, completions not taken yet
    key = extent_key(s, A)
    drop(s, A)
    s.cache.controller.wait_writes()
    eventually(lambda: key not in on_disk(s), s)
    assert restored(s, A) == 0


def test_drop_leaves_what_a_running_request_uses(make_stack: Any) -> None:
    s = make_stack()
    s.insert(A)
    node = s.match(A).last_device_node
    s.cache.inc_lock_ref(node)  # a running request holds it
    drop(s, A)
    assert s.match(A).device_prefix_len == len(A)
    assert s.metrics.totals["drop_kept_tokens"] == len(A)
    s.cache.dec_lock_ref(node)
    s.cache.check_integrity()


def test_purge_leaves_nothing_of_the_salt_for_fsck_lookup_or_restart(make_stack: Any, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    s, other = make_stack(shared), make_stack(shared)  # another server on the same tier directory
    for salt in ("s1", "s2"):
        s.insert(A, salt)
        s.insert(B, salt)
    s.insert(A)  # the default tenant
    s.evict_all()
    s.insert(SYS + [1, 2, 3, 4], "s1")  # resident too
    c = list(range(7000, 7040))
    other.insert(c, "s1")
    other.evict_all()
    before = len(on_disk(s))
    pin(s, A, 60, "s1")
    purge(s, "s1")
    eventually(lambda: s.cache.controller.tier.stats().purged_extents == 4, s)  # sys, A, B and other's c
    assert len(on_disk(s)) == before - 4
    assert restored(other, c, "s1") == 0  # the other server's tree still names it: a clean miss
    assert cli_main(["fsck", str(shared), "--cache-salt", "s1"]) == 0
    assert cli_main(["fsck", str(shared), "--cache-salt", "s2"]) == 1
    assert s.match(A, "s1").host_hit_length == 0 and s.match(A, "s1").device_prefix_len == 0
    assert s.match(SYS, "s1").device_prefix_len == 0
    assert len(s.cache.retention.pins) == 0
    s.cache.check_integrity()
    assert looked_up(s, A, "s1") == 0 and looked_up(s, B, "s2") == len(B)  # the lookup finds none of it
    s.cache.controller.tier.close()
    again = make_stack(shared)  # a restart: salted extents attach when a request brings its tokens
    assert restored(again, A, "s1") == 0
    assert restored(again, B, "s2") == len(B)
    assert restored(again, A) == len(A)


def test_on_the_mooncake_store_a_purge_reaches_the_store_and_a_restart_finds_the_rest(
    make_stack: Any, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Issue 40.3 through the cache, on a real master: a purge of a salt leaves none of its extents
    for a lookup or a restart and counts no `purges_incomplete`; the other salt's and the default
    tenant's are found by the restarted server (warm start), exact. The stacks give the store no
    memory; a holder client does (what it holds outlives their restart)."""
    from dataclasses import replace

    from sgl_hicache.config import SpillBackend, TierConfig
    from sgl_hicache.tier.mooncake.client import connect
    from tests.cache.conftest import close_stack

    master = request.getfixturevalue("mooncake_master")  # skips without the Mooncake client
    holder = connect(master.config(segment_bytes=64 << 20))
    tier = TierConfig(backend=SpillBackend.MOONCAKE, mooncake=replace(master.config(), global_segment_size=0),
                      directory=tmp_path / "tier", chunk_bytes=4096)  # fmt: skip
    stacks: list[Stack] = []
    try:
        s = make_stack(tier=tier)
        stacks.append(s)
        for salt in ("s1", "s2"):
            s.insert(A, salt)
            s.insert(B, salt)
        s.insert(A)  # the default tenant
        s.evict_all()
        purge(s, "s1")
        s.cache.retention.wait_jobs()
        assert s.metrics.totals.get("purges_incomplete", 0) == 0
        assert s.cache.controller.tier.stats().purged_extents > 0
        assert looked_up(s, A, "s1") == 0 and looked_up(s, B, "s2") == len(B)
        close_stack(s)
        again = make_stack(tier=tier)  # a restart on the store
        stacks.append(again)
        assert restored(again, A) == len(A)  # attached at start, from the manifest
        assert restored(again, B, "s2") == len(B)  # attached when a request brings its tokens
        assert restored(again, A, "s1") == 0
    finally:
        for stack in stacks:
            close_stack(stack)  # before the holder leaves
        holder.close()


def test_a_purge_the_tier_cannot_do_clears_the_tree_and_says_so(
    make_stack: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A backend that cannot find a salt's extents refuses `submit_purge`: the purge still leaves
    nothing of the salt on this server, and is counted and logged as incomplete, never raised."""
    s = make_stack()
    s.insert(A, "s1")
    s.evict_all()
    s.insert(B, "s1")

    def cannot(salt: str) -> Any:
        raise NotImplementedError("MooncakeTier cannot purge a cache_salt")

    monkeypatch.setattr(s.cache.controller.tier, "submit_purge", cannot)
    purge(s, "s1")
    purge(s, "s1")
    assert s.match(A, "s1").host_hit_length == 0 and s.match(B, "s1").device_prefix_len == 0
    assert s.metrics.totals["purges_incomplete"] == 2
    assert sum("purges_incomplete" in r.getMessage() for r in caplog.records) == 1
    s.cache.check_integrity()


def test_a_pin_covers_a_page_and_pins_are_bounded(make_stack: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from sgl_hicache.cache import pins

    s = make_stack(page_size=16)
    empty = s.cache.retention.take([], [1, 2, 3], None, "salt", "pin", 60.0)  # less than a page: no tokens
    assert isinstance(empty, HintRefused) and "at least one whole page" in empty.reason
    monkeypatch.setattr(pins, "MAX_PINS", 3)
    for i in range(3):
        assert s.cache.retention.take([], list(range(16 * i, 16 * i + 16)), None, None, "pin", 60.0) is None
    full = s.cache.retention.take([], list(range(100, 116)), None, None, "pin", 60.0)
    assert isinstance(full, HintRefused) and "3 pins are in force" in full.reason


def test_a_re_pin_never_shortens_a_pin(make_stack: Any) -> None:
    s = make_stack()
    pin(s, A, 600.0)
    pin(s, A, 1e-6)  # another client guessing the prefix cannot end it
    time.sleep(0.01)
    assert len(s.cache.retention.pins) == 1


def test_drop_of_a_conversation_not_cached_or_dropped_twice_keeps_the_others(make_stack: Any) -> None:
    """A drop whose conversation runs off the tree inside what others share drops nothing."""
    s = make_stack()
    x = SYS + list(range(9000, 9032))
    s.insert(A)
    drop(s, x)  # never cached: its match ends inside A's node
    assert s.match(A).device_prefix_len == len(A)
    s.evict_all()
    drop(s, x)
    s.cache.retention.wait_jobs()
    assert restored(s, A) == len(A)
    s.insert(B)
    drop(s, A)
    drop(s, A)  # again (a client retrying after a timeout): B and the shared prompt stay
    s.cache.retention.wait_jobs()
    assert s.match(A).device_prefix_len + s.match(A).host_hit_length == len(SYS)
    assert restored(s, B) == len(B)
    s.cache.check_integrity()


def test_a_purge_after_a_restart_leaves_no_orphan_to_attach(make_stack: Any, tmp_path: Path) -> None:
    d = tmp_path / "restart"
    s = make_stack(d)
    s.insert(A, "s1")
    s.evict_all()
    s.cache.controller.tier.close()
    again = make_stack(d)  # salted extents wait as orphans until a request brings their tokens
    assert sum(map(len, again.cache.warm.orphans.values())) == 1
    purge(again, "s1")
    again.cache.retention.wait_jobs()
    m = again.match(A, "s1")
    assert m.host_hit_length == 0, "a purged extent was attached from the warm start's orphans"


C = list(range(100, 164))  # conversation C: 64 tokens
D = C[:32] + list(range(500, 532))  # conversation D: C's first 32 tokens, then its own


def split_c_under_d(s: Stack, evicted_again: bool) -> bytes:
    """C spilled as one extent E; a match of D splits C into C1 (E, 0..32) and C2 (E, 32..64), and
    C1 is restored keeping its clean ref into E; D is inserted below C1 (and, `evicted_again`,
    everything is evicted: D's tail gets its own extent, C1 points at E again). Returns E's key."""
    s.insert(C)
    s.evict_all()
    e = extent_key(s, C)
    s.load_back(s.match(D), rid="d1")
    s.insert(D)
    if evicted_again:
        s.evict_all()
    return e


@pytest.mark.parametrize("evicted_again", [True, False], ids=["head-spilled", "head-resident"])
def test_a_drop_keeps_an_extent_that_a_kept_node_still_points_into(
    make_stack: Any, evicted_again: bool
) -> None:
    """Issue 38.1: C spilled as one extent E; D shares C's first 32 tokens, so a match of D splits C
    into C1 (E, 0..32) and C2 (E, 32..64). Dropping C takes C2 only (C1 is D's too): E must stay,
    since C1 points into it (spilled again, or resident with its clean copy there)."""
    s = make_stack()
    e = split_c_under_d(s, evicted_again)
    drop(s, C)
    s.cache.retention.wait_jobs()
    s.cache.poll()
    assert e in on_disk(s)
    assert s.match(C[:40]).device_prefix_len + s.match(C[:40]).host_hit_length == 32
    s.evict_all()
    assert restored(s, D) == len(D)
    s.cache.check_integrity()


def test_the_extent_of_a_dropped_conversation_goes_with_its_last_node(make_stack: Any) -> None:
    """Issue 38.1, the other side: once no node points into a shared extent, dropping its last
    holder removes its file."""
    s = make_stack()
    e = split_c_under_d(s, evicted_again=True)
    drop(s, C)
    s.cache.retention.wait_jobs()
    assert e in on_disk(s)
    drop(s, D)
    eventually(lambda: e not in on_disk(s), s)
    assert restored(s, D) == 0
    s.cache.check_integrity()


def test_a_purge_after_spill_was_disabled_still_removes_the_salts_extents(make_stack: Any) -> None:
    """A purge is a deletion owed to a tenant: a server (or, with TP > 1, a rank: each purges only
    its own namespace) whose spill a failed fallback disabled still purges its tier, which stays
    open until shutdown."""
    s = make_stack()
    salted = list(range(7000, 7040))
    s.insert(salted, salt="tenant-x")
    s.insert(A)
    s.evict_all()
    x, a = extent_key(s, salted, "tenant-x"), extent_key(s, A)
    s.cache.disable_spill()
    purge(s, "tenant-x")
    s.cache.retention.wait_jobs()
    assert x not in on_disk(s) and a in on_disk(s)


def test_a_drop_after_spill_was_disabled_removes_an_extent_still_being_written(make_stack: Any) -> None:
    """A drop is a deletion owed too: the extent whose write was in flight when spill was disabled
    goes once written, and its staging goes back (before: nobody took the write's completion after
    the disable, so the extent stayed WRITING with its staging held, and the drop never removed it)."""
    s = make_stack()
    s.insert(A)
    s.cache.evict(EvictParams(num_tokens=10**9))  # the write submitted, its completion not taken
    ctl, extent = s.cache.controller, next(iter(s.cache.root_node.children.values())).spill.extent
    assert extent.state is ExtentState.WRITING
    s.cache.disable_spill()
    drop(s, A)
    eventually(lambda: bytes(extent.key) not in on_disk(s) and extent.state is not ExtentState.WRITING, s)
    assert extent.state is ExtentState.ON_TIER and ctl.staging.used_bytes == 0
    s.cache.check_integrity()
