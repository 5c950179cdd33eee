"""The bounded index of a tier that cannot list its store (recent.py)."""

from __future__ import annotations

from sgl_hicache.tier import ROOT_KEY, ExtentInfo, ExtentKey
from sgl_hicache.tier.mooncake.recent import RecentExtents


def info(i: int, nbytes: int = 100) -> ExtentInfo:
    return ExtentInfo(ExtentKey(i.to_bytes(16, "little")), ROOT_KEY, 2, nbytes, nbytes)


def test_the_least_recently_used_go_first_past_the_limit_and_bytes_follow() -> None:
    recent = RecentExtents(limit=3)
    for i in range(3):
        recent.remember(info(i, 100 * (i + 1)))
    recent.remember(info(0, 100))  # used again: now the newest
    recent.remember(info(3, 1000))  # past the limit: 1 (the oldest) goes
    assert [k in recent for k in (info(i).key for i in range(4))] == [True, False, True, True]
    assert len(recent) == 3 and recent.bytes == 100 + 300 + 1000
    recent.forget(info(3).key)
    recent.forget(info(3).key)  # twice: nothing more
    assert recent.bytes == 400 and recent.get(info(2).key) == info(2, 300)
