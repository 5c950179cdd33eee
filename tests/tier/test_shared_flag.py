"""`Tier.shared`: False while nothing says another process uses the root, then True for good. An I/O
thread looks for other processes at open and every REFRESH_S, so a tier that never stores learns
of them too."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import sgl_hicache.tier.file.backend as nvme
import sgl_hicache.tier.file.budget.filelock as filelock
import sgl_hicache.tier.file.budget.ledger as ledger_mod
import sgl_hicache.tier.file.budget.shared as shared_mod
from sgl_hicache.tier import ROOT_KEY, Namespace, Status, Tier
from sgl_hicache.tier.file.budget.ledger import LEDGER_NAME
from sgl_hicache.tier.file.budget.mark import ProcessMark
from tests.tier import share_proc
from tests.tier.common import NS, key_for, payload_for, tokens_for
from tests.tier.share_proc import SPAWN, start
from tests.tier.test_ledger import OTHER_NS

CAP = 10 << 20
FAST_S = 0.05  # the refresh period of most tests here
QUIET_S = 20 * FAST_S  # how long a private tier is watched for a flip it must not make


def store(tier: Tier, i: int) -> Status:
    return tier.wait(
        tier.submit_store(key_for(i), payload_for(i, 60_000), tokens_for(i), ROOT_KEY), 30
    ).status


def load(tier: Tier, i: int) -> Status:
    return tier.wait(tier.submit_load(key_for(i), bytearray(60_000)), 30).status


def another_process_stores(root: Path, children: list, *indices: int, ns: Namespace = NS) -> None:
    results = SPAWN.Queue()
    start(children, share_proc.store_then_load, str(root), CAP, list(indices), results, ns).join(60)
    assert results.get(timeout=10) == [Status.OK.value] * len(indices)


def within(seconds: float, check: Callable[[], bool]) -> bool:
    """Whether `check()` holds within `seconds` (polled)."""
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


@pytest.fixture
def fast_refresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvme, "REFRESH_S", FAST_S)


@pytest.fixture
def no_marks(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process does not see other processes' marks (presence.py): only the ledger tells."""
    monkeypatch.setattr(ProcessMark, "others", lambda self: False)


