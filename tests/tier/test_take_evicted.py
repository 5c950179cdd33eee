"""`Tier.take_evicted`: the keys the tier evicted to make room, each once, oldest first (issue 27:
the cache publishes their removal to a KV-aware router)."""

from __future__ import annotations

from sgl_hicache.tier import ROOT_KEY
from sgl_hicache.tier.file.budget.index import EVICTED_KEPT, Entry, Index
from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier
from tests.tier.common import key_for, payload_for, tokens_for
from tests.tier.test_capacity import file_bytes


def _store(tier, i):
    assert tier.wait(tier.submit_store(key_for(i), payload_for(i, 10_000), tokens_for(i), ROOT_KEY)).ok


def test_evictions_are_taken_once_oldest_first(make_tier):
    tier = make_tier(capacity_bytes=2 * file_bytes(10_000))
    for i in range(2):
        _store(tier, i)
    assert tier.take_evicted() == []
    _store(tier, 2)
    _store(tier, 3)
    assert tier.take_evicted() == [key_for(0), key_for(1)]
    assert tier.take_evicted() == []
    assert tier.discard(key_for(2)) and tier.take_evicted() == []  # removals asked for are not evictions


def test_a_faulty_tier_reports_its_inner_tiers_evictions(make_tier):
    tier = FaultyTier(make_tier(capacity_bytes=file_bytes(10_000)), FaultSpec())
    _store(tier, 0)
    _store(tier, 1)
    assert tier.take_evicted() == [key_for(0)]


def test_the_list_is_bounded():
    index = Index(capacity=10**12)
    for i in range(EVICTED_KEPT + 3):
        index.add(key_for(i), Entry(ROOT_KEY, 2, 8, 8))
    index.kill(index.items())
    assert len(index.evicted) == EVICTED_KEPT and index.evicted[0] == key_for(3)
