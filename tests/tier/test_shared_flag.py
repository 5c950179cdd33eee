"""`Tier.shared`: False while nothing says another process uses the root, then True for good."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

import sgl_hicache.tier.filelock as filelock
import sgl_hicache.tier.shared as shared_mod
from sgl_hicache.tier import ROOT_KEY, Namespace, Status, Tier
from tests.tier import share_proc
from tests.tier.common import NS, key_for, payload_for, tokens_for
from tests.tier.share_proc import SPAWN, start
from tests.tier.test_ledger import OTHER_NS

CAP = 10 << 20


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


@pytest.fixture
def no_locks(monkeypatch: pytest.MonkeyPatch) -> None:
    """POSIX locks fail in this process (children still have them): a per-process budget."""

    def fail(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(filelock.fcntl, "lockf", fail)
    monkeypatch.setattr(shared_mod, "PRIVATE_RELIST_S", 0.0, raising=False)


def test_a_private_tier_is_not_shared_until_another_process_stores(
    make_tier, tmp_path: Path, children: list
) -> None:
    root = tmp_path / "tier"
    tier = make_tier(directory=root, capacity_bytes=CAP)
    assert [store(tier, 1), load(tier, 1), store(tier, 1)] == [Status.OK] * 3
    assert tier.discard(key_for(1)) and not tier.shared
    again = make_tier(directory=root, capacity_bytes=CAP)  # ... a restart of it too (its own files)
    tier.close()
    assert store(again, 2) is Status.OK and not again.shared
    another_process_stores(root, children, 7)
    assert store(again, 3) is Status.OK  # its next ledger transaction sees the other's
    assert again.shared


def test_another_namespaces_files_at_open_make_it_shared(make_tier, tmp_path: Path, children: list) -> None:
    """Extents of our namespace at open are indexed: ours (an earlier life's, as far as anyone can
    tell); another namespace's (another model, another TP rank) are another process's."""
    root = tmp_path / "tier"
    another_process_stores(root, children, 7)
    assert not make_tier(directory=root, capacity_bytes=CAP).shared
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
