"""The root's ledger: eviction of other processes' extents, recounts, lock probe, ESTALE as a miss."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

import sgl_hicache.tier.file.backend as nvme_mod
import sgl_hicache.tier.file.budget.filelock as filelock
import sgl_hicache.tier.file.budget.ledger as ledger_mod
from sgl_hicache.tier import ROOT_KEY, KVDtype, KVLayout, Namespace, Status
from sgl_hicache.tier.file.budget.ledger import LEDGER_NAME, close_ledger, open_ledger
from sgl_hicache.tier.file.budget.ledger_state import Lease, State
from sgl_hicache.tier.file.owner import Writer, host_tag, me
from sgl_hicache.tier.file.sweep import FOREIGN_RETRY_S, walk_root
from tests.tier import share_proc
from tests.tier.common import NS, key_for, payload_for, tokens_for
from tests.tier.share_proc import SPAWN, locked_usage, start
from tests.tier.test_capacity import file_bytes

SIZE = 60_000
FILE = file_bytes(SIZE)
CAP5 = 5 * FILE  # five files of SIZE
OTHER_NS = Namespace(
    "other-model", KVLayout(num_layers=2, num_heads=2, head_dim=64, dtype=KVDtype.BF16, page_size=4)
)


def store(tier, i: int, size: int = SIZE) -> Status:
    return tier.wait(tier.submit_store(key_for(i), payload_for(i, size), tokens_for(i), ROOT_KEY)).status


def test_another_processes_extents_are_evicted_oldest_first(make_tier, tmp_path: Path, children) -> None:
    """B's index is empty (it opened first); A fills the root; B's store evicts A's oldest file,
    which A's next load finds a clean miss."""
    root = tmp_path / "tier"
    b = make_tier(directory=root, capacity_bytes=CAP5)  # five files of a 60 kB payload
    results = SPAWN.Queue()
    start(children, share_proc.store_then_load, str(root), CAP5, [1, 2, 3, 4, 5], results).join(60)
    assert results.get(timeout=10) == [Status.OK.value] * 5
    time.sleep(FOREIGN_RETRY_S)  # B lists files it does not index at most this often
    assert store(b, 9) is Status.OK
    s = b.stats()
    assert s.evictions == 1 and s.extents == 1
    names = {f.name for f in walk_root(root)}
    assert key_for(1).hex() + ".ext" not in names and key_for(2).hex() + ".ext" in names
    on_disk, state = locked_usage(root)
    assert state is not None and on_disk == state.published <= CAP5
    start(children, share_proc.load_status, str(root), CAP5, 1, SIZE, results).join(60)
    assert results.get(timeout=10) == (Status.MISS.value, 1, 0, 0)  # A: a counted clean miss


def test_a_torn_ledger_is_recounted_from_the_files(make_tier, tmp_path: Path) -> None:
    root = tmp_path / "tier"
    tier = make_tier(directory=root)
    assert store(tier, 1) is Status.OK
    tier.close()
    (root / LEDGER_NAME).write_bytes(b"sgl-hicache-budget 1\npublished 999999999\n")  # no checksum: torn
    make_tier(directory=root)
    on_disk, state = locked_usage(root)
    assert state is not None and state.published == on_disk > 0


def test_state_round_trips_and_rejects_tampering() -> None:
    state = State(1234, {"12-34-0123456789abcdef": Lease(99, 1.5)})
    data = state.encode()
    assert State.decode(data) == state
    assert State.decode(data.replace(b"1234", b"1235")) is None
    assert State.decode(b"") is None and State.decode(os.urandom(64)) is None


def test_without_working_locks_the_budget_is_per_process(
    make_tier, tmp_path: Path, monkeypatch, caplog
) -> None:
    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(filelock.fcntl, "lockf", no_locks)
    with caplog.at_level(logging.WARNING, "sgl_hicache.tier"):
        tier = make_tier(directory=tmp_path / "tier", capacity_bytes=2 * FILE)
    assert "budget is per process, not per directory" in caplog.text and "No locks available" in caplog.text
    assert [store(tier, i) for i in range(3)] == [Status.OK] * 3
    assert tier.stats().evictions == 1
    tier.check_integrity()


