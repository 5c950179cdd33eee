"""Fixtures for the tier tests: a tiny namespace, a config factory, tiers closed after each test."""

from __future__ import annotations

import multiprocessing
import subprocess
from collections.abc import Callable, Iterator
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


@pytest.fixture
def children() -> Iterator[list[multiprocessing.process.BaseProcess]]:
    started: list[multiprocessing.process.BaseProcess] = []
    yield started
    for p in started:
        if p.is_alive():
            p.kill()
        p.join(10)
