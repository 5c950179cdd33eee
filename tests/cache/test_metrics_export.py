"""What /metrics mirrors of the tier's and the staging pool's running totals: each counter grows by
what its source grew since the last mirror, never twice for the same count."""

from __future__ import annotations

from typing import Any

from sgl_hicache.cache.metrics import SpillMetrics
from sgl_hicache.config import SpillConfig
from sgl_hicache.tier.results import TierStats


def value(child: Any) -> float:
    return float(child._value.get())


def metrics() -> SpillMetrics:
    return SpillMetrics.create(SpillConfig(), {"model_name": "m", "tp_rank": "0", "pp_rank": "0"})


def test_staging_refusals_are_a_counter_of_the_pools_running_total() -> None:
    m = metrics()
    m.set_staging(used=10, peak=20, capacity=100, refused=3)
    m.set_staging(used=10, peak=20, capacity=100, refused=3)  # nothing new refused
    assert value(m.staging_refusals) == 3
    m.set_staging(used=0, peak=20, capacity=100, refused=5)
    assert value(m.staging_refusals) == 5


def test_removed_bad_files_are_exported() -> None:
    m = metrics()
    assert m.tier_counters is not None
    zero = dict.fromkeys(TierStats.__dataclass_fields__, 0)
    m.set_tier_stats(TierStats(**{**zero, "removed_bad_files": 2}))
    m.set_tier_stats(TierStats(**{**zero, "removed_bad_files": 2}))
    assert value(m.tier_counters["removed_bad_files"]) == 2


def test_manifest_records_that_did_not_verify_are_exported() -> None:
    """A Mooncake warm start's records of another secret, or tampered (a trust event, as a bad file)."""
    m = metrics()
    assert m.tier_counters is not None
    zero = dict.fromkeys(TierStats.__dataclass_fields__, 0)
    m.set_tier_stats(TierStats(**{**zero, "manifest_bad_records": 3}))
    assert value(m.tier_counters["manifest_bad_records"]) == 3


def test_staging_held_by_holder_is_a_labelled_gauge_and_its_time_a_counter() -> None:
    from sgl_hicache.cache.metrics import StagingHolder

    m = metrics()
    assert m.staging_held is not None and m.held_time is not None and m.used_time is not None
    m.set_staging_held({StagingHolder.WRITE: 4096, StagingHolder.PREFETCH: 8192})
    assert value(m.staging_held[StagingHolder.WRITE]) == 4096
    assert value(m.staging_held[StagingHolder.PREFETCH]) == 8192
    assert value(m.staging_held[StagingHolder.RESTORE]) == 0
    m.set_staging_held({StagingHolder.WRITE: 4096})  # the prefetch's block was released
    assert value(m.staging_held[StagingHolder.PREFETCH]) == 0
    m.add_staging_time({StagingHolder.WRITE: 100}, 2.0, "50-75%")
    m.add_staging_time({StagingHolder.WRITE: 100}, 1.0, "50-75%")
    assert value(m.held_time[StagingHolder.WRITE]) == 300 and value(m.used_time["50-75%"]) == 3.0
    assert m.held_byte_seconds[StagingHolder.WRITE] == 300
