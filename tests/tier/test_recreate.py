"""A tier directory removed while serving is re-created (private, same secret) and stores go on."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from sgl_hicache.tier import ROOT_KEY, Status
from sgl_hicache.tier.file.paths import FANOUT_CHARS
from sgl_hicache.tier.trust import SECRET_BYTES, SECRET_NAME
from tests.tier.common import NS, key_for, payload_for, tokens_for
from tests.tier.test_faults import load, store

RECREATED = "was removed while serving"


@pytest.fixture(autouse=True)
def usual_umask() -> Iterator[None]:
    """umask 022, under which a directory made without an explicit mode would be 0755."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def recreations(caplog: pytest.LogCaptureFixture) -> int:
    return len([r for r in caplog.records if RECREATED in r.getMessage()])


def test_a_removed_directory_is_recreated_private_with_the_same_secret(make_tier, tmp_path, caplog):
    root = tmp_path / "tier"
    tier = make_tier()
    secret = (root / SECRET_NAME).read_bytes()
    assert store(tier, 1) is Status.OK
    shutil.rmtree(root)
    with caplog.at_level(logging.WARNING, logger="sgl_hicache.tier"):
        assert store(tier, 2) is Status.OK
        assert store(tier, 3) is Status.OK
    ns_dir = root / NS.id.hex()
    assert mode(root) == mode(ns_dir) == 0o700
    fanouts = sorted(p for p in ns_dir.iterdir() if p.is_dir())
    assert len(fanouts) == 16**FANOUT_CHARS and {mode(p) for p in fanouts} == {0o700}
    assert mode(root / SECRET_NAME) == 0o600 and (root / SECRET_NAME).read_bytes() == secret
    s = tier.stats()
    assert (s.recreations, s.secret_conflicts, s.io_errors, s.extents) == (1, 0, 0, 2)
    assert recreations(caplog) == 1
    assert not tier.contains(key_for(1)) and load(tier, 1) is Status.MISS  # forgotten, still a clean miss
    tier.check_integrity()  # the index holds exactly the files there are
    tier.close()
    again = make_tier()
    assert again.stats().scanned_extents == 2 and again.stats().removed_bad_files == 0
    assert load(again, 2) is Status.OK and load(again, 3) is Status.OK  # trusted after the restart


def test_a_removed_namespace_directory_alone_is_recreated(make_tier, tmp_path):
    tier = make_tier()
    assert store(tier, 1) is Status.OK
    shutil.rmtree(tmp_path / "tier" / NS.id.hex())
    assert store(tier, 2) is Status.OK
    assert tier.stats().recreations == 1 and tier.stats().extents == 1
    tier.check_integrity()


def test_concurrent_stores_recreate_once(make_tier, tmp_path, caplog):
    tier = make_tier(io_threads=4)
    assert store(tier, 0) is Status.OK
    shutil.rmtree(tmp_path / "tier")
    with caplog.at_level(logging.WARNING, logger="sgl_hicache.tier"):
        tickets = [
            tier.submit_store(key_for(i), payload_for(i, 5000), tokens_for(i), ROOT_KEY) for i in range(1, 21)
        ]
        assert {tier.wait(t, timeout=30).status for t in tickets} == {Status.OK}
    assert tier.stats().recreations == 1 and recreations(caplog) == 1
    tier.check_integrity()


def plant_other_secret(root: Path) -> bytes:
    """What another process opening the empty directory first does: a root with a new secret."""
    other = bytes(range(SECRET_BYTES))
    root.mkdir(mode=0o700)
    (root / SECRET_NAME).write_bytes(other)
    (root / SECRET_NAME).chmod(0o600)
    return other


def test_another_processs_new_secret_is_kept_and_reported_once(make_tier, tmp_path, caplog):
    root = tmp_path / "tier"
    tier = make_tier()
    shutil.rmtree(root)
    other = plant_other_secret(root)
    with caplog.at_level(logging.ERROR, logger="sgl_hicache.tier"):
        assert store(tier, 1) is Status.OK
        shutil.rmtree(root)
        plant_other_secret(root)
        assert store(tier, 2) is Status.OK
    assert (root / SECRET_NAME).read_bytes() == other, "their secret is never overwritten"
    assert tier.stats().secret_conflicts == 2
    assert len([r for r in caplog.records if "new secret" in r.getMessage()]) == 1
    assert load(tier, 2) is Status.OK  # we still trust what we wrote ...
    tier.close()
    again = make_tier()  # ... but a restart, which reads their secret, does not
    assert again.stats().removed_bad_files == 1 and again.stats().extents == 0


def test_a_recreated_root_open_to_others_is_refused(make_tier, tmp_path):
    root = tmp_path / "tier"
    tier = make_tier()
    shutil.rmtree(root)
    root.mkdir()
    root.chmod(0o777)  # e.g. made by another user in a world-writable parent
    assert store(tier, 1) is Status.IO_ERROR
    assert list(root.iterdir()) == [], "nothing is created in an untrusted directory"


@pytest.mark.parametrize("under", [True, False], ids=["root-on-the-volume", "root-is-the-mount"])
def test_nothing_is_recreated_on_another_volume(make_tier, mount_point, under):
    """After an unmount the path leads to the volume below: spilling stops instead of filling it."""
    mnt = mount_point("tmpfs", "size=4m,mode=0700")
    root = mnt / "tier" if under else mnt
    tier = make_tier(directory=root)
    assert store(tier, 1) is Status.OK
    subprocess.run(["umount", "-l", str(mnt)], check=True)
    assert store(tier, 2) is Status.IO_ERROR
    assert not (mnt / "tier").exists() and list(mnt.iterdir()) == []
    assert tier.stats().recreations == 0
