"""A store that fails after its temp file exists leaves nothing uncounted: every byte under the root
is in the ledger (published or leased), and a failed store is never visible unless it cannot be
removed, in which case it stays counted (and, if published, indexed)."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import sgl_hicache.tier.file.store as store_mod
import sgl_hicache.tier.file.sweep as sweep_mod
from sgl_hicache.config import Fsync
from sgl_hicache.tier import ROOT_KEY, Status
from sgl_hicache.tier.file.sweep import walk_root
from tests.tier.common import key_for, payload_for, tokens_for
from tests.tier.share_proc import locked_usage

SIZE = 100_000


class FailingOs:
    """`os` for one module, with some calls failing (EIO) where `fails(name, *args)` says so."""

    def __init__(self, fails: Callable[..., bool]) -> None:
        self._fails = fails
        self.failed: list[str] = []

    def __getattr__(self, name: str) -> Any:
        real = getattr(os, name)
        if not callable(real):
            return real

        def call(*args: Any, **kw: Any) -> Any:
            if self._fails(name, *args):
                if name == "close":
                    real(*args)  # the descriptor is gone all the same, as after a real close error
                self.failed.append(name)
                raise OSError(errno.EIO, f"injected {name} failure")
            return real(*args, **kw)

        return call


def store(tier, i: int) -> Status:
    return tier.wait(tier.submit_store(key_for(i), payload_for(i, SIZE), tokens_for(i), ROOT_KEY), 30).status


def assert_accounted(root: Path) -> None:
    """Idle: no lease left, and the ledger's published bytes are exactly the files under the root."""
    on_disk, state = locked_usage(root)
    assert state is not None and state.leases == {}, state
    assert state.published == on_disk, f"{on_disk} B on disk, ledger says {state.published} B"


def test_a_failed_directory_fsync_removes_the_published_file(make_tier, tmp_path: Path, monkeypatch) -> None:
    """fsync=full: the rename happened, the directory fsync failed. The store fails, so its file
    must not stay (unlinked under the ledger lock, its lease ended): nothing uncounted is left."""
    root = tmp_path / "tier"
    tier = make_tier(directory=root, fsync=Fsync.FULL)
    fake = FailingOs(lambda name, *a: name == "fsync")
    monkeypatch.setattr(store_mod, "os", fake)
    assert store(tier, 1) is Status.IO_ERROR and fake.failed == ["fsync"]
    assert not tier.contains(key_for(1)) and walk_root(root) == []
    assert_accounted(root)
    tier.check_integrity()
    monkeypatch.undo()
    assert store(tier, 1) is Status.OK
    assert_accounted(root)


def test_an_unremovable_unsynced_file_stays_indexed_and_counted(
    make_tier, tmp_path: Path, monkeypatch
) -> None:
    """... and if that unlink fails too (the filesystem went read-only after the journal error),
    the file is kept: indexed and counted as published, so the budget still holds."""
    root = tmp_path / "tier"
    tier = make_tier(directory=root, fsync=Fsync.FULL)
    monkeypatch.setattr(store_mod, "os", FailingOs(lambda name, *a: name == "fsync"))
    monkeypatch.setattr(
        sweep_mod, "os", FailingOs(lambda name, *a: name == "unlink" and str(a[0]).endswith(".ext"))
    )
    assert store(tier, 1) is Status.IO_ERROR
    assert tier.contains(key_for(1)) and len(walk_root(root)) == 1
    assert_accounted(root)
    monkeypatch.undo()
    tier.check_integrity()
    buf = bytearray(SIZE)
    assert tier.wait(tier.submit_load(key_for(1), buf), 30).ok and buf == payload_for(1, SIZE).tobytes()


class TempCloseFails:
    """Fails `os.close` of the temp file's descriptor (NFS reports write-back errors at close)."""

    def __init__(self) -> None:
        self.temp_fds: set[int] = set()

    def __call__(self, name: str, *args: Any) -> bool:
        return name == "close" and args[0] in self.temp_fds

    def opened(self, fd: int, flags: int) -> int:
        if flags & os.O_CREAT:
            self.temp_fds.add(fd)
        return fd


@pytest.fixture
def temp_close_fails(monkeypatch) -> FailingOs:
    rule = TempCloseFails()
    fake = FailingOs(rule)
    real_open = os.open
    monkeypatch.setattr(fake, "open", lambda path, flags, *a: rule.opened(real_open(path, flags, *a), flags),
                        raising=False)  # fmt: skip
    monkeypatch.setattr(store_mod, "os", fake)
    return fake


def test_a_close_error_removes_the_temp_file(make_tier, tmp_path: Path, temp_close_fails) -> None:
    root = tmp_path / "tier"
    tier = make_tier(directory=root)
    assert store(tier, 1) is Status.IO_ERROR and temp_close_fails.failed == ["close"]
    assert walk_root(root) == [], "the temp file was left behind"
    assert_accounted(root)
    tier.check_integrity()


def test_an_unremovable_temp_file_stays_counted(
    make_tier, tmp_path: Path, temp_close_fails, monkeypatch
) -> None:
    """A temp file that cannot be removed either stays counted (as published, as a recount of the
    files would count it) until a sweep removes it."""
    root = tmp_path / "tier"
    tier = make_tier(directory=root)
    real_unlink = Path.unlink

    def unlink(self: Path, *a: Any, **kw: Any) -> None:
        if self.name.endswith(".tmp"):
            raise OSError(errno.EIO, "injected unlink failure")
        real_unlink(self, *a, **kw)

    monkeypatch.setattr(Path, "unlink", unlink)
    rule_unlink = temp_close_fails._fails

    def fails(name: str, *args: Any) -> bool:
        return rule_unlink(name, *args) or (name == "unlink" and str(args[0]).endswith(".tmp"))

    temp_close_fails._fails = fails
    assert store(tier, 1) is Status.IO_ERROR
    temps = [f for f in walk_root(root) if f.is_temp]
    assert len(temps) == 1 and temps[0].size > 0
    assert_accounted(root)