def test_a_local_only_nfs_mount_is_detected(tmp_path: Path, monkeypatch) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(f"srv:/x {tmp_path} nfs4 rw,vers=4.2,local_lock=posix 0 0\n/dev/sda1 / ext4 rw 0 0\n")
    real_open = open
    monkeypatch.setattr(
        "builtins.open", lambda p, *a, **k: real_open(mounts if p == "/proc/self/mounts" else p, *a, **k)
    )
    assert filelock.local_only_locks(tmp_path / "tier") == "local_lock=posix"
    mounts.write_text(f"srv:/x {tmp_path} nfs4 rw,vers=4.2,local_lock=none 0 0\n")
    assert filelock.local_only_locks(tmp_path / "tier") is None


def test_estale_on_load_is_a_clean_miss(make_tier, monkeypatch) -> None:
    tier = make_tier()
    assert store(tier, 1) is Status.OK

    def stale(*args, **kw):
        raise OSError(errno.ESTALE, "Stale file handle")

    monkeypatch.setattr(nvme_mod, "open_extent", stale)
    done = tier.wait(tier.submit_load(key_for(1), bytearray(SIZE)))
    s = tier.stats()
    assert done.status is Status.MISS and not tier.contains(key_for(1))
    assert (s.misses, s.io_errors, s.checksum_failures) == (1, 0, 0)


def test_the_ledger_lock_excludes_other_processes(make_tier, tmp_path: Path, children) -> None:
    """While another process holds the ledger's lock, a store waits for it."""
    root = tmp_path / "tier"
    tier = make_tier(directory=root)
    locked = SPAWN.Event()
    start(children, share_proc.hold_ledger, str(root), 1.0, locked)
    assert locked.wait(60)
    t0 = time.monotonic()
    assert store(tier, 1) is Status.OK
    assert time.monotonic() - t0 >= 0.5, "the store did not wait for the other process's lock"


def test_an_open_removes_stale_temp_files_of_every_namespace(make_tier, tmp_path: Path) -> None:
    root = tmp_path / "tier"
    make_tier(directory=root, ns=OTHER_NS).close()
    fan = root / OTHER_NS.id.hex() / "cd"
    dead = fan / f".{'cd' * 16}.{Writer(999_999_999, 1, host_tag()).token}.0badf00d.tmp"
    live = fan / f".{'cd' * 16}.{Writer(1, 1, '0123456789abcdef').token}.600df00d.tmp"  # another host
    dead.write_bytes(b"x" * 5000)
    live.write_bytes(b"y" * 3000)
    tier = make_tier(directory=root)  # the default namespace
    assert not dead.exists() and live.exists() and tier.stats().removed_temp_files == 1
    on_disk, state = locked_usage(root)
    assert state is not None and state.published == on_disk == 3000


def test_a_ledger_removed_with_the_root_is_reopened(make_tier, tmp_path: Path) -> None:
    root = tmp_path / "tier"
    tier = make_tier(directory=root)
    assert store(tier, 1) is Status.OK
    shutil.rmtree(root)
    assert store(tier, 2) is Status.OK  # the root is re-created (recreate.py), and its ledger
    assert tier.stats().recreations == 1 and (root / LEDGER_NAME).exists()
    on_disk, state = locked_usage(root)
    assert state is not None and state.published == on_disk == FILE


def test_a_ledger_held_too_long_fails_the_store_not_the_loads(
    make_tier,
    tmp_path: Path,
    children,
    monkeypatch,
) -> None:
    """A process stuck holding the ledger (or a dead host's NFS lock) makes stores fail after
    LOCK_WAIT_S (IO_ERROR, counted), never hang; loads do not need the ledger."""
    root = tmp_path / "tier"
    tier = make_tier(directory=root)
    assert store(tier, 1) is Status.OK
    monkeypatch.setattr(ledger_mod, "LOCK_WAIT_S", 0.3)
    locked = SPAWN.Event()
    holder = start(children, share_proc.hold_ledger, str(root), 30.0, locked)
    assert locked.wait(60)
    assert store(tier, 2) is Status.IO_ERROR and tier.stats().io_errors == 1
    buf = bytearray(SIZE)
    assert tier.wait(tier.submit_load(key_for(1), buf), 10).ok and buf == payload_for(1, SIZE).tobytes()
    holder.kill()
    holder.join(10)
    assert store(tier, 2) is Status.OK
    on_disk, state = locked_usage(root)
    assert state is not None and state.published == on_disk == 2 * FILE


class NoEvict:
    """A reservation's caller with a budget of 100 kB that evicts nothing."""

    capacity_bytes = 100_000

    def evict(self, short: int) -> int:
        return 0

    def removed_temps(self, count: int) -> None:
        pass

    def unlink_failed(self, error: OSError) -> None:
        pass


