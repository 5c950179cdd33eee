"""Fixtures for the tier tests: a tiny namespace, a config factory, tiers closed after each test."""

from __future__ import annotations

import errno
import multiprocessing
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sgl_hicache.config import TierConfig
from sgl_hicache.tier import Namespace, Tier, open_tier
from tests.tier.common import CHUNK, NS


@pytest.fixture
def make_tier(tmp_path: Path) -> Iterator[Callable[..., Tier]]:
    """Open tiers on `tmp_path` (or `directory=`); all are closed at teardown."""
    opened: list[Tier] = []

    def make(ns: Namespace = NS, **kw: Any) -> Tier:
        kw.setdefault("directory", tmp_path / "tier")
        kw.setdefault("capacity_bytes", 64 << 20)
        kw.setdefault("chunk_bytes", CHUNK)
        kw.setdefault("min_free_bytes", 0)
        kw.setdefault("io_threads", 4)
        tier = open_tier(TierConfig(**kw), ns)
        opened.append(tier)
        return tier

    yield make
    for tier in opened:
        tier.close()


@pytest.fixture
def mount_point(tmp_path: Path) -> Iterator[Callable[[str, str], Path]]:
    """Mount a filesystem (`mount -t <fstype> -o <opts>`) under tmp_path; skip if not permitted. A tier
    directory must not be open to group/other: pass `mode=0700` for a tmpfs the tier uses as its root."""
    mounted: list[Path] = []

    def mount(fstype: str, opts: str) -> Path:
        target = tmp_path / f"mnt{len(mounted)}"
        target.mkdir()
        args = ["mount", "-t", fstype, "-o", opts, fstype, str(target)] if fstype else ["mount", "-o", opts]
        r = subprocess.run(
            args if fstype else [*args, str(tmp_path / "src"), str(target)], capture_output=True
        )
        if r.returncode:
            pytest.skip(f"cannot mount {fstype or 'bind'} here: {r.stderr.decode().strip()}")
        mounted.append(target)
        return target

    yield mount
    for target in reversed(mounted):
        subprocess.run(["umount", "-l", str(target)], check=False)


@dataclass(frozen=True)
class Ext4Volume:
    """A small ext4 image mounted with `errors=remount-ro` (the default of most distributions)."""

    path: Path
    device: str  # the loop device's name, e.g. "loop0"

    def fail(self) -> None:
        """Raise an ext4 error in the kernel (its debug trigger), which turns the volume read-only at
        once, files already open for writing included: what a journal or media error does in
        production. A plain `mount -o remount,ro` is refused while a tier holds its ledger open."""
        Path(f"/sys/fs/ext4/{self.device}/trigger_fs_error").write_text("1")
        with pytest.raises(OSError) as probe:
            (self.path / "probe").touch()
        assert probe.value.errno == errno.EROFS, probe.value


@pytest.fixture
def ext4_volume(tmp_path: Path) -> Iterator[Ext4Volume]:
    """Mount a 16 MiB ext4 image through a loop device; skip where the platform cannot."""
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("mkfs.ext4 not installed")
    image, target = tmp_path / "ext4.img", tmp_path / "ext4"
    target.mkdir()
    with image.open("wb") as f:
        f.truncate(16 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
    r = subprocess.run(
        ["mount", "-o", "loop,errors=remount-ro", str(image), str(target)], capture_output=True
    )
    if r.returncode:
        pytest.skip(f"cannot mount an ext4 image here: {r.stderr.decode().strip()}")
    try:
        source = subprocess.run(
            ["findmnt", "-no", "SOURCE", str(target)], capture_output=True, text=True, check=True
        )
        device = Path(source.stdout.strip()).name
        if not Path(f"/sys/fs/ext4/{device}/trigger_fs_error").exists():
            pytest.skip("this kernel has no ext4 error trigger")
        yield Ext4Volume(target, device)
    finally:
        # lazy: a tier still open is closed after us; the loop device goes with its last file
        subprocess.run(["umount", "-l", str(target)], check=False)


@pytest.fixture
def children() -> Iterator[list[multiprocessing.process.BaseProcess]]:
    started: list[multiprocessing.process.BaseProcess] = []
    yield started
    for p in started:
        if p.is_alive():
            p.kill()
        p.join(10)
