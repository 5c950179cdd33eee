"""Index accounting, LRU victims, pins; keys; check_integrity reports the numbers."""

from __future__ import annotations

import numpy as np
import pytest

from sgl_hicache.config import Fsync
from sgl_hicache.tier import ROOT_KEY, ExtentKey, chain_key
from sgl_hicache.tier.file.budget.index import Entry, Index
from tests.tier.common import NS, key_for, payload_for, tokens_for


def k(i: int) -> ExtentKey:
    return ExtentKey(i.to_bytes(16, "little"))


def filled(capacity: int, sizes: list[int]) -> Index:
    index = Index(capacity)
    for i, size in enumerate(sizes):
        index.add(k(i), Entry(ROOT_KEY, 1, size, size))
    return index


def test_reserve_evicts_lru_and_skips_pinned():
    index = filled(100, [30, 30, 30])
    index.pin(k(0))
    victims = index.reserve(50)
    assert [key for key, _ in victims] == [k(1), k(2)]
    assert (index.used_bytes, index.reserved, index.dying) == (30, 50, 60)
    assert index.reserve(1) is None  # the dying bytes still count until buried
    index.buried(k(1), 30)
    index.buried(k(2), 30)
    assert not index.dying_keys
    index.check()


def test_reserve_impossible_changes_nothing():
    index = filled(100, [50, 50])
    index.pin(k(0))
    index.pin(k(1))
    assert index.reserve(10) is None
    assert (len(index), index.used_bytes, index.reserved) == (2, 100, 0)
    index.unpin(k(0))
    assert [key for key, _ in index.reserve(10)] == [k(0)]


def test_touch_moves_to_most_recent():
    index = filled(90, [30, 30, 30])
    index.touch(k(0))
    assert [key for key, _ in index.evict(1)] == [k(1)]


def test_check_reports_numbers():
    index = filled(100, [30])
    index.used_bytes = 31
    with pytest.raises(AssertionError, match="entries sum to 30 B, used_bytes says 31"):
        index.check()


def test_check_integrity_finds_stray_files(make_tier):
    tier = make_tier()
    assert tier.wait(tier.submit_store(key_for(1), payload_for(1, 100), tokens_for(1), ROOT_KEY)).ok
    tier.check_integrity()
    path = tier._paths.extent(key_for(1))
    stray = path.with_name("f" * 32 + ".ext")
    stray.write_bytes(b"x" * 10)
    with pytest.raises(AssertionError, match=r"1 indexed \(8192 B\), 2 files \(8202 B\).*1 unindexed"):
        tier.check_integrity()


@pytest.mark.parametrize("fsync", list(Fsync))
def test_every_fsync_policy_round_trips(make_tier, fsync):
    tier = make_tier(fsync=fsync)
    assert tier.wait(tier.submit_store(key_for(1), payload_for(1, 9000), tokens_for(1), ROOT_KEY)).ok
    buf = bytearray(9000)
    assert tier.wait(tier.submit_load(key_for(1), buf)).ok and bytes(buf) == payload_for(1, 9000).tobytes()


def test_chain_keys():
    a = chain_key(NS.id, ROOT_KEY, [1, 2, 3])
    assert a == chain_key(NS.id, ROOT_KEY, np.array([1, 2, 3], dtype=np.int32)) and len(a) == 16
    assert chain_key(NS.id, a, [4]) != chain_key(NS.id, ROOT_KEY, [4])
    assert chain_key(NS.id, ROOT_KEY, [1, 2]) != chain_key(NS.id, ROOT_KEY, [1, 2, 0])
    with pytest.raises(ValueError):
        chain_key(NS.id, ROOT_KEY, [-1])
    with pytest.raises(ValueError):
        chain_key(NS.id, ExtentKey(b"short"), [1])


def test_remove_if_removes_only_the_entry_it_names():
    idx = Index(1000)
    old, new = Entry(b"\0" * 16, 1, 10, 100), Entry(b"\0" * 16, 1, 10, 100)
    idx.add(b"k" * 16, old)
    idx.add(b"k" * 16, new)  # published anew
    assert not idx.remove_if(b"k" * 16, old) and idx.get(b"k" * 16) is new and idx.used_bytes == 100
    assert idx.remove_if(b"k" * 16, new) and b"k" * 16 not in idx and idx.used_bytes == 0
