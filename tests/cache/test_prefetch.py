"""Prefetch at arrival: reads start before the restore, coalesce, and expire when unused."""

from __future__ import annotations

import time
from typing import Any

from tests.cache.conftest import expected_kv, read_kv

A = list(range(100, 140))


def test_prefetched_reads_are_used_by_the_restore(make_stack: Any) -> None:
    s = make_stack()
    s.insert(A)
    s.evict_all()
    assert s.cache.prefetch(A + [1]) == 40
    assert s.cache.prefetch(A) == 40  # a second arrival of the same prefix joins the read
    totals = s.metrics.totals
    assert (totals["prefetch_issued"], totals["prefetch_coalesced"]) == (1, 1)
    m = s.match(A + [1])
    loaded, last = s.load_back(m)
    assert loaded == 40 and read_kv(s.pool, last.value) == expected_kv(A)
    assert (totals["prefetch_hits"], totals["reads_on_demand"]) == (1, 0)
    s.cache.check_integrity()


def test_unused_prefetch_is_released_after_its_ttl(make_stack: Any) -> None:
    s = make_stack(prefetch_ttl_s=0.05)
    s.insert(A)
    s.evict_all()
    s.cache.prefetch(A)
    assert s.cache.controller.staging.used_bytes > 0
    time.sleep(0.2)
    deadline = time.monotonic() + 5
    while s.cache.controller.staging.used_bytes and time.monotonic() < deadline:
        s.cache._poll()
        time.sleep(0.02)
    assert s.cache.controller.staging.used_bytes == 0
    assert s.metrics.totals["prefetch_abandoned"] == 1
    m = s.match(A)
    assert s.load_back(m)[0] == 40 and s.metrics.totals["reads_on_demand"] == 1
    s.cache.check_integrity()


def slow_stack(make_stack: Any, **overrides: Any) -> Any:
    from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier

    s = make_stack(**overrides)
    s.insert(A)
    s.evict_all()
    s.cache.controller.tier = FaultyTier(s.cache.controller.tier, FaultSpec(latency_s=0.3))
    return s


def first_answer(s: Any) -> Any:
    from types import SimpleNamespace

    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    m = s.match(A)
    req = SimpleNamespace(last_node=m.last_device_node)
    return m, s.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req))


def test_wait_policy_defers_admission_until_the_read_lands(make_stack: Any) -> None:
    from sgl_hicache.config import PrefetchPolicy

    s = slow_stack(make_stack, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
    _, answer = first_answer(s)
    assert answer is None, "admission must be deferred, not block the scheduler on the read"
    loaded, last = s.load_back(s.match(A))
    assert loaded == 40 and read_kv(s.pool, last.value) == expected_kv(A)
    assert s.metrics.totals["restore_deferrals"] >= 1
    s.cache.check_integrity()


def test_best_effort_policy_recomputes_rather_than_wait(make_stack: Any) -> None:
    from sgl_hicache.config import PrefetchPolicy

    s = slow_stack(make_stack, prefetch_policy=PrefetchPolicy.BEST_EFFORT)
    m, answer = first_answer(s)
    assert answer == (0, m.last_device_node)
    assert s.metrics.totals["restores_too_late"] == 1 and s.metrics.totals["restore_failures"] == 1
    s.cache.controller.wait_writes()
    s.cache.check_integrity()


def test_timeout_policy_gives_up_after_its_limit(make_stack: Any) -> None:
    from sgl_hicache.config import PrefetchPolicy

    s = slow_stack(make_stack, prefetch_policy=PrefetchPolicy.TIMEOUT, prefetch_timeout_s=0.05)
    _, answer = first_answer(s)
    assert answer is None
    time.sleep(0.1)
    m, answer = first_answer(s)
    assert answer == (0, m.last_device_node) and s.metrics.totals["restores_too_late"] == 1


def test_reads_restarted_past_their_ttl_never_defer_a_request_forever(make_stack: Any) -> None:
    """A hung tier: every read outlives its TTL and is started again; the request's own wait still
    counts from its first deferral, so it recomputes once the policy's limit has passed."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    from sgl_hicache.config import PrefetchPolicy
    from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier

    s = make_stack(prefetch_policy=PrefetchPolicy.TIMEOUT, prefetch_timeout_s=0.3, prefetch_ttl_s=0.05)
    s.insert(A)
    s.evict_all()
    s.cache.controller.tier = FaultyTier(s.cache.controller.tier, FaultSpec(latency_s=30.0))
    deadline = time.monotonic() + 5
    while True:
        m = s.match(A)
        req = SimpleNamespace(last_node=m.last_device_node, rid="hung")
        answer = s.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req))
        if answer is not None:
            break
        assert time.monotonic() < deadline, "deferred for 5 s with a 0.3 s limit"
        time.sleep(0.02)
    assert answer == (0, m.last_device_node) and s.metrics.totals["restores_too_late"] == 1


def test_the_read_time_ends_when_the_tier_finished_not_when_the_scheduler_looked(make_stack: Any) -> None:
    """`restore_read_seconds` is the reads' own time: a read that finished while the scheduler was
    busy for a second (a long forward) does not count that second (the completion's `at`)."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    from sgl_hicache.config import PrefetchPolicy

    s = make_stack(prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
    s.insert(A)
    s.evict_all()
    m = s.match(A)
    req = SimpleNamespace(last_node=m.last_device_node, rid="busy")
    params = InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req)
    assert s.cache.init_load_back(params) is None  # the reads start; admission is deferred
    time.sleep(1.0)  # the scheduler is in a forward; the tier finishes the small read meanwhile
    loaded, last = s.load_back(m, rid="busy")
    assert loaded == 40 and read_kv(s.pool, last.value) == expected_kv(A)
    read = s.metrics.totals["restore_read_seconds"]
    assert 0 < read < 0.5, f"the read's time ({read:.2f} s) includes the scheduler's busy second"


def test_a_resumed_turns_phases_are_counted(make_stack: Any) -> None:
    """The benchmark's per-phase breakdown (`restore_*_seconds`): a read of 0.3 s that the admission
    waited for shows as wait and read time, and the unpack that followed as unpack time."""
    from sgl_hicache.config import PrefetchPolicy

    s = slow_stack(make_stack, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
    t0 = time.monotonic()
    loaded, last = s.load_back(s.match(A), rid="resumed")
    elapsed = time.monotonic() - t0
    assert loaded == 40 and read_kv(s.pool, last.value) == expected_kv(A)
    totals = s.metrics.totals
    assert 0.25 <= totals["restore_wait_seconds"] <= elapsed
    assert 0.25 <= totals["restore_read_seconds"] <= elapsed
    assert 0 < totals["restore_unpack_seconds"] <= elapsed
    assert totals["lookup_seconds"] == 0  # a private tier's own extents: no lookup ran
    before = dict(totals)
    again = s.load_back(s.match(A), rid="resident")  # a device hit: no phase grows
    assert again[0] == 0
    assert all(totals[k] == before[k] for k in totals if k.endswith("_seconds"))
