"""The byte budget and free-space watermark hold under any workload; eviction is LRU."""

from __future__ import annotations

import os
import random

import pytest

from sgl_hicache.tier import ROOT_KEY, Status
from sgl_hicache.tier.file.owner import Writer, host_tag, me
from sgl_hicache.tier.format import ALIGN
from tests.tier.common import key_for, payload_for, tokens_for


def file_bytes(n: int) -> int:
    return ALIGN + -(-n // ALIGN) * ALIGN  # one header block + aligned payload


def test_lru_evicts_least_recently_used(make_tier):
    tier = make_tier(capacity_bytes=4 * file_bytes(10_000))
    for i in range(4):
        assert tier.wait(tier.submit_store(key_for(i), payload_for(i, 10_000), tokens_for(i), ROOT_KEY)).ok
    assert tier.wait(tier.submit_load(key_for(0), bytearray(10_000))).ok  # 0 is now most recent
    assert tier.wait(tier.submit_store(key_for(4), payload_for(4, 10_000), tokens_for(4), ROOT_KEY)).ok
    assert [tier.contains(key_for(i)) for i in range(5)] == [True, False, True, True, True]
    assert tier.stats().evictions == 1
    tier.check_integrity()


@pytest.mark.parametrize("seed", range(5))
def test_random_workload_never_exceeds_capacity(make_tier, mount_point, seed):
    rng = random.Random(seed)
    capacity = 300_000
    fs = mount_point("tmpfs", "size=16m,mode=0700")
    tier = make_tier(directory=fs, capacity_bytes=capacity, io_threads=rng.choice([1, 3, 8]))
    baseline = used_bytes(fs)
    sizes = {}
    for step in range(120):
        i = rng.randrange(60)
        if rng.random() < 0.6:
            sizes.setdefault(i, rng.randrange(1, 120_000))
            tier.submit_store(key_for(i), payload_for(i, sizes[i]), tokens_for(i), ROOT_KEY)
        elif i in sizes:
            tier.submit_load(key_for(i), bytearray(sizes[i]))
        assert used_bytes(fs) - baseline <= capacity
        if step % 7 == 0:
            for c in tier.get_finished():
                # NO_SPACE: the rest of the budget pinned by loads in flight
                assert c.status in (Status.OK, Status.MISS, Status.NO_SPACE), c
            assert tier.stats().bytes_stored <= capacity
    tier.close()
    assert tier.stats().bytes_stored <= capacity and tier.stats().evictions > 0
    tier.check_integrity()


def tier_dir(tier):
    return tier._paths.ns_dir


def used_bytes(directory) -> int:
    """Bytes in use on the (tmpfs) volume: an atomic snapshot, unlike a directory walk, which may
    count a victim before its unlink and its replacement after its write."""
    st = os.statvfs(directory)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_loaded_bytes_are_right_under_eviction_pressure(make_tier):
    tier = make_tier(capacity_bytes=200_000, io_threads=4)
    for i in range(30):
        tier.submit_store(key_for(i), payload_for(i, 40_000), tokens_for(i), ROOT_KEY)
        buf = bytearray(40_000)
        j = random.Random(i).randrange(i + 1)
        done = tier.wait(tier.submit_load(key_for(j), buf))
        assert done.status in (Status.OK, Status.MISS)
        if done.ok:
            assert bytes(buf) == payload_for(j, 40_000).tobytes()
    for c in tier.get_finished():
        assert c.ok


def test_extent_larger_than_capacity_is_no_space(make_tier):
    tier = make_tier(capacity_bytes=100_000)
    done = tier.wait(tier.submit_store(key_for(1), payload_for(1, 200_000), tokens_for(1), ROOT_KEY))
    assert done.status is Status.NO_SPACE and tier.stats().no_space == 1
    assert not list(tier_dir(tier).rglob("*.ext")) and not list(tier_dir(tier).rglob("*.tmp"))


def test_free_space_watermark(make_tier, tmp_path):
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    tier = make_tier(min_free_bytes=free + (1 << 30))
    done = tier.wait(tier.submit_store(key_for(1), payload_for(1, 1000), tokens_for(1), ROOT_KEY))
    assert done.status is Status.NO_SPACE


def test_restart_enforces_smaller_budget_and_removes_stale_temp(make_tier, tmp_path):
    tier = make_tier()
    for i in range(6):
        assert tier.wait(tier.submit_store(key_for(i), payload_for(i, 10_000), tokens_for(i), ROOT_KEY)).ok
    tier.close()
    fan = next(tier_dir(tier).rglob("*.ext")).parent
    dead = Writer(999_999_999, 1, host_tag())  # of this host, its pid gone
    (fan / f".{'a' * 32}.{dead.token}.deadbeef.tmp").write_bytes(b"partial")
    (fan / f".{'b' * 32}.{me().token}.cafebabe.tmp").write_bytes(b"live writer")
    # the live writer's temp file is on disk without a lease in the ledger: it counts in the budget
    small = make_tier(capacity_bytes=3 * file_bytes(10_000) + len(b"live writer"))
    assert [small.contains(key_for(i)) for i in range(6)] == [False] * 3 + [True] * 3
    s = small.stats()
    assert (s.scanned_extents, s.evictions, s.removed_temp_files, s.bytes_stored) == (
        6,
        3,
        1,
        3 * file_bytes(10_000),
    )
    assert (fan / f".{'b' * 32}.{me().token}.cafebabe.tmp").exists()
