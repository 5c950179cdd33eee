"""Issue 37 (3): what the tier is written and what is restored from it, and their ratio.

`written_bytes` (the tier's stats; `tier_written_bytes_total` on /metrics) is every byte a store
put on the tier, header included; `restored_bytes` the verified bytes a completed restore unpacked
into the pool from a tier read; `tier_written_per_restored_byte` their ratio (/server_info and a
gauge).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from sgl_hicache.kernels import packed_nbytes

from sgl_hicache.cache.metrics import SpillMetrics
from sgl_hicache.config import SpillConfig
from sgl_hicache.tier.base import TierStats
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
