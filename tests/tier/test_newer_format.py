"""Rolling upgrades lose nothing (issue 38, 10): an extent of a newer format version, which a newer
sgl_hicache sharing the directory wrote, is never deleted by this one. The scan, a load, a warm
start's token read, a purge and `sgl-hicache fsck --repair` skip it and count it (`newer_extents`),
never as corrupt.

The newer file is one of ours with its version field raised and its header MAC recomputed with the
directory's secret: valid in every other respect."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from sgl_hicache.cli import main as cli_main
from sgl_hicache.tier import ROOT_KEY, Status, Tier
from sgl_hicache.tier import format as fmt
from sgl_hicache.tier.format import FIXED_SIZE, MAC_BYTES, DirectoryMac
from sgl_hicache.tier.trust import SECRET_NAME
from tests.tier.common import key_for, payload_for, tokens_for

SIZE = 20_000
NEWER = fmt.VERSION + 1


def store(tier: Tier, i: int, salt: str | None = None) -> None:
    ticket = tier.submit_store(key_for(i), payload_for(i, SIZE), tokens_for(i), ROOT_KEY, cache_salt=salt)
    assert tier.wait(ticket, timeout=30).ok


def path_of(root: Path, i: int) -> Path:
    return next(root.rglob(key_for(i).hex() + fmt.EXTENT_SUFFIX))


def make_newer(root: Path, i: int, version: int = NEWER) -> Path:
    """Set extent `i`'s format version, re-sealing its fixed header as a writer of it would."""
    path = path_of(root, i)
    data = bytearray(path.read_bytes())
    data[8:10] = version.to_bytes(2, "little")
    maced = FIXED_SIZE - MAC_BYTES
    data[maced:FIXED_SIZE] = DirectoryMac((root / SECRET_NAME).read_bytes()).header(bytes(data[:maced]))
    path.write_bytes(bytes(data))
    assert fmt.version_of(path.read_bytes()[:FIXED_SIZE]) == version
    return path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "tier"


def test_the_scan_at_open_keeps_and_counts_a_newer_extent(make_tier: Callable[..., Tier], root: Path) -> None:
    first = make_tier()
    store(first, 1)
    store(first, 2)
    first.close()
    newer = make_newer(root, 1)
    tier = make_tier()
    s = tier.stats()
    assert newer.exists() and not tier.contains(key_for(1)) and tier.contains(key_for(2))
    assert (s.newer_extents, s.removed_bad_files, s.checksum_failures) == (1, 0, 0), s


def test_a_load_and_a_token_read_of_a_newer_extent_miss_without_deleting_it(
    make_tier: Callable[..., Tier], root: Path
) -> None:
    tier = make_tier()
    store(tier, 1)
    newer = make_newer(root, 1)
    assert tier.read_tokens(key_for(1)) is None and newer.exists()
    done = tier.wait(tier.submit_load(key_for(1), bytearray(SIZE)), timeout=30)
    assert done.status is Status.MISS and newer.exists(), done
    s = tier.stats()
    assert s.newer_extents == 2 and (s.checksum_failures, s.removed_bad_files) == (0, 0), s
    assert not tier.contains(key_for(1)), "forgotten: it cannot be read here"


def test_a_purge_keeps_a_newer_extent_of_its_salt(make_tier: Callable[..., Tier], root: Path) -> None:
    """Which salt a newer file holds cannot be told by this version: the newer server's purge removes it."""
    tier = make_tier()
    store(tier, 1, "s")
    store(tier, 2, "s")
    newer = make_newer(root, 1)
    done = tier.wait(tier.submit_purge("s"), timeout=30)
    assert done.ok and done.nbytes == 1 and newer.exists() and not path_of_exists(root, 2)
    assert tier.stats().newer_extents == 1


def path_of_exists(root: Path, i: int) -> bool:
    return any(root.rglob(key_for(i).hex() + fmt.EXTENT_SUFFIX))


def test_fsck_repair_keeps_a_newer_extent_and_says_so(
    make_tier: Callable[..., Tier], root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tier = make_tier()
    store(tier, 1)
    store(tier, 2)
    tier.close()
    newer = make_newer(root, 1)
    assert cli_main(["fsck", str(root), "--repair"]) == 0
    out = capsys.readouterr().out
    assert newer.exists() and "corrupt" not in out and f"newer  {newer}" in out, out
    assert "1 of a newer format version (kept)" in out, out
    assert cli_main(["fsck", str(root), "--cache-salt", "s"]) == 0  # not listed as a salt's


def test_an_older_version_is_still_removed(make_tier: Callable[..., Tier], root: Path) -> None:
    """Only newer versions are kept: an unreadable older one (v2) is debris, as before."""
    first = make_tier()
    store(first, 1)
    first.close()
    path = make_newer(root, 1, version=2)
    tier = make_tier()
    assert not path.exists() and tier.stats().removed_bad_files == 1
