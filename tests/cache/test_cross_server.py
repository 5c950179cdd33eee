"""Cross-server reuse (issue 15): cache B finds, verifies and restores the extents cache A spilled to
their shared directory, for a prompt B has never seen, without a restart; forged, mismatched or
deleted claims are never used."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cache.conftest import Stack, read_kv

PROMPT = [(i * 7) % 50 + 1 for i in range(160)]


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    from sgl_hicache.tier import path_lookup as lookup

    monkeypatch.setattr(lookup, "BLOCK_TOKENS", 16)


def settle(stack: Stack, timeout_s: float = 10.0) -> None:
    """Poll until no lookup of `stack`'s cache is pending (what the scheduler's next round does)."""
    deadline = time.monotonic() + timeout_s
    while stack.cache.controller.lookups._pending:
        assert time.monotonic() < deadline, "lookup did not finish"
        time.sleep(0.002)
        stack.cache.matching.attach_lookups()


@pytest.fixture
def pair(make_stack: Any, tmp_path: Path) -> tuple[Stack, Stack]:
    """Caches A and B on one directory, both open before anything is spilled (so B's warm start
    found nothing: whatever B finds later, it finds by lookup)."""
    return make_stack(tmp_path / "shared", size=512), make_stack(tmp_path / "shared", size=512)


def spill_on_a(a: Stack, split_at: tuple[int, ...] = (48, 112)) -> Stack:
    """Cache A computes PROMPT in pieces (so its tree splits at `split_at`), then spills it all."""
    for end in (*split_at, len(PROMPT)):
        a.insert(PROMPT[:end])
    a.evict_all()
    assert a.cache.spilled_tokens >= len(PROMPT)
    return a


def restore_on(b: Stack, tokens: list[int], rid: str = "r1") -> tuple[int, list[int]]:
    """B's arrival (prefetch + lookup), the scheduler's next rounds, then the restore; returns
    (restored tokens, the KV ids now in B's pool for the restored prefix)."""
    b.cache.prefetch(tokens, None, None, rid=rid)
    settle(b)
    m = b.match(tokens)
    if not m.host_hit_length:
        return 0, []
    n, node = b.load_back(m, rid)
    return n, read_kv(b.pool, b.cache.path_device_indices(node))


def test_b_restores_what_a_spilled_split_elsewhere(pair: tuple[Stack, Stack]) -> None:
    spill_on_a(pair[0])
    b = pair[1]
    b.insert(PROMPT[:32])  # B holds a prefix of its own, split where A never split
    asked = PROMPT + [9, 9, 9, 9]
    n, kv = restore_on(b, asked)
    assert n == len(PROMPT) - 32
    assert kv == PROMPT  # markers: the KV ids A wrote are exactly the prompt's (fill default)
    assert b.metrics.totals["lookup_attached_tokens"] == len(PROMPT) - 32
    assert b.metrics.totals["lookup_refused"] == 0
    b.cache.check_integrity(with_tier=False)


def test_partial_prompt_uses_a_prefix_of_an_extent(pair: tuple[Stack, Stack]) -> None:
    spill_on_a(pair[0], split_at=())  # one extent of 160 tokens
    b = pair[1]
    asked = PROMPT[:100] + [5] * 20  # diverges inside A's extent
    n, kv = restore_on(b, asked)
    assert n == 96  # the last block boundary inside the common part
    assert kv == PROMPT[:96]


def test_fs_calls_are_bounded(pair: tuple[Stack, Stack]) -> None:
    spill_on_a(pair[0])
    b = pair[1]
    restore_on(b, PROMPT)
    blocks = len(PROMPT) // 16
    # binary search (<= log2(blocks) + 1 readlinks), then per extent one readlink and 4 calls
    assert b.metrics.totals["lookup_fs_calls"] <= blocks.bit_length() + 1 + 3 * 5


def test_deleted_by_a_is_a_clean_miss_for_b(pair: tuple[Stack, Stack], tmp_path: Path) -> None:
    a = spill_on_a(pair[0])
    for info in a.cache.controller.tier.extents():
        assert a.cache.controller.tier.discard(info.key)
    b = pair[1]
    assert restore_on(b, PROMPT)[0] == 0
    # A removes an extent's aliases with it; any alias left over is a clean miss for B
    assert b.metrics.totals["lookup_stale"] >= 1 or not _aliases(tmp_path / "shared")
    assert b.metrics.totals["lookup_refused"] == 0


def test_deleted_after_attach_is_a_clean_miss(pair: tuple[Stack, Stack]) -> None:
    a = spill_on_a(pair[0])
    b = pair[1]
    b.cache.prefetch(PROMPT, None, None, rid="r1")
    settle(b)
    assert b.metrics.totals["lookup_attached_tokens"] == len(PROMPT)
    b.cache.controller.reads.clear()  # forget the prefetched reads: the restore must go to the files
    for info in a.cache.controller.tier.extents():
        a.cache.controller.tier.discard(info.key)
    m = b.match(PROMPT)
    assert m.host_hit_length == len(PROMPT)
    assert b.load_back(m, "r1")[0] == 0  # a clean miss: recomputed
    b.cache.check_integrity(with_tier=False)


def _aliases(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_symlink())


def _repoint(links: list[Path], target: Any) -> None:
    for link in links:
        new = target(os.readlink(link))
        link.unlink()
        os.symlink(new, link)


def test_alias_to_another_prompts_extent_is_refused(pair: tuple[Stack, Stack], tmp_path: Path) -> None:
    """Every alias of PROMPT points at a real, sealed extent of another prompt (same offsets)."""
    a, b = pair
    a.insert([t + 100 for t in PROMPT])
    a.evict_all()
    (other,) = a.cache.controller.tier.extents()
    spill_on_a(a, split_at=())
    links = [p for p in _aliases(tmp_path / "shared") if not os.readlink(p).startswith(other.key.hex())]
    _repoint(links, lambda t: f"{other.key.hex()}.{t.split('.')[1]}")
    assert restore_on(b, PROMPT)[0] == 0
    assert b.metrics.totals["lookup_refused"] >= 1
    assert b.metrics.totals["lookup_attached_tokens"] == 0


def test_garbage_alias_is_ignored(pair: tuple[Stack, Stack], tmp_path: Path) -> None:
    a, b = pair
    spill_on_a(a, split_at=())
    _repoint(_aliases(tmp_path / "shared"), lambda t: "../../" + t)
    assert restore_on(b, PROMPT)[0] == 0
    assert b.metrics.totals["lookup_attached_tokens"] == 0


def test_alias_at_a_wrong_offset_is_refused(pair: tuple[Stack, Stack], tmp_path: Path) -> None:
    a, b = pair
    spill_on_a(a, split_at=())
    _repoint(_aliases(tmp_path / "shared"), lambda t: f"{t.split('.')[0]}.{int(t.split('.')[1]) + 16}")
    assert restore_on(b, PROMPT)[0] == 0
    assert b.metrics.totals["lookup_refused"] >= 1


def test_unsealed_extent_behind_an_alias_is_refused(pair: tuple[Stack, Stack], tmp_path: Path) -> None:
    """The extent's meta changed by someone without the secret (the aliases it holds included)."""
    a, b = pair
    spill_on_a(a, split_at=())
    (info,) = a.cache.controller.tier.extents()
    path = next((tmp_path / "shared").rglob(f"{info.key.hex()}.ext"))
    data = bytearray(path.read_bytes())
    data[200] ^= 1  # inside the meta: its MAC no longer matches
    path.write_bytes(bytes(data))
    assert restore_on(b, PROMPT)[0] == 0
    assert b.metrics.totals["lookup_refused"] >= 1


def test_salted_tenant_is_not_found_by_the_default_tenant(pair: tuple[Stack, Stack]) -> None:
    a, b = pair
    a.insert(PROMPT, salt="alice")
    a.evict_all()
    assert restore_on(b, PROMPT)[0] == 0
    assert b.metrics.totals["lookup_refused"] == 0  # not found at all: the keys differ


def test_other_epoch_is_not_found(pair: tuple[Stack, Stack]) -> None:
    a, b = pair
    a.cache.start_epoch()  # A's weights changed: its KV must never serve B
    spill_on_a(a, split_at=())
    assert restore_on(b, PROMPT)[0] == 0


def test_v3_extents_still_load(make_stack: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Format v4 adds aliases, v6 layer groups: a v3 file (no aliases, a page-major payload) is read
    and restored after a restart, its bytes rearranged into the reader's layer groups."""
    from sgl_hicache.tier import format as fmt

    monkeypatch.setattr(fmt, "VERSION", 3)
    a = spill_on_a(make_stack(tmp_path / "shared", size=512, layer_groups=1), split_at=())
    a.cache.controller.tier.close()
    monkeypatch.setattr(fmt, "VERSION", 6)
    head = next((tmp_path / "shared").rglob("*.ext")).read_bytes()[:16]
    assert int.from_bytes(head[8:10], "little") == 3
    b = make_stack(tmp_path / "shared", size=512)  # warm start attaches the v3 extent
    m = b.match(PROMPT)
    assert m.host_hit_length == len(PROMPT)
    _, node = b.load_back(m)
    assert read_kv(b.pool, b.cache.path_device_indices(node)) == PROMPT


def test_v2_extents_are_refused(make_stack: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Versions before 3 (other key scheme, no MACs) fail the version check: removed by the scan."""
    from sgl_hicache.tier import format as fmt

    monkeypatch.setattr(fmt, "VERSION", 2)
    spill_on_a(make_stack(tmp_path / "shared", size=512), split_at=())
    monkeypatch.setattr(fmt, "VERSION", 4)
    b = make_stack(tmp_path / "shared", size=512)
    assert b.match(PROMPT).host_hit_length == 0
    assert b.cache.controller.tier.stats().removed_bad_files == 1


def test_salted_tenant_found_by_the_same_tenant(pair: tuple[Stack, Stack]) -> None:
    """No token ids on disk for a salted tenant: the path keys alone carry the verification."""
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    a, b = pair
    a.insert(PROMPT[:48], salt="alice")
    a.insert(PROMPT, salt="alice")
    a.evict_all()
    b.cache.prefetch(PROMPT, None, "alice", rid="r1")
    settle(b)
    assert b.metrics.totals["lookup_attached_tokens"] == len(PROMPT)
    m = b.match(PROMPT, salt="alice")
    req = type("Req", (), {"last_node": m.last_device_node, "rid": "r1"})()
    params = InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=m.host_hit_length, req=req)
    deadline = time.monotonic() + 30
    while (answer := b.cache.init_load_back(params)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert answer[0] == len(PROMPT)
    assert read_kv(b.pool, b.cache.path_device_indices(answer[1])) == PROMPT
    assert b.match(PROMPT).host_hit_length == 0  # the default tenant sees none of it


def test_off_with_tp_above_one(pair: tuple[Stack, Stack]) -> None:
    """With TP > 1 a lookup's outcome would be each rank's own: not agreed, so none is started."""
    from types import SimpleNamespace

    a, b = pair
    spill_on_a(a, split_at=())
    b.cache.agreement = SimpleNamespace(size=2)
    b.cache.prefetch(PROMPT, rid="r1")
    assert b.metrics.totals["lookups"] == 0
    assert not b.cache.lookup_waiting("r1")


@pytest.fixture
def peer() -> Iterator[Callable[[Path], None]]:
    """Start another process with a tier open on a directory (a second server, idle); killed after."""
    from tests.tier import share_proc

    started: list[Any] = []

    def start(directory: Path) -> None:
        opened = share_proc.SPAWN.Event()
        share_proc.start(started, share_proc.idle, str(directory), 1 << 30, opened)
        assert opened.wait(60), "the peer never opened its tier"

    yield start
    for proc in started:
        proc.kill()
        proc.join(10)


def prompt_past_a_spilled_prefix(make_stack: Any, **overrides: Any) -> Stack:
    """A cache alone on its directory, holding PROMPT[:48] spilled: a prompt runs past its tree."""
    s = make_stack(size=512, **overrides)
    s.insert(PROMPT[:48])
    s.evict_all()
    return s


def test_off_on_a_root_no_other_process_uses(make_stack: Any) -> None:
    s = prompt_past_a_spilled_prefix(make_stack)
    s.cache.prefetch(PROMPT, None, None, rid="r1")
    assert not s.cache.controller.tier.shared and not s.cache.lookup_waiting("r1")
    assert s.metrics.totals["lookups"] == 0 and s.metrics.totals["lookup_seconds"] == 0
    assert s.metrics.totals["prefetch_requests"] == 1  # its own spilled prefix is still read


def test_on_once_another_process_is_seen(make_stack: Any, peer: Callable[[Path], None]) -> None:
    """A server that never stored since the other came sees it within about `REFRESH_S` (the tier's
    refresh), and looks up from then on."""
    from sgl_hicache.tier.file.budget.shared import REFRESH_S

    s = prompt_past_a_spilled_prefix(make_stack)
    peer(s.tier_dir)
    deadline = time.monotonic() + 3 * REFRESH_S
    while not s.cache.controller.tier.shared:
        assert time.monotonic() < deadline, "the other process was not seen"
        time.sleep(0.01)
    s.cache.prefetch(PROMPT, None, None, rid="r1")
    settle(s)
    assert s.metrics.totals["lookups"] == 1 and s.metrics.totals["lookup_seconds"] > 0


def test_write_through_assumes_a_shared_root(make_stack: Any) -> None:
    from sgl_hicache.config import WritePolicy

    s = prompt_past_a_spilled_prefix(make_stack, write_policy=WritePolicy.WRITE_THROUGH)
    s.cache.prefetch(PROMPT, None, None, rid="r1")
    settle(s)
    assert not s.cache.controller.tier.shared and s.metrics.totals["lookups"] == 1
