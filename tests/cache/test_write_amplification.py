"""Issue 37 (3): what the tier is written and what is restored from it, and their ratio.

`written_bytes` (the tier's stats; `tier_written_bytes_total` on /metrics) is every byte a store
put on the tier, header included; `restored_bytes` the verified bytes a completed restore unpacked
into the pool from a tier read; `tier_written_per_restored_byte` their ratio (/server_info and a
gauge).
"""

from __future__ import annotations

import math
import time
from types import SimpleNamespace
from typing import Any

import pytest
from sgl_hicache_kernels import packed_nbytes

from sgl_hicache.cache.metrics import SpillMetrics
from sgl_hicache.config import SpillConfig
from sgl_hicache.tier.results import TierStats
from tests.cache.conftest import expected_kv, read_kv

A = list(range(100, 140))  # 40 tokens
B = list(range(300, 364))  # 64 tokens


def file_bytes(s: Any) -> int:
    return sum(p.stat().st_size for p in s.tier_dir.rglob("*.ext"))


def test_bytes_written_and_restored_are_what_spills_and_restores_moved(make_stack: Any) -> None:
    s = make_stack()
    s.insert(A)
    s.insert(B)
    s.evict_all()
    tier, view = s.cache.controller.tier, s.cache.controller.view
    written = tier.stats().written_bytes
    assert written == file_bytes(s) > packed_nbytes(view, 104), "payload and headers, as on disk"
    assert s.metrics.totals["restored_bytes"] == 0
    assert s.cache.report(idle=True)["tier_written_per_restored_byte"] is None

    loaded, _ = s.load_back(s.match(A))
    assert loaded == 40 and s.metrics.totals["restored_bytes"] == packed_nbytes(view, 40)
    assert s.cache.prefetch(B) == 64  # B's whole extent is read ...
    loaded, last = s.load_back(s.match(B[:16] + [7]))  # ... and only a prefix of it restored
    assert loaded == 16 and read_kv(s.pool, last.value) == expected_kv(B[:16])
    restored = packed_nbytes(view, 56)
    assert s.metrics.totals["restored_bytes"] == restored
    assert s.cache.report(idle=True)["tier_written_per_restored_byte"] == written / restored

    s.evict_all()  # the restored nodes point at their extents again: nothing is written
    assert tier.stats().written_bytes == written == file_bytes(s)
    s.cache.check_integrity()


def test_a_restore_from_staging_restores_no_bytes_from_the_tier(
    make_stack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = make_stack()
    s.insert(A)
    ctl = s.cache.controller
    with monkeypatch.context() as m:
        m.setattr(ctl, "_submit_packed", lambda: None)  # the write stays in staging, not submitted
        s.evict_all()
        loaded, last = s.load_back(s.match(A))
    assert loaded == 40 and read_kv(s.pool, last.value) == expected_kv(A)
    assert s.metrics.totals["restored_tokens"] == 40 and s.metrics.totals["restored_bytes"] == 0
    ctl.wait_writes()
    assert ctl.tier.stats().written_bytes == file_bytes(s) > 0
    s.cache.check_integrity()


@pytest.mark.parametrize(
    ("written", "restored", "gauge"), [(0, 0, 0.0), (5000, 0, math.inf), (5000, 2000, 2.5)]
)
def test_the_ratio_gauge(written: int, restored: int, gauge: float) -> None:
    metrics = SpillMetrics.create(SpillConfig(), {"model_name": "m", "tp_rank": "0", "pp_rank": "0"})
    metrics.inc("restored_bytes", restored)
    stats = TierStats(**{**dict.fromkeys(TierStats.__dataclass_fields__, 0), "written_bytes": written})
    metrics.set_tier_stats(stats)
    (family,) = metrics.amplification.collect()
    assert [(x.name, x.value) for x in family.samples] == [
        ("sglang:hicache_spill_tier_written_per_restored_byte", gauge)
    ]


def test_a_restore_freed_midway_counts_nothing_and_its_second_restore_counts_once(make_stack: Any) -> None:
    """A deferred restore unpacks what landed early; freed before it completed (an eviction takes
    the slots of restores in progress first), those bytes were restored by nothing. The request's
    next restore unpacks them again, from the same read: `restored_bytes` counts them once."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams

    from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier

    s = make_stack(chunk_bytes=4096)
    s.insert(B)
    s.evict_all()
    ctl = s.cache.controller
    view = ctl.view
    ctl.tier = FaultyTier(ctl.tier, FaultSpec(latency_s=2.0))
    m = s.match(B)
    params = InitLoadBackParams(
        m.best_match_node, m.host_hit_length, req=SimpleNamespace(last_node=m.last_device_node, rid="r")
    )
    deadline = time.monotonic() + 30
    while (progress := ctl.restores.get("r")) is None or not progress.any_unpacked:
        assert s.cache.init_load_back(params) is None, "restored before anything was unpacked early"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    s.cache.evict(EvictParams(num_tokens=1))  # frees the restore in progress first
    assert ctl.restores.get("r") is None and s.metrics.totals["restored_bytes"] == 0
    loaded, last = s.load_back(s.match(B), rid="r")
    assert loaded == len(B) and read_kv(s.pool, last.value) == expected_kv(B)
    totals = s.metrics.totals
    assert (totals["restored_tokens"], totals["restored_bytes"]) == (len(B), packed_nbytes(view, len(B)))
    s.cache.check_integrity()


def test_a_layerwise_restore_counts_its_bytes_once_it_settled(make_stack: Any) -> None:
    """Layer-wise: the bytes are counted when the restore ended OK (after its forward), not per
    group unpacked."""
    from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier
    from tests.cache.test_layerwise_review import admit, forward

    tokens = list(range(300, 500))
    s = make_stack(size=512, chunk_bytes=4096, layerwise_restore=True)
    s.insert(tokens)
    s.evict_all()
    ctl = s.cache.controller
    ctl.tier = FaultyTier(ctl.tier, FaultSpec(latency_s=2.0))
    (loaded, node), req = admit(s, tokens, "r")
    assert loaded == len(tokens) and s.metrics.totals["restored_bytes"] == 0, "counted before it ended"
    forward(s, s.cache.path_device_indices(node))
    assert s.cache.after_forward([req]) == []
    totals = s.metrics.totals
    assert (totals["restored_tokens"], totals["restored_bytes"]) == (
        len(tokens),
        packed_nbytes(ctl.view, len(tokens)),
    )
    s.cache.dec_lock_ref(req.last_node)
    s.cache.check_integrity()
