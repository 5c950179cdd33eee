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
    assert s.cache.spill_io.staging.used_bytes > 0
    time.sleep(0.2)
    deadline = time.monotonic() + 5
    while s.cache.spill_io.staging.used_bytes and time.monotonic() < deadline:
        s.cache._poll()
        time.sleep(0.02)
    assert s.cache.spill_io.staging.used_bytes == 0
    assert s.metrics.totals["prefetch_abandoned"] == 1
    m = s.match(A)
    assert s.load_back(m)[0] == 40 and s.metrics.totals["reads_on_demand"] == 1
    s.cache.check_integrity()
