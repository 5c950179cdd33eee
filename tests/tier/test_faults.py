"""Faults come back as results (never raised), are counted, and logged once per condition."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sgl_hicache.config import TierConfig
from sgl_hicache.tier import ROOT_KEY, Status
from sgl_hicache.tier.file.budget import process as capacity_module
from tests.tier.common import key_for, payload_for, tokens_for

ROOT = Path(__file__).resolve().parents[2]


def store(tier, i: int, n: int = 5000) -> Status:
    return tier.wait(
        tier.submit_store(key_for(i), payload_for(i, n), tokens_for(i), ROOT_KEY), timeout=30
    ).status


def load(tier, i: int, n: int = 5000) -> Status:
    buf = bytearray(n)
    done = tier.wait(tier.submit_load(key_for(i), buf), timeout=30)
    assert not done.ok or bytes(buf) == payload_for(i, n).tobytes()
    return done.status


def test_enospc_on_small_filesystem(make_tier, mount_point, monkeypatch):
    small = mount_point("tmpfs", "size=1m,mode=0700")
    tier = make_tier(directory=small)
    assert store(tier, 1, 300_000) is Status.OK
    assert store(tier, 2, 2_000_000) is Status.NO_SPACE  # refused by the free-space check
    monkeypatch.setattr(capacity_module, "free_bytes", lambda _: 1 << 40)  # so the write itself hits ENOSPC
    assert store(tier, 3, 900_000) is Status.NO_SPACE
    assert tier.stats().no_space == 2 and load(tier, 1, 300_000) is Status.OK
    assert not list(small.rglob("*.tmp"))
    tier.check_integrity()


def test_direct_io_fallback_on_ramfs(make_tier, mount_point):
    ram = mount_point("ramfs", "mode=0700")  # ramfs refuses O_DIRECT
    tier = make_tier(directory=ram)
    assert store(tier, 1, 70_000) is Status.OK and load(tier, 1, 70_000) is Status.OK
    s = tier.stats()
    assert (s.direct_io, s.buffered_loads) == (False, 1)


def test_direct_io_disabled_by_config(make_tier):
    tier = make_tier(direct_io=False)
    assert store(tier, 1) is Status.OK and load(tier, 1) is Status.OK
    assert not tier.stats().direct_io


def test_a_volume_gone_read_only_fails_stores_and_keeps_loads(make_tier, ext4_volume, caplog):
    """ext4 turned read-only under a live tier (EROFS from the kernel, the ledger's open file too)."""
    tier = make_tier(directory=ext4_volume.path / "tier")
    assert store(tier, 1) is Status.OK
    ext4_volume.fail()
    with caplog.at_level(logging.WARNING, logger="sgl_hicache.tier"):
        assert store(tier, 2) is Status.IO_ERROR
        assert tier.stats().io_errors == 1
        assert [store(tier, i) for i in (3, 4)] == [Status.IO_ERROR] * 2
    assert load(tier, 1) is Status.OK and load(tier, 2) is Status.MISS  # load checks the bytes
    assert tier.stats().io_errors == 3
    assert len([r for r in caplog.records if "EROFS" in r.getMessage()]) == 1
    tier.check_integrity()  # no lease or reservation left by the failed stores


def test_directory_gone_for_good_is_logged_once(make_tier, tmp_path, caplog):
    """Its parent went too, so it cannot be re-created (a removed tier directory is: test_recreate.py)."""
    tier = make_tier(directory=tmp_path / "volume" / "tier")
    assert store(tier, 1) is Status.OK
    shutil.rmtree(tmp_path / "volume")
    with caplog.at_level(logging.WARNING, logger="sgl_hicache.tier"):
        statuses = [store(tier, i) for i in range(2, 7)]
    assert statuses == [Status.IO_ERROR] * 5
    assert load(tier, 1) is Status.MISS
    assert tier.stats().io_errors == 5
    assert len([r for r in caplog.records if "store:ENOENT" in r.getMessage()]) == 1


CHILD = """
import json, sys
from pathlib import Path
from sgl_hicache.config import TierConfig
from sgl_hicache.tier import open_tier
from tests.tier.common import NS, CHUNK
from tests.tier.test_faults import store, load
tier = open_tier(TierConfig(directory=Path(sys.argv[1]), chunk_bytes=CHUNK, min_free_bytes=0), NS)
print(json.dumps([store(tier, 2).value, load(tier, 1).value, tier.stats().io_errors]))
tier.close()
"""


def test_permission_denied_without_dac_override(make_tier, tmp_path):
    """We run as root, so drop CAP_DAC_OVERRIDE in a child (setpriv) to meet EACCES."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv not installed: cannot drop CAP_DAC_OVERRIDE as root")
    tier = make_tier()
    assert store(tier, 1) is Status.OK
    tier.close()
    for d in [tier._paths.ns_dir, *tier._paths.ns_dir.iterdir()]:
        d.chmod(0o500)
    caps = "-dac_override,-dac_read_search"
    cmd = [
        "setpriv",
        f"--inh-caps={caps}",
        f"--bounding-set={caps}",
        sys.executable,
        "-c",
        CHILD,
        str(tmp_path / "tier"),
    ]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == ["io_error", "ok", 1]


def test_eio_is_a_result_and_keeps_the_extent(make_tier, monkeypatch):
    """No device that fails on demand here: inject EIO at the I/O call the tier makes."""
    import errno

    from sgl_hicache.tier.file import load as load_module
    from sgl_hicache.tier.file import store as store_module

    tier = make_tier()
    assert store(tier, 1) is Status.OK

    def eio(*_args):
        raise OSError(errno.EIO, "Input/output error")

    with monkeypatch.context() as m:
        m.setattr(load_module, "pread_exact", eio)
        m.setattr(store_module, "pwritev_exact", eio)
        assert load(tier, 1) is Status.IO_ERROR
        assert store(tier, 2) is Status.IO_ERROR
    assert tier.contains(key_for(1)) and load(tier, 1) is Status.OK  # EIO is not corruption
    s = tier.stats()
    assert (s.io_errors, s.checksum_failures, s.store_failures) == (2, 0, 1)
    tier.check_integrity()  # no temp file, no reservation left behind


def test_a_file_tiers_loads_never_say_their_destination_may_still_be_written(make_tier, monkeypatch):
    """Its reads end with their call: whatever a load's outcome, nothing writes its destination
    after its completion (`Completion.dest_unsafe` False), unlike a Mooncake transfer given up on."""
    import errno

    from sgl_hicache.tier.file import load as load_module

    tier = make_tier()
    assert store(tier, 1) is Status.OK

    def loaded(i: int):
        return tier.wait(tier.submit_load(key_for(i), bytearray(5000)), timeout=30)

    def eio(*_args):
        raise OSError(errno.EIO, "Input/output error")

    done = [loaded(1), loaded(2)]
    with monkeypatch.context() as m:
        m.setattr(load_module, "pread_exact", eio)
        done.append(loaded(1))
    assert [c.status for c in done] == [Status.OK, Status.MISS, Status.IO_ERROR]
    assert [c.dest_unsafe for c in done] == [False] * 3


def test_a_bug_in_a_job_is_logged_and_completed(make_tier, monkeypatch, caplog):
    from sgl_hicache.tier.file import backend as nvme_module

    tier = make_tier()
    assert store(tier, 1) is Status.OK

    def boom(*_args):
        raise ValueError("bug")

    monkeypatch.setattr(nvme_module, "read_chunk", boom)
    with caplog.at_level(logging.ERROR, logger="sgl_hicache.tier"):
        assert load(tier, 1) is Status.IO_ERROR
    assert any("failed unexpectedly" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    assert load(tier, 1) is Status.OK  # not dropped, threads alive


def test_a_volume_smaller_than_the_watermark_refuses_every_store(make_tier, mount_point):
    """The tier says so in the config's terms (`VolumeShort`); the server words it with the flag and
    warns at open (tests/server/test_flags.py)."""
    from sgl_hicache.tier.file.volume import MIN_EXTENT_BYTES, VolumeShort, too_small

    small = mount_point("tmpfs", "size=1m,mode=0700")
    tier = make_tier(directory=small, min_free_bytes=1 << 30)
    assert store(tier, 1) is Status.NO_SPACE and store(tier, 2) is Status.NO_SPACE
    short = too_small(TierConfig(directory=small, min_free_bytes=1 << 30), small)
    assert short == VolumeShort(small, 1 << 20, 1 << 30, MIN_EXTENT_BYTES)
