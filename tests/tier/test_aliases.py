"""Alias links: a stale farthest alias does not hide live earlier extents from a lookup, and
dangling aliases are swept (with the extent we unlink, or when a lookup meets one)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sgl_hicache.tier import ExtentKey, Tier, chain_key
from sgl_hicache.tier.file import aliases
from sgl_hicache.tier.file.aliases import alias_path
from sgl_hicache.tier.file.budget.shared import SharedBudget
from sgl_hicache.tier.file.paths import ExtentPaths
from sgl_hicache.tier.keys import PathHasher
from sgl_hicache.tier.path_lookup import alias_marks
from sgl_hicache.tier.results import LookupRequest, LookupResult
from tests.tier import share_proc
from tests.tier.common import NS, payload_for
from tests.tier.share_proc import SPAWN, start
from tests.tier.test_capacity import file_bytes

PROMPT = np.array([(i * 7) % 50 + 1 for i in range(160)], dtype=np.uint32)
CUTS = (0, 48, 112, 160)  # three extents: [0, 48), [48, 112), [112, 160)
SIZE = 20_000


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    from sgl_hicache.tier import path_lookup as lookup

    monkeypatch.setattr(lookup, "BLOCK_TOKENS", 16)


def path_key(n: int) -> ExtentKey:
    return PathHasher(NS.id).update(PROMPT[:n]).key()


def extent_key(i: int) -> ExtentKey:
    return range_key(CUTS[i], CUTS[i + 1])


def range_key(start: int, end: int) -> ExtentKey:
    return chain_key(NS.id, path_key(start), PROMPT[start:end])


def spill(tier: Tier, i: int) -> list[int]:
    """Store extent i of PROMPT with its aliases; returns the prompt positions they name."""
    return spill_range(tier, CUTS[i], CUTS[i + 1])


def spill_range(tier: Tier, start: int, end: int) -> list[int]:
    marks = alias_marks(
        PathHasher(NS.id).update(PROMPT[:start]), start, PROMPT[start:end], NS.layout.page_size
    )
    done = tier.wait(tier.submit_store(range_key(start, end), payload_for(start, SIZE), PROMPT[start:end],
                                       path_key(start), aliases=marks), 30)  # fmt: skip
    assert done.ok, done
    return [start + offset for offset, _ in marks]


def link(tier: Tier, pos: int) -> Path:
    return alias_path(ExtentPaths(tier._paths.root, NS.id), path_key(pos))  # type: ignore[attr-defined]


def lookup(tier: Tier, start: int = 0) -> LookupResult:
    tier.submit_lookup(LookupRequest(PROMPT, start))
    deadline = time.monotonic() + 10
    while not (done := tier.lookups_finished()):
        assert time.monotonic() < deadline, "lookup did not finish"
        time.sleep(0.002)
    return done[0]


def test_a_stale_farthest_alias_does_not_hide_live_earlier_extents(make_tier) -> None:
    a = make_tier()
    positions = [spill(a, i) for i in range(3)]
    os.unlink(a._paths.extent(extent_key(2)))  # gone behind everyone's back: its aliases dangle
    b = make_tier()
    found = lookup(b)
    assert [(s.key, s.start, s.end) for s in found.segments] == [
        (extent_key(0), 0, 48), (extent_key(1), 48, 112)
    ]  # fmt: skip
    assert found.stale >= 1 and found.refused == 0
    assert not os.path.lexists(link(b, 160)), "the dangling alias the lookup met is removed"
    assert all(os.path.lexists(link(b, p)) for p in positions[0] + positions[1])


def test_a_stale_claim_that_took_over_live_aliases_falls_back_to_a_search(make_tier) -> None:
    """Another writer split at 100: its extent [100, 160) claimed the links at 112..160, then went.
    No extent ends at 100, so the lookup searches again below it and finds [0, 48), [48, 112)."""
    a = make_tier()
    for i in range(2):
        spill(a, i)
    spill_range(a, 100, 160)
    os.unlink(a._paths.extent(range_key(100, 160)))
    found = lookup(make_tier())
    assert [(s.key, s.start, s.end) for s in found.segments] == [
        (extent_key(0), 0, 48), (extent_key(1), 48, 112)
    ]  # fmt: skip


def test_unlinking_an_extent_removes_its_aliases(make_tier) -> None:
    tier = make_tier()
    positions = [spill(tier, i) for i in range(3)]
    assert tier.discard(extent_key(2))
    assert not any(os.path.lexists(link(tier, p)) for p in positions[2])
    assert all(os.path.lexists(link(tier, p)) for p in positions[0] + positions[1])


def test_evicting_an_extent_removes_its_aliases(make_tier, tmp_path: Path) -> None:
    """Our own LRU victim, and another tier's extent evicted for the directory's budget."""
    root = tmp_path / "tier"
    cap = 2 * file_bytes(SIZE)
    a = make_tier(directory=root, capacity_bytes=cap)
    positions = [spill(a, 0), spill(a, 1)]
    spill(a, 2)  # evicts extent 0, a's least recently used
    assert not a.contains(extent_key(0))
    assert not any(os.path.lexists(link(a, p)) for p in positions[0])
    assert all(os.path.lexists(link(a, p)) for p in positions[1])
    b = make_tier(directory=root, capacity_bytes=cap)  # lists a's extents as others'
    time.sleep(1.0)  # (the listing is refreshed at most every second under pressure)
    spill(b, 0)  # evicts a's oldest: extent 1
    assert not os.path.exists(a._paths.extent(extent_key(1)))
    assert not any(os.path.lexists(link(a, p)) for p in positions[1])


def test_an_alias_repointed_at_a_live_extent_is_kept(make_tier) -> None:
    """Only a link that still names the extent we unlinked is removed: a newer claim stays."""
    tier = make_tier()
    spill(tier, 1)
    positions = spill(tier, 2)
    newer = link(tier, positions[-1])
    newer.unlink()
    newer.symlink_to(f"{extent_key(1).hex()}.64")  # another claim for that path key
    assert tier.discard(extent_key(2))
    assert os.readlink(newer) == f"{extent_key(1).hex()}.64"
    assert not any(os.path.lexists(link(tier, p)) for p in positions[:-1])


class RacingOs:
    """`os` for aliases.py whose `rename` first lets "another writer" replace the link."""

    def __init__(self, newer: str) -> None:
        self.newer = newer

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def rename(self, src: Path, dst: Path) -> None:
        os.unlink(src)
        os.symlink(self.newer, src)
        os.rename(src, dst)


def test_removing_a_dangling_alias_never_drops_a_newer_claim(make_tier, monkeypatch) -> None:
    tier = make_tier()
    spill(tier, 1)
    positions = spill(tier, 2)
    os.unlink(tier._paths.extent(extent_key(2)))
    newer = f"{extent_key(1).hex()}.64"
    monkeypatch.setattr(aliases, "os", RacingOs(newer))
    assert not aliases.remove_dangling(tier._paths.ns_dir, path_key(positions[-1]), extent_key(2))
    assert os.readlink(link(tier, positions[-1])) == newer
    monkeypatch.undo()
    assert aliases.remove_dangling(tier._paths.ns_dir, path_key(positions[0]), extent_key(2))
    assert not os.path.lexists(link(tier, positions[0]))
    assert not list(link(tier, positions[0]).parent.glob(".*")), "a link moved aside was left"


def test_a_lookup_that_finds_another_writers_extents_makes_the_tier_shared(
    make_tier, tmp_path: Path, children: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lookup's own sign: the ledger's (looked for by the refresh, which is off here) aside."""
    monkeypatch.setattr(SharedBudget, "refresh", lambda self: None)
    tier = make_tier()
    spill(tier, 0)
    assert len(lookup(tier).segments) == 1 and not tier.shared  # its own extent
    done = SPAWN.Queue()
    start(children, share_proc.spill_prompt, str(tmp_path / "tier"), 64 << 20, [1, 2], done).join(60)
    assert done.get(timeout=10) and not tier.shared  # the writer came and went unseen
    assert len(lookup(tier).segments) == 3 and tier.shared