no_evict = NoEvict()


def test_a_reservation_while_the_root_is_gone_is_refused(make_tier, tmp_path: Path) -> None:
    """No lease that counts nowhere: while the root is gone (removed, not re-created yet) a
    reservation raises FileNotFoundError, which sends the store to re-create the root and retry."""
    root = tmp_path / "tier"
    make_tier(directory=root).close()
    ledger = open_ledger(root)
    try:
        shutil.rmtree(root)
        with pytest.raises(FileNotFoundError):
            ledger.reserve(1000, no_evict)
    finally:
        close_ledger(ledger)


def test_a_lease_of_a_removed_ledger_is_not_taken_from_the_new_one(make_tier, tmp_path: Path) -> None:
    """A store leased 1000 B from the ledger that went with the root; another process re-created
    the root, and our next store leased 3000 B from the new ledger. The first store's end (failed,
    or published) must not shrink the second's lease, whose temp file is on disk."""
    root = tmp_path / "tier"
    make_tier(directory=root).close()
    ledger = open_ledger(root)
    try:
        old = ledger.reserve(1000, no_evict)
        shutil.rmtree(root)
        root.mkdir(mode=0o700)  # re-created by another process (recreate.py)
        new = ledger.reserve(3000, no_evict)
        assert new.generation != old.generation
        ledger.release(1000, old.generation)
        assert ledger.snapshot().leases[me().token].nbytes == 3000
        ledger.commit(1000, old.generation)  # published into the new root after all: counted
        state = ledger.snapshot()
        assert state.leases[me().token].nbytes == 3000 and state.published == 1000
        ledger.commit(3000, new.generation)
        assert ledger.snapshot() == State(4000, {})
    finally:
        close_ledger(ledger)


def test_a_lease_another_process_ended_is_not_taken_from_our_next_one(make_tier, tmp_path: Path) -> None:
    """Another process ended our lease (it judged it stale: its bytes moved to `published`); our
    next store leases 3000 B. The end of the first store must not shrink that lease."""
    root = tmp_path / "tier"
    make_tier(directory=root).close()
    ledger = open_ledger(root)
    try:
        old = ledger.reserve(1000, no_evict)
        with ledger.locked() as state:  # what another process's `_reclaim` writes
            state.published += state.leases.pop(me().token).nbytes
        new = ledger.reserve(3000, no_evict)
        ledger.release(1000, old.generation)
        assert new.generation != old.generation
        assert ledger.snapshot().leases[me().token].nbytes == 3000
    finally:
        close_ledger(ledger)


def test_a_root_recreated_before_the_temp_file_exists_is_not_written_uncounted(
    make_tier, tmp_path: Path, monkeypatch
) -> None:
    """Our store leased in the root's ledger; then another process removed and re-created the root
    (its new ledger holds no lease of ours) before our temp file existed. The store must not write
    there uncounted: it leases again in the new ledger. Checked while its write is stalled."""
    import sgl_hicache.tier.file.store as store_mod

    root = tmp_path / "tier"
    tier = make_tier(directory=root)
    make_room, recreated = tier._budget.make_room, []

    def make_room_then_recreate(nbytes: int, key):
        res = make_room(nbytes, key)
        if not recreated:
            recreated.append(True)
            shutil.rmtree(root)
            (root / NS.id.hex()).mkdir(mode=0o700, parents=True)
            root.chmod(0o700)
            other = open_ledger(root)  # the other process's new ledger, recounted from the files
            other.snapshot()
            close_ledger(other)
        return res

    stalled, go = threading.Event(), threading.Event()
    real = store_mod.pwritev_exact

    def stall_on_header(fd: int, views, offset: int) -> None:
        if offset == 0 and not stalled.is_set():
            stalled.set()
            go.wait(30)
        real(fd, views, offset)

    tier._budget.make_room = make_room_then_recreate
    monkeypatch.setattr(store_mod, "pwritev_exact", stall_on_header)
    ticket = tier.submit_store(key_for(1), payload_for(1, SIZE), tokens_for(1), ROOT_KEY)
    try:
        assert stalled.wait(30)
        on_disk, state = locked_usage(root)
        assert state is not None and on_disk <= state.total, f"{on_disk} B on disk, {state} counted"
    finally:
        go.set()
    assert tier.wait(ticket, 30).ok
    on_disk, state = locked_usage(root)
    assert state is not None and state.leases == {} and state.published >= on_disk == FILE
