"""A full volume is visible (issue 38, 9): evictions forced by the volume's free space count apart
from capacity evictions, the free space is a gauge, the first such eviction is logged once, and the
alert docs/OPERATIONS.md gives fires on what the server would export.

The volume is a small tmpfs (mounted by the `mount_point` fixture; skipped where mount is not
permitted) under a budget far above its size, so only its free space can force an eviction."""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sgl_hicache.config import MiB, SpillConfig
from sgl_hicache.tier import ROOT_KEY, Status, Tier
from tests.promql import alert_rules
from tests.tier.common import key_for, payload_for, tokens_for

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "examples" / "prometheus" / "sgl_hicache_alerts.yml"
VOLUME = "size=8m,mode=0700"
MIN_FREE = 4 * MiB
EXTENT = 1 * MiB  # payload bytes per extent: four fit above MIN_FREE, the rest evict for room
LABELS = {"model_name": "m", "tp_rank": "0", "pp_rank": "0"}


def store(tier: Tier, i: int) -> Status:
    ticket = tier.submit_store(key_for(i), payload_for(i, EXTENT), tokens_for(i), ROOT_KEY)
    return tier.wait(ticket, timeout=30).status


def volume_free(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


@pytest.fixture
def small_volume(mount_point: Callable[[str, str], Path]) -> Path:
    return mount_point("tmpfs", VOLUME) / "tier"


def open_small(make_tier: Callable[..., Tier], directory: Path) -> Tier:
    return make_tier(directory=directory, capacity_bytes=1 << 30, min_free_bytes=MIN_FREE)


def test_free_space_evictions_count_apart_are_logged_once_and_free_space_is_a_gauge(
    make_tier: Callable[..., Tier], small_volume: Path, caplog: Any
) -> None:
    with caplog.at_level(logging.WARNING, logger="sgl_hicache.tier"):
        tier = open_small(make_tier, small_volume)
        assert [store(tier, i) for i in range(10)] == [Status.OK] * 10
    s = tier.stats()
    assert s.free_space_evictions >= 5 and s.free_space_evicted_bytes >= 5 * EXTENT, s
    assert (s.evictions, s.evicted_bytes, s.no_space) == (0, 0, 0), "the budget never forced one"
    assert tier.contains(key_for(9)) and not tier.contains(key_for(0))
    logged = [r.getMessage() for r in caplog.records if "free space" in r.getMessage()]
    assert len(logged) == 1 and "tier_free_space_evictions" in logged[0], logged
    assert refreshed(tier, small_volume) >= MIN_FREE


def refreshed(tier: Tier, directory: Path) -> int:
    """The free-space gauge once it shows what the volume has free now (an I/O thread refreshes it
    about every second); fails if it never does."""
    deadline = time.monotonic() + 10
    while tier.stats().volume_free_bytes != volume_free(directory) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tier.stats().volume_free_bytes == volume_free(directory)
    return tier.stats().volume_free_bytes


# -- the alert ------------------------------------------------------------------------------------


def documented_alert(name: str) -> tuple[str, float]:
    """The counter and threshold of alert `name` in the rules file, whose expression must read
    `increase(<counter>[<window>]) > <threshold>`."""
    (expr,) = [rule.expr for rule in alert_rules(RULES) if rule.alert == name]
    m = re.fullmatch(r"increase\((sglang:[a-z_]+)\[\w+\]\) > ([0-9.]+)", expr.strip())
    assert m, f"{RULES.name}: alert {name} is not of the form increase(counter[window]) > N: {expr}"
    return m.group(1), float(m.group(2))


def series_sum(text: str, name: str) -> float:
    """The sum of every sample of `name` in exposition `text` (all label sets)."""
    found = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert found, f"{name} is not exported"
    return sum(float(v) for v in found)


def test_the_volume_full_alert_fires_on_what_the_server_exports(
    make_tier: Callable[..., Tier], small_volume: Path, exported: Callable[[], str]
) -> None:
    """increase() over the alert's window is the growth between two scrapes inside it; it must stay
    0 while the volume has room and grow once its free space forces evictions."""
    from sgl_hicache.cache.metrics import SpillMetrics

    counter, threshold = documented_alert("SglHicacheVolumeFull")
    tier = open_small(make_tier, small_volume)
    metrics = SpillMetrics.create(SpillConfig(enabled=True), LABELS)
    metrics.set_tier_stats(tier.stats())  # what the cache's poll does
    start = exported()
    assert [store(tier, i) for i in range(3)] == [Status.OK] * 3  # room to spare
    free = refreshed(tier, small_volume)
    metrics.set_tier_stats(tier.stats())
    before = exported()
    assert not series_sum(before, counter) - series_sum(start, counter) > threshold, "fired with room left"
    assert series_sum(before, "sglang:hicache_spill_tier_volume_free_bytes") == free
    assert [store(tier, i) for i in range(3, 10)] == [Status.OK] * 7  # the volume fills
    metrics.set_tier_stats(tier.stats())
    after = exported()
    assert series_sum(after, counter) - series_sum(before, counter) > threshold, "the alert does not fire"
    assert series_sum(after, "sglang:hicache_spill_tier_evictions_total") == 0, (
        "counted as capacity evictions"
    )
