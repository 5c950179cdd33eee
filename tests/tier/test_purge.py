"""The tier's half of the retention hints (issue 27): salt tags in the header (format v5), a purge of
a cache_salt across every namespace of the root (stores in flight included), removal of given
keys, and retention of keys against eviction until a deadline."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sgl_hicache.cli import main as cli_main
from sgl_hicache.tier import ROOT_KEY, KVDtype, KVLayout, Namespace, Tier
from sgl_hicache.tier import format as fmt
from sgl_hicache.tier.file import paths as paths_mod
from sgl_hicache.tier.file.purge import salt_extents
from sgl_hicache.tier.file.retain import Removed
from sgl_hicache.tier.results import Op, Status
from tests.tier.common import NS, key_for, payload_for, tokens_for
from tests.tier.test_store_faults import FailingOs

SIZE = 20_000


def store(tier: Tier, i: int, salt: str | None, store_tokens: bool = False) -> Status:
    ticket = tier.submit_store(key_for(i, tier.namespace), payload_for(i, SIZE), tokens_for(i), ROOT_KEY,
                               store_tokens=store_tokens, cache_salt=salt)  # fmt: skip
    return tier.wait(ticket, timeout=30).status


def purge(tier: Tier, salt: str) -> int:
    done = tier.wait(tier.submit_purge(salt), timeout=30)
    assert done.op is Op.PURGE and done.ok
    return done.nbytes


def files(root: Path) -> set[str]:
    return {p.name for p in root.rglob("*.ext")}


def test_the_header_carries_a_keyed_tag_never_the_salt(
    make_tier: Callable[..., Tier], tmp_path: Path
) -> None:
    tier = make_tier()
    assert store(tier, 1, "tenant-secret-salt") is Status.OK
    data = next((tmp_path / "tier").rglob("*.ext")).read_bytes()
    assert int.from_bytes(data[8:10], "little") == fmt.VERSION == 6
    assert b"tenant-secret-salt" not in data


def test_a_purge_removes_the_salts_extents_in_every_namespace_and_nothing_else(
    make_tier: Callable[..., Tier], tmp_path: Path
) -> None:
    other_rank = Namespace("test-model", KVLayout(2, 2, 64, KVDtype.BF16, 4), tp_rank=1, tp_size=2)
    a, b = make_tier(), make_tier(ns=other_rank)
    for tier, base in ((a, 0), (b, 10)):
        assert store(tier, base + 1, "s1") is Status.OK
        assert store(tier, base + 2, "s2") is Status.OK
        assert store(tier, base + 3, None, store_tokens=True) is Status.OK  # the default tenant
    kept = {key_for(i, ns).hex() + ".ext" for i, ns in ((2, NS), (3, NS), (12, other_rank), (13, other_rank))}
    assert purge(a, "s1") == 2  # its own and the other rank's
    assert files(tmp_path / "tier") == kept
    assert not a.contains(key_for(1)) and a.contains(key_for(2))
    assert a.stats().purged_extents == 2
    assert list(salt_extents(tmp_path / "tier", a._seal.salt("s1"), a._seal)) == []  # type: ignore[attr-defined]
    assert cli_main(["fsck", str(tmp_path / "tier"), "--cache-salt", "s1"]) == 0
    assert cli_main(["fsck", str(tmp_path / "tier"), "--cache-salt", "s2"]) == 1  # s2 is still there


def test_a_store_in_flight_when_its_salt_is_purged_leaves_no_file(
    make_tier: Callable[..., Tier], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The purge's scan runs while the store writes its temp file (a slow disk): the store's job
    removes the file it publishes afterwards."""
    from sgl_hicache.tier.file import store as store_module

    slow = store_module._write_chunks
    monkeypatch.setattr(store_module, "_write_chunks", lambda *a: time.sleep(0.5) or slow(*a))
    tier = make_tier(io_threads=3)  # two writes at once: the purge does not queue behind the store
    ticket = tier.submit_store(key_for(7), payload_for(7, SIZE), tokens_for(7), ROOT_KEY, cache_salt="s")
    assert purge(tier, "s") == 0  # found nothing published
    done = tier.wait(ticket, timeout=30)
    assert done.status is Status.REJECTED and "purged" in done.detail
    assert files(tmp_path / "tier") == set() and not tier.contains(key_for(7))
    assert store(tier, 7, "s") is Status.OK  # later data of the salt is new data: kept


