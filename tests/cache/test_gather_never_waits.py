"""A restore never reads nor waits on the scheduler thread, even when the eviction that makes room
for it releases the bytes its readiness counted on (issue 12)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams

from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier
from tests.cache.conftest import expected_kv, read_kv

A = list(range(100, 140))
B = list(range(1000, 1250))
LATENCY_S = 1.0


def test_eviction_that_releases_a_staged_extent_never_makes_the_restore_wait(make_stack: Any) -> None:
    s = make_stack(size=256)
    tier = FaultyTier(s.cache.controller.tier, FaultSpec(latency_s=LATENCY_S))
    s.cache.controller.tier = tier
    s.insert(A)
    s.cache.evict(EvictParams(num_tokens=len(A)))  # A spilled: its write is slow, its bytes staged
    s.insert(B)  # the pool is full again: A's restore must evict B to get slots
    m = s.match(A)
    assert m.host_hit_length == len(A)
    evict, calls = s.cache.evict, []

    def evict_once_the_write_landed(params: EvictParams) -> Any:
        if not calls:  # the eviction made for the restore's slots: A's write finishes meanwhile
            time.sleep(LATENCY_S + 0.1)
        calls.append(params)
        return evict(params)

    waits: list[Any] = []
    wait = tier.wait
    s.cache.evict = evict_once_the_write_landed
    tier.wait = lambda *a, **kw: waits.append(a) or wait(*a, **kw)
    req = SimpleNamespace(last_node=m.last_device_node, rid="r")
    answer = s.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req))
    assert calls, "the restore did not need to evict: the test no longer sets up the race"
    assert waits == [], "the scheduler thread waited on a tier read"
    assert answer == (0, m.last_device_node)  # recomputed: A's staged bytes were gone
    assert s.metrics.totals["restores_overtaken"] == 1
    s.cache.evict = evict
    tier.wait = wait
    s.cache.check_integrity()
    loaded, last = s.load_back(s.match(A))  # A is still on the tier: the next restore uses it
    assert loaded == len(A) and read_kv(s.pool, last.value) == expected_kv(A)
    s.cache.controller.wait_writes()
    s.cache.check_integrity()