@pytest.fixture
def no_locks(monkeypatch: pytest.MonkeyPatch) -> None:
    """POSIX locks fail in this process (children still have them): a per-process budget."""

    def fail(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(filelock.fcntl, "lockf", fail)
    monkeypatch.setattr(shared_mod, "PRIVATE_RELIST_S", 0.0, raising=False)


def test_a_private_tier_is_never_shared(make_tier, tmp_path: Path, fast_refresh: None) -> None:
    root = tmp_path / "tier"
    tier = make_tier(directory=root, capacity_bytes=CAP)
    assert [store(tier, 1), load(tier, 1), store(tier, 1)] == [Status.OK] * 3
    assert tier.discard(key_for(1)) and not within(QUIET_S, lambda: tier.shared)
    tier.close()
    again = make_tier(directory=root, capacity_bytes=CAP)  # ... a restart of it too (its own files)
    assert store(again, 2) is Status.OK and not within(QUIET_S, lambda: again.shared)
    assert again.stats().io_errors == 0


def test_another_live_process_is_seen_without_a_store(make_tier, tmp_path: Path, children: list) -> None:
    """A server that has stored nothing sees a peer that has stored nothing either (its mark),
    within about REFRESH_S (the real period)."""
    root = tmp_path / "tier"
    tier = make_tier(directory=root, capacity_bytes=CAP)
    assert not tier.shared
    opened = SPAWN.Event()
    start(children, share_proc.idle, str(root), CAP, opened)
    assert opened.wait(60), "the child never opened its tier"
    assert within(3 * shared_mod.REFRESH_S, lambda: tier.shared)
    assert tier.stats().stores == 0


def test_a_peer_opened_first_is_seen_at_open(make_tier, tmp_path: Path, children: list) -> None:
    root = tmp_path / "tier"
    opened = SPAWN.Event()
    start(children, share_proc.idle, str(root), CAP, opened)
    assert opened.wait(60), "the child never opened its tier"
    tier = make_tier(directory=root, capacity_bytes=CAP)
    assert within(3 * shared_mod.REFRESH_S, lambda: tier.shared)


def test_a_live_writers_lease_is_seen_without_a_store(
    make_tier, tmp_path: Path, children: list, fast_refresh: None, no_marks: None
) -> None:
    root = tmp_path / "tier"
    tier = make_tier(directory=root, capacity_bytes=CAP)
    started = SPAWN.Event()
    start(children, share_proc.stuck_writer, str(root), CAP, 3, started)
    assert started.wait(60), "the child never reached its header write"
    assert within(10, lambda: tier.shared)


def test_a_writer_that_came_and_went_is_seen_without_a_store(
    make_tier, tmp_path: Path, children: list, fast_refresh: None
) -> None:
    root = tmp_path / "tier"
    tier = make_tier(directory=root, capacity_bytes=CAP)
    assert store(tier, 1) is Status.OK
    another_process_stores(root, children, 7)  # gone before this tier looks: no mark left
    assert within(10, lambda: tier.shared)


def test_another_processes_open_alone_is_seen(
    make_tier, tmp_path: Path, children: list, fast_refresh: None, no_marks: None
) -> None:
    """Its open rewrites the ledger with the very bytes it held: the mtime tells."""
    root = tmp_path / "tier"
    tier = make_tier(directory=root, capacity_bytes=CAP)
    before = (root / LEDGER_NAME).read_bytes()
    assert not within(QUIET_S, lambda: tier.shared)  # looked at least once since its own write
    done = SPAWN.Queue()
    start(children, share_proc.open_and_close, str(root), CAP, done).join(60)
    assert done.get(timeout=10)
    assert (root / LEDGER_NAME).read_bytes() == before
    assert within(10, lambda: tier.shared)


def test_a_second_tier_of_this_process_makes_both_shared(make_tier, tmp_path: Path) -> None:
    """Two tiers of one process share its ledger and mark, but each evicts the other's files."""
    root = tmp_path / "tier"
    first = make_tier(directory=root, capacity_bytes=CAP)
    assert not first.shared
    second = make_tier(directory=root, capacity_bytes=CAP, ns=OTHER_NS)
    assert first.shared and second.shared


def test_another_namespaces_files_at_open_make_it_shared(make_tier, tmp_path: Path, children: list) -> None:
    """Extents of our namespace at open are indexed: ours (an earlier life's, as far as anyone can
    tell); another namespace's (another model, another TP rank) are another process's."""
    root = tmp_path / "tier"
    another_process_stores(root, children, 7)
    first = make_tier(directory=root, capacity_bytes=CAP)
    assert not first.shared
    first.close()
    another_process_stores(root, children, 7, ns=OTHER_NS)
    assert make_tier(directory=root, capacity_bytes=CAP).shared


def test_a_live_writers_lease_at_open_makes_it_shared(make_tier, tmp_path: Path, children: list) -> None:
    root = tmp_path / "tier"
    make_tier(directory=root, capacity_bytes=CAP).close()
    started = SPAWN.Event()
    start(children, share_proc.stuck_writer, str(root), CAP, 3, started)
    assert started.wait(60), "the child never reached its header write"
    assert make_tier(directory=root, capacity_bytes=CAP).shared


def test_without_locks_foreign_files_make_it_shared(
    make_tier, tmp_path: Path, children: list, no_locks: None
) -> None:
    root = tmp_path / "tier"
    tier = make_tier(directory=root, capacity_bytes=CAP)
    assert [store(tier, 1), load(tier, 1)] == [Status.OK] * 2 and not tier.shared
    another_process_stores(root, children, 7)
    assert store(tier, 2) is Status.OK and tier.shared  # a store lists the root (rate-limited)
    again = make_tier(directory=root, capacity_bytes=CAP)  # an open lists it too
    assert not again.shared  # (all in our namespace: indexed)
    another_process_stores(root, children, 8, ns=OTHER_NS)
    assert make_tier(directory=root, capacity_bytes=CAP).shared


def test_without_locks_a_listing_sees_another_process_without_a_store(
    make_tier, tmp_path: Path, children: list, no_locks: None, fast_refresh: None
) -> None:
    root = tmp_path / "tier"
    tier = make_tier(directory=root, capacity_bytes=CAP)
    assert store(tier, 1) is Status.OK and not within(QUIET_S, lambda: tier.shared)
    another_process_stores(root, children, 7)
    assert within(10, lambda: tier.shared)


@pytest.mark.parametrize("code", [errno.EIO, errno.EACCES], ids=["EIO", "EACCES"])
def test_a_failing_refresh_is_counted_and_logged_once(
    make_tier, tmp_path: Path, fast_refresh: None, monkeypatch: pytest.MonkeyPatch, caplog, code: int
) -> None:
    """Only this tier's ledger reads are faked: another test's tier still open in this process (a
    leaked one) must neither count as this tier's refresh nor fail it."""
    real, calls, ok = ledger_mod.read_unless_locked, [], []
    tier = make_tier(directory=tmp_path / "tier", capacity_bytes=CAP)
    ledger = (tmp_path / "tier" / LEDGER_NAME).stat()
    ours = (ledger.st_dev, ledger.st_ino)
    logged = f"looking for other processes on {tmp_path / 'tier'} failed"

    def fail(fd: int, limit: int) -> tuple[bytes, int] | None:
        if _file_id(fd) != ours:
            return real(fd, limit)
        calls.append(fd)
        raise OSError(code, "injected")

    def succeed(fd: int, limit: int) -> tuple[bytes, int] | None:
        if _file_id(fd) == ours:
            ok.append(fd)
        return real(fd, limit)

    with caplog.at_level(logging.WARNING, "sgl_hicache.tier"):
        monkeypatch.setattr(ledger_mod, "read_unless_locked", fail)
        assert within(10, lambda: len(calls) >= 5)
        assert tier.stats().io_errors == 1 and not tier.shared
        assert store(tier, 1) is Status.OK and load(tier, 1) is Status.OK  # serving goes on
        assert caplog.text.count(logged) == 1
        monkeypatch.setattr(ledger_mod, "read_unless_locked", succeed)
        assert within(10, lambda: len(ok) >= 2)
        monkeypatch.setattr(ledger_mod, "read_unless_locked", fail)  # after a success: counted again
        assert within(10, lambda: tier.stats().io_errors == 2)
    assert caplog.text.count(logged) == 2 and not tier.shared


def _file_id(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def test_a_torn_ledger_is_a_refresh_fault_until_a_store_rebuilds_it(
    make_tier, tmp_path: Path, fast_refresh: None, caplog
) -> None:
    root = tmp_path / "tier"
    tier = make_tier(directory=root, capacity_bytes=CAP)
    with caplog.at_level(logging.WARNING, "sgl_hicache.tier"):
        (root / LEDGER_NAME).write_bytes(b"sgl-hicache-budget 1\npublished 12")  # torn: no checksum line
        assert within(10, lambda: tier.stats().io_errors == 1)
        assert not within(QUIET_S, lambda: tier.stats().io_errors > 1)
    assert caplog.text.count("torn or foreign") == 1 and not tier.shared
    assert store(tier, 1) is Status.OK  # its transaction rebuilds the ledger from the files
    assert tier.shared  # not what this tier left in it: someone else wrote it
    assert tier.stats().io_errors == 1


def test_a_root_that_cannot_be_marked_is_not_private_and_still_serves(
    make_tier, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """Without our mark on `.present` (EIO, EACCES) nobody can be ruled out: the tier is shared, and
    its open and every ledger transaction (stores, evictions) go on regardless."""

    def fail(self: ProcessMark) -> bool:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(ProcessMark, "mark", fail)
    with caplog.at_level(logging.WARNING, "sgl_hicache.tier"):
        tier = make_tier(directory=tmp_path / "tier", capacity_bytes=CAP)
        assert tier.shared
        assert [store(tier, 1), load(tier, 1)] == [Status.OK] * 2
    assert caplog.text.count("cannot mark") == 1  # logged once, not at every transaction


def test_close_stops_the_refresh_and_its_threads(
    make_tier, tmp_path: Path, fast_refresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    real = shared_mod.SharedBudget.refresh
    monkeypatch.setattr(shared_mod.SharedBudget, "refresh", lambda self: calls.append(real(self)))
    before = set(threading.enumerate())
    tier = make_tier(directory=tmp_path / "tier", capacity_bytes=CAP)
    assert within(10, lambda: len(calls) >= 3)
    tier.close()
    after = len(calls)
    time.sleep(5 * FAST_S)
    assert len(calls) == after
    assert [t.name for t in set(threading.enumerate()) - before] == []