def test_older_extents_without_token_ids_are_purged_with_any_salt(
    make_tier: Callable[..., Tier], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """v4 recorded no salt: one without token ids may be any salted tenant's, so it goes; one with
    token ids is the default tenant's and stays."""
    monkeypatch.setattr(fmt, "VERSION", 4)
    tier = make_tier()
    assert store(tier, 1, "s") is Status.OK  # tagged: told apart even in a v4 file
    assert store(tier, 2, None) is Status.OK  # as a v4 writer stored any salted tenant: no ids, no tag
    assert store(tier, 3, None, store_tokens=True) is Status.OK
    monkeypatch.setattr(fmt, "VERSION", 5)
    assert cli_main(["fsck", str(tmp_path / "tier"), "--cache-salt", "another"]) == 1  # salt? for 2
    assert purge(tier, "another") == 1
    assert files(tmp_path / "tier") == {key_for(i).hex() + ".ext" for i in (1, 3)}
    assert purge(tier, "s") == 1
    assert files(tmp_path / "tier") == {key_for(3).hex() + ".ext"}


def test_removed_keys_go_even_while_retained(make_tier: Callable[..., Tier], tmp_path: Path) -> None:
    tier = make_tier()
    assert store(tier, 1, None) is Status.OK and store(tier, 2, None) is Status.OK
    tier.retain([key_for(1)], time.monotonic() + 60)
    done = tier.wait(tier.submit_remove([key_for(1), key_for(5)]), timeout=30)
    assert done.op is Op.REMOVE and done.ok and done.nbytes == 1
    assert files(tmp_path / "tier") == {key_for(2).hex() + ".ext"}
    assert tier.stats().retained_extents == 0


def test_retained_extents_outlive_eviction_until_their_deadline(make_tier: Callable[..., Tier]) -> None:
    tier = make_tier(capacity_bytes=5 * (SIZE + 8192))  # room for about five extents
    assert store(tier, 0, None) is Status.OK
    tier.retain([key_for(0)], time.monotonic() + 1.0)
    for i in range(1, 12):  # LRU would take extent 0 first
        assert store(tier, i, None) is Status.OK
    assert tier.contains(key_for(0)) and tier.stats().retained_extents == 1
    assert not tier.contains(key_for(1))
    time.sleep(1.1)
    for i in range(12, 18):
        assert store(tier, i, None) is Status.OK
    assert not tier.contains(key_for(0)) and tier.stats().retained_extents == 0


def test_a_file_that_cannot_be_read_is_never_called_free_of_the_salt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EIO or EACCES on an extent: a purge removes it and fsck reports it; only a file that is gone
    (ENOENT) holds nothing."""
    import errno
    import os

    from sgl_hicache.tier.file import purge

    def failing(code: int) -> Any:
        def open_(path: str, flags: int, *args: Any) -> int:
            raise OSError(code, os.strerror(code), path)

        return open_

    for code, want in ((errno.EIO, purge.UNREADABLE), (errno.EACCES, purge.UNREADABLE), (errno.ENOENT, None)):
        monkeypatch.setattr(purge.os, "open", failing(code))
        mark = purge.salt_mark(str(tmp_path / "x.ext"), seal=None)  # type: ignore[arg-type]
        assert mark == want
        assert purge.belongs(mark, b"tag") is (want is not None)


def test_a_purge_cut_short_mid_walk_completes_when_sent_again(
    make_tier: Callable[..., Tier], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash inside the walk after three removals (raised by the 4th unlink, of this namespace's
    files or another model's): the purge fails; the same purge again removes the rest and succeeds,
    and the index stays whole."""
    from sgl_hicache.tier.file.budget.shared import SharedBudget

    other_model = Namespace("another-model", KVLayout(2, 2, 64, KVDtype.BF16, 4))
    tier, other = make_tier(), make_tier(ns=other_model)
    for i in range(6):
        assert store(tier, i, "s") is Status.OK
    for i in range(2):
        assert store(other, 10 + i, "s") is Status.OK
    assert store(tier, 20, "kept") is Status.OK
    real, calls = SharedBudget.unlink, [0]

    def crashing(budget: SharedBudget, path: str) -> bool:
        calls[0] += 1
        if calls[0] > 3:
            raise RuntimeError("crash mid-walk")
        return real(budget, path)

    monkeypatch.setattr(SharedBudget, "unlink", crashing)
    cut = tier.wait(tier.submit_purge("s"), timeout=30)
    monkeypatch.setattr(SharedBudget, "unlink", real)
    assert not cut.ok and len(files(tmp_path / "tier")) == 1 + 8 - 3, cut
    assert purge(tier, "s") == 5
    assert files(tmp_path / "tier") == {key_for(20).hex() + ".ext"}
    assert purge(tier, "s") == 0  # once more: nothing left, still a success
    tier.check_integrity()
    assert cli_main(["fsck", str(tmp_path / "tier"), "--cache-salt", "s"]) == 0


def test_a_purge_cut_short_by_an_io_error_is_retried_until_done(
    make_tier: Callable[..., Tier], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 40: a purge that failed (EIO mid-walk) completes IO_ERROR and runs again on the tier's
    periodic refresh, counted in `purge_retries`, until the salt's files are gone."""
    tier: Any = make_tier()
    assert store(tier, 1, "s1") is Status.OK and store(tier, 2, "s2") is Status.OK
    purge_once, failures = tier._retention._purge, [OSError(5, "injected EIO")]

    def fails_once(tag: bytes) -> Removed:
        return Removed(0, failures.pop()) if failures else purge_once(tag)

    monkeypatch.setattr(tier._retention, "_purge", fails_once)
    done = tier.wait(tier.submit_purge("s1"), timeout=30)
    assert done.status is Status.IO_ERROR
    deadline = time.monotonic() + 10
    while key_for(1).hex() + ".ext" in files(tmp_path / "tier"):
        assert time.monotonic() < deadline, "the failed purge was not retried"
        time.sleep(0.05)
    assert tier.stats().purge_retries >= 1
    assert key_for(2).hex() + ".ext" in files(tmp_path / "tier")


def test_a_purge_cut_short_by_an_io_error_counts_the_files_it_removed(
    make_tier: Callable[..., Tier], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EIO listing the fan-out directory the walk reaches last, after the files of the others went:
    the purge completes IO_ERROR with `nbytes` the files it removed, as `purged_extents` counts them
    (before: `nbytes` 0), and is still owed: retried until the rest are gone, each counted once.
    The retry counts its removal just after the unlink, on an I/O thread: the test waits for both."""
    tier: Any = make_tier()
    for i in range(8):
        assert store(tier, i, "s") is Status.OK
    root = tmp_path / "tier"
    with os.scandir(tier._budget.paths.ns_dir) as it:
        walked = [Path(de.path) for de in it]  # the walk's order of fan-out directories
    last = max({p.parent for p in root.rglob("*.ext")}, key=walked.index)
    monkeypatch.setattr(paths_mod, "os", FailingOs(lambda name, *a: name == "scandir" and Path(a[0]) == last))
    done = tier.wait(tier.submit_purge("s"), timeout=30)
    assert files(root) == {p.name for p in last.glob("*.ext")} and len(files(root)) == 1
    assert (done.status, done.nbytes, tier.stats().purged_extents) == (Status.IO_ERROR, 7, 7)
    monkeypatch.undo()
    deadline = time.monotonic() + 10
    while files(root) or tier.stats().purged_extents < 8:
        assert time.monotonic() < deadline, "the purge cut short was not retried, or not counted"
        time.sleep(0.05)
    assert tier.stats().purged_extents == 8


def test_a_removal_cut_short_counts_what_went_and_still_unlinks_the_rest(
    make_tier: Callable[..., Tier], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The unlink of the second of three removed keys raises (a bug): the first and the third go
    all the same and both are counted (`purged_extents`, the completion's `nbytes`), the removal
    ends IO_ERROR, and no key is left dying in the index (before: the job stopped at the raise,
    counting nothing and leaving the third marked dying); sent again, it removes the rest."""
    from sgl_hicache.tier.file.budget.shared import SharedBudget

    tier = make_tier()
    keys = [key_for(i) for i in range(3)]
    for i in range(3):
        assert store(tier, i, None) is Status.OK
    real = SharedBudget.unlink

    def raises_for_the_second(budget: SharedBudget, path: str) -> bool:
        if Path(path).name.startswith(keys[1].hex()):
            raise RuntimeError("a bug in the unlink")
        return real(budget, path)

    monkeypatch.setattr(SharedBudget, "unlink", raises_for_the_second)
    done = tier.wait(tier.submit_remove(keys), timeout=30)
    assert (done.status, done.nbytes, tier.stats().purged_extents) == (Status.IO_ERROR, 2, 2)
    assert files(tmp_path / "tier") == {keys[1].hex() + ".ext"}
    monkeypatch.undo()
    assert tier.wait(tier.submit_remove([keys[1]]), timeout=30).nbytes == 1  # sent again: the rest goes
    assert not files(tmp_path / "tier")
    tier.check_integrity()
