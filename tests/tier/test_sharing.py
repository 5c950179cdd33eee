"""Several processes on one tier root: one budget, deletions as clean misses, temp files by owner.

The budget bound checked here, precisely: with the root's ledger locked (no process can then
reserve, commit or unlink), the bytes of every extent and temp file under the root are at most
`capacity`. Temp files are covered by their writers' leases, so the in-flight allowance is 0.
Checked after every step of every writer (in the writer, under its own ledger) and by the test
process polling meanwhile.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from sgl_hicache.cli.fsck import cmd_fsck
from sgl_hicache.tier import ROOT_KEY, Status
from sgl_hicache.tier.file.owner import Writer, host_tag, me, start_ticks
from sgl_hicache.tier.file.scan import STALE_TEMP_S
from sgl_hicache.tier.file.sweep import walk_root
from tests.tier import share_proc
from tests.tier.common import NS, key_for, payload_for, tokens_for
from tests.tier.share_proc import SPAWN, locked_usage, start

CAPACITY = 600_000


def test_three_writers_hold_one_directory_budget(tmp_path: Path, children: list) -> None:
    root, results = tmp_path / "tier", SPAWN.Queue()
    share_proc.open_shared(str(root), CAPACITY).close()  # create the root and its ledger
    writers = [
        start(children, share_proc.random_writer, str(root), CAPACITY, s, 300, results) for s in (1, 2, 3)
    ]
    checks = peak = 0
    while any(w.is_alive() for w in writers):
        on_disk, state = locked_usage(root)
        assert on_disk <= CAPACITY, f"{on_disk} B on disk > capacity {CAPACITY} B (check {checks})"
        assert state is not None, "the ledger is torn"  # (its total may over-count: never under)
        checks, peak = checks + 1, max(peak, on_disk)
        time.sleep(0.005)
    reports = [results.get(timeout=60) for _ in writers]
    assert all(w.exitcode == 0 for w in writers)
    assert [bad for _, bad, *_ in reports] == [[], [], []], "a load returned wrong bytes or failed"
    assert [r[6] for r in reports] == [[], [], []], (
        "a writer saw the root over capacity after one of its steps"
    )
    assert sum(r[2] for r in reports) > 0, "the workload never filled the budget"
    assert all(r[4] == 0 and r[5] == 0 for r in reports), "io errors or checksum failures"
    assert checks > 20 and peak > CAPACITY // 2, (checks, peak)
    on_disk, state = locked_usage(root)
    assert state is not None and state.leases == {} and on_disk <= state.published <= CAPACITY


def test_a_deletion_by_another_process_is_a_clean_miss_then_rewritten(
    make_tier, tmp_path: Path, children: list
) -> None:
    root, results = tmp_path / "tier", SPAWN.Queue()
    b = make_tier(directory=root, capacity_bytes=CAPACITY)
    data = payload_for(7, 50_000)
    assert b.wait(b.submit_store(key_for(7), data, tokens_for(7), ROOT_KEY)).ok
    assert b.wait(b.submit_store(key_for(8), payload_for(8, 9000), tokens_for(8), ROOT_KEY)).ok
    for i in (7, 8):
        start(children, share_proc.discard, str(root), CAPACITY, i, results).join(60)
        assert results.get(timeout=10) is True
    assert b.contains(key_for(7)) and b.contains(key_for(8))  # b cannot know yet
    # a store of a key b's index still holds is written again, not answered "present"
    again = b.wait(b.submit_store(key_for(7), data, tokens_for(7), ROOT_KEY))
    assert again.ok and again.detail != "present" and b.stats().stores == 3
    buf = bytearray(50_000)
    assert b.wait(b.submit_load(key_for(7), buf)).ok and buf == data.tobytes()
    # a load of a removed file is a counted clean miss, and the key leaves the index
    miss = b.wait(b.submit_load(key_for(8), bytearray(9000)))
    s = b.stats()
    assert miss.status is Status.MISS and not b.contains(key_for(8))
    assert (s.misses, s.checksum_failures, s.io_errors, s.mismatches) == (1, 0, 0, 0)
    assert (
        b.wait(b.submit_store(key_for(8), payload_for(8, 9000), tokens_for(8), ROOT_KEY)).detail != "present"
    )
    b.check_integrity()


def plant_temp(root: Path, writer: Writer, age_s: float) -> Path:
    fan = root / NS.id.hex() / "ab"
    path = fan / f".{'ab' * 16}.{writer.token}.0badf00d.tmp"
    path.write_bytes(b"half an extent")
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def test_foreign_temp_files_are_kept_until_the_age_limit(make_tier, tmp_path: Path, capsys) -> None:
    root = tmp_path / "tier"
    make_tier(directory=root).close()
    other_host = Writer(os.getpid(), start_ticks(os.getpid()) or 0, "0123456789abcdef")  # our pid, elsewhere
    young, old = (
        plant_temp(root, other_host, 60),
        plant_temp(root, Writer(1, 1, "fedcba9876543210"), STALE_TEMP_S + 60),
    )
    tier = make_tier(directory=root)
    assert young.exists() and not old.exists() and tier.stats().removed_temp_files == 1
    tier.close()
    old = plant_temp(root, Writer(1, 1, "fedcba9876543210"), STALE_TEMP_S + 60)
    assert cmd_fsck(root, repair=True) == 0
    out = capsys.readouterr().out
    assert young.exists() and not old.exists() and "removed stale-temp" in out and young.name not in out


def test_our_pid_after_a_restart_is_not_alive(make_tier, tmp_path: Path) -> None:
    """A temp file bearing our own pid and host tag but another start time (a container restarted,
    the pid reused) has a dead writer: removed at once, young as it is."""
    root = tmp_path / "tier"
    make_tier(directory=root).close()
    reused = plant_temp(root, Writer(os.getpid(), me().start + 1, host_tag()), 1)
    ours = plant_temp(root, Writer(os.getpid(), me().start, host_tag()), 1)
    tier = make_tier(directory=root)
    assert not reused.exists() and ours.exists() and tier.stats().removed_temp_files == 1


def test_a_sigkilled_writers_temp_file_and_lease_are_reclaimed(
    make_tier, tmp_path: Path, children: list
) -> None:
    root = tmp_path / "tier"
    make_tier(directory=root, capacity_bytes=CAPACITY).close()
    started = SPAWN.Event()
    proc = start(children, share_proc.stuck_writer, str(root), CAPACITY, 3, started)
    assert started.wait(60), "the child never reached its header write"
    temps = [f for f in walk_root(root) if f.is_temp]
    _, state = locked_usage(root)
    assert len(temps) == 1 and state is not None and len(state.leases) == 1
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    tier = make_tier(directory=root, capacity_bytes=CAPACITY)
    assert tier.stats().removed_temp_files == 1 and not any(f.is_temp for f in walk_root(root))
    on_disk, state = locked_usage(root)
    assert state is not None and state.leases == {} and state.published == on_disk == 0
    assert tier.wait(tier.submit_store(key_for(3), payload_for(3, 100_000), tokens_for(3), ROOT_KEY)).ok
    tier.check_integrity()


def test_a_reservation_reclaims_a_sigkilled_writers_lease_and_temp_file(
    make_tier, tmp_path: Path, children: list
) -> None:
    """No reopen: a store that finds nothing to evict ends the lease of a writer killed since, and
    removes its temp file (its writer is dead on this host), accounted under the lock. A live
    writer's temp file and another host's young one are kept (owner.py's rules)."""
    root, cap = tmp_path / "tier", 200_000
    make_tier(directory=root, capacity_bytes=cap).close()
    started = SPAWN.Event()
    proc = start(children, share_proc.stuck_writer, str(root), cap, 3, started)
    assert started.wait(60), "the child never reached its header write"
    elsewhere = plant_temp(root, Writer(1, 1, "0123456789abcdef"), 60)  # another host's, young: kept
    tier = make_tier(directory=root, capacity_bytes=cap)  # opened while the writer lives
    (stuck,) = [f for f in walk_root(root) if f.is_temp and f.path != str(elsewhere)]
    assert store_big(tier, 4) is Status.NO_SPACE, "a live writer's lease and temp file must hold"
    assert os.path.exists(stuck.path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    assert store_big(tier, 4) is Status.OK
    assert not os.path.exists(stuck.path) and elsewhere.exists()
    assert tier.stats().removed_temp_files == 1
    on_disk, state = locked_usage(root)
    assert state is not None and state.leases == {} and state.published == on_disk <= cap


def store_big(tier, i: int) -> Status:
    return tier.wait(
        tier.submit_store(key_for(i), payload_for(i, 120_000), tokens_for(i), ROOT_KEY), 30
    ).status


def test_storing_a_key_another_tier_wrote_adopts_its_file(make_tier, tmp_path: Path) -> None:
    """B (its own index, opened before A wrote) stores a key whose file A published: no rewrite,
    the file's mtime refreshed (others' LRU sees the use), and B indexes and loads it."""
    root = tmp_path / "tier"
    a, b = make_tier(directory=root), make_tier(directory=root)
    data = payload_for(5, 50_000)
    assert a.wait(a.submit_store(key_for(5), data, tokens_for(5), ROOT_KEY)).ok
    path = a._paths.extent(key_for(5))
    os.utime(path, (time.time() - 3600, time.time() - 3600))
    before = os.stat(path)
    done = b.wait(b.submit_store(key_for(5), data, tokens_for(5), ROOT_KEY))
    after = os.stat(path)
    assert done.ok and done.detail == "present" and done.nbytes == 50_000
    assert after.st_ino == before.st_ino and b.stats().stores == 0, "rewritten"
    assert after.st_mtime > time.time() - 60, "mtime not refreshed"
    info = b.lookup(key_for(5))
    assert info is not None and (info.parent, info.token_count, info.payload_len, info.file_bytes) == (
        ROOT_KEY, 2, 50_000, after.st_size
    )  # fmt: skip
    buf = bytearray(50_000)
    assert b.wait(b.submit_load(key_for(5), buf)).ok and buf == data.tobytes()
    assert b.shared
