"""`Tier.close(timeout_s)`: what finishes in time is published, the rest is abandoned without debris."""

from __future__ import annotations

import threading
import time

from sgl_hicache.tier import ROOT_KEY, Status
from sgl_hicache.tier.file import store as store_module
from tests.tier.common import key_for, payload_for, tokens_for


def submit(tier, i: int, n: int = 5000):
    return tier.submit_store(key_for(i), payload_for(i, n), tokens_for(i), ROOT_KEY)


def files(root, pattern: str) -> list:
    return sorted(p.name for p in root.rglob(pattern))


def test_close_in_time_publishes_every_queued_store(make_tier, tmp_path):
    tier = make_tier(io_threads=1)
    tickets = [submit(tier, i) for i in range(8)]
    tier.close(timeout_s=30)
    assert [tier.wait(t, timeout=0).status for t in tickets] == [Status.OK] * 8
    assert files(tmp_path, "*.tmp") == []
    assert make_tier().stats().scanned_extents == 8


def test_close_abandons_a_stuck_write_and_removes_its_temp_file(make_tier, tmp_path, monkeypatch):
    stuck, unstick = threading.Event(), threading.Event()
    write = store_module.pwritev_exact

    def slow_write(fd, views, offset):
        if not stuck.is_set():  # the first write: its temp file exists, the device hangs
            stuck.set()
            unstick.wait(30)
        return write(fd, views, offset)

    monkeypatch.setattr(store_module, "pwritev_exact", slow_write)
    tier = make_tier(io_threads=1)
    first, queued = submit(tier, 1), submit(tier, 2)
    assert stuck.wait(10) and len(files(tmp_path, "*.tmp")) == 1
    start = time.monotonic()
    tier.close(timeout_s=0.3)
    assert time.monotonic() - start < 2.0
    assert files(tmp_path, "*.tmp") == [], "the abandoned write's temp file is removed by close"
    unstick.set()  # the write goes on, and cannot publish what close removed
    for ticket in (first, queued):
        done = tier.wait(ticket, timeout=10)
        assert (done.status, done.detail) == (Status.REJECTED, "abandoned at close")
    assert files(tmp_path, "*.tmp") == [] and files(tmp_path, "*.ext") == []
    s = tier.stats()
    assert (s.store_failures, s.io_errors) == (0, 0), "abandoning is not a failure"
    again = make_tier()
    assert (again.stats().extents, again.stats().removed_temp_files) == (0, 0)


def test_a_second_close_returns_at_once(make_tier):
    tier = make_tier()
    tier.close(timeout_s=1)
    start = time.monotonic()
    tier.close(timeout_s=1)
    tier.close()
    assert time.monotonic() - start < 0.1
    assert tier.wait(submit(tier, 1), timeout=1).status is Status.REJECTED
