"""The Mooncake tier's warm start against a real master (issue 40): what it could not use is counted,
and the manifest is compacted without losing a live entry.

- Counted: an entry whose extent is gone (its header, or a chunk, evicted or removed) in
  `warm_start_gone`; one whose header is there and fails verification (tampered, another
  deployment's secret, another key's header) is never indexed, its header is removed (a load then
  misses) and counted in `removed_bad_files`, as the file scan counts a foreign or corrupt file; a
  record that does not verify in `manifest_bad_records`. One log line says it all.
- Compaction (manifest.py's contract): at open, when the records read could shrink to half, the
  live entries are written as new records and only then the records read are removed: never a
  record the compactor did not read (another writer's, written since, even into a slot the
  compaction emptied), never any before every new record is confirmed (a failed call midway
  loses nothing); `m/head` never falls back, so a scan still reaches records beyond emptied slots.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sgl_hicache.config import SpillBackend, TierConfig
from sgl_hicache.tier import ExtentKey, IndexedTier, Namespace, Status, open_tier
from sgl_hicache.tier.format import MAC_BYTES, DirectoryMac
from sgl_hicache.tier.mooncake import backend as mooncake_backend
from sgl_hicache.tier.mooncake import manifest as manifest_mod
from sgl_hicache.tier.mooncake.client import Names, Reply, StoreClient, connect
from sgl_hicache.tier.mooncake.manifest import Manifest
from sgl_hicache.tier.trust import open_trusted
from tests.mooncake_master import MooncakeMaster, skip_without_mooncake
from tests.tier.common import CHUNK, payload_for
from tests.tier.test_contract import close_all

skip_without_mooncake()

from tests.tier.test_mooncake import extent_objects, fresh_ns, key_of, load, store  # noqa: E402

MakeTier = Callable[..., IndexedTier]
SLOTS = 256  # record slots these tests look at (they write far fewer)


@pytest.fixture
def holder(mooncake_master: MooncakeMaster) -> Iterator[StoreClient]:
    """A client that only gives the store memory: every object of a test lives in its segment."""
    client = connect(mooncake_master.config(segment_bytes=128 << 20))
    yield client
    client.close()


@pytest.fixture
def make_tier(mooncake_master: MooncakeMaster, holder: StoreClient, tmp_path: Path,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[MakeTier]:  # fmt: skip
    """Mooncake tiers giving the store no memory (`holder`'s segment keeps every object), sealed
    with the secret of `tmp_path/tier` unless given; manifest records are written when a test
    flushes them (or at close) only. `client=`: a function wrapping the tier's client."""
    monkeypatch.setattr(mooncake_backend, "MANIFEST_FLUSH_S", 3600.0)
    opened: list[IndexedTier] = []

    def make(
        ns: Namespace, client: Callable[[StoreClient], StoreClient] | None = None, **kw: Any
    ) -> IndexedTier:
        kw.setdefault("directory", tmp_path / "tier")
        cfg = TierConfig(backend=SpillBackend.MOONCAKE, mooncake=mooncake_master.config(0), chunk_bytes=CHUNK,
                         io_threads=2, **kw)  # fmt: skip
        with monkeypatch.context() as patch:
            if client is not None:
                wrap = client
                patch.setattr(mooncake_backend, "connect", lambda c: wrap(connect(c)))
            opened.append(open_tier(cfg, ns))
        return opened[-1]

    yield make
    close_all(opened)


def records(client: StoreClient, ns: Namespace) -> list[int]:
    """The slots of `ns`'s manifest that hold a record."""
    names = Names(ns.id)
    return [s for s, x in enumerate(client.exist([names.record(s) for s in range(SLOTS)])) if x == 1]


def manifest_of(tier: IndexedTier) -> Manifest:
    return tier._manifest  # type: ignore[attr-defined,no-any-return]


def stored_in_records(tier: IndexedTier, count: int) -> list[ExtentKey]:
    """`count` extents of CHUNK + i bytes, each written to a record of its own (flushed per store)."""
    keys = []
    for i in range(count):
        keys.append(store(tier, i, CHUNK + i))
        assert manifest_of(tier).flush() == 1
    return keys


def garbage(make_tier: MakeTier, ns: Namespace, count: int = 20, live: int = 4) -> list[ExtentKey]:
    """`count` extents in as many records, all but the last `live` removed since; the live keys."""
    tier = make_tier(ns)
    keys = stored_in_records(tier, count)
    done = tier.wait(tier.submit_remove(keys[:-live]), 30)
    assert done.ok and done.nbytes == count - live, done
    tier.close(5)
    return keys[-live:]


def assert_exact(tier: IndexedTier, key: ExtentKey, i: int, nbytes: int) -> None:
    status, got = load(tier, key, nbytes)
    assert status is Status.OK and np.array_equal(got, payload_for(i, nbytes)), status


def test_a_warm_start_counts_what_it_could_not_use_and_never_indexes_a_bad_header(
    make_tier: MakeTier, holder: StoreClient, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Of seven recorded extents: a header tampered, one replaced by another deployment's (another
    secret), one holding another key's sealed header (rejected: removed, a load misses, counted in
    `removed_bad_files`); a header and a chunk removed (gone: `warm_start_gone`); two whole
    (indexed, exact). The other deployment's record is counted in `manifest_bad_records`. One line
    of the log gives the counts."""
    ns = fresh_ns("counted")
    first = make_tier(ns)
    keys = [store(first, i, 2 * CHUNK) for i in range(7)]
    header = [extent_objects(first, k)[0] for k in keys]
    chunks = extent_objects(first, keys[4])[1]
    first.close(5)

    tampered = bytearray(holder.get(header[1]) or b"")
    tampered[40] ^= 1
    assert holder.remove(header[1]).ok and holder.write(header[1], bytes(tampered)).ok
    foreign = make_tier(ns, directory=tmp_path / "other")  # upserts its own header over keys[2]'s
    assert store(foreign, 2, 2 * CHUNK) == keys[2]
    foreign.close(5)
    assert holder.write(header[6], holder.get(header[5]) or b"").ok  # key 5's header under key 6's name
    assert holder.remove(header[3]).ok and holder.remove(chunks[1]).ok

    caplog.clear()
    caplog.set_level(logging.INFO, logger="sgl_hicache.tier")
    again = make_tier(ns)
    assert {e.key for e in again.extents()} == {keys[0], keys[5]}
    s = again.stats()
    assert (s.scanned_extents, s.warm_start_gone, s.removed_bad_files) == (2, 2, 3), s
    assert s.manifest_bad_records == 1 and s.checksum_failures == 0, s
    assert holder.exist([header[i] for i in (1, 2, 6)]) == [0, 0, 0]  # the bad headers went
    for i in (1, 2, 3, 4, 6):
        assert load(again, keys[i], 2 * CHUNK)[0] is Status.MISS, i
    assert_exact(again, keys[0], 0, 2 * CHUNK)
    assert_exact(again, keys[5], 5, 2 * CHUNK)
    lines = [r.getMessage() for r in caplog.records if "warm start" in r.getMessage()]
    assert len(lines) == 1, lines
    assert re.search(r"\b2 gone\b", lines[0]) and re.search(r"\b3 rejected\b", lines[0]), lines[0]


def test_a_manifest_mostly_naming_nothing_is_compacted_and_still_names_every_live_extent(
    make_tier: MakeTier, holder: StoreClient
) -> None:
    """Twenty records, sixteen of their extents removed since: the next open writes the four live
    entries as one record and removes the twenty it read; the open after finds the same four
    (exact), and compacts nothing (one record)."""
    ns = fresh_ns("compact")
    live = garbage(make_tier, ns)
    assert len(records(holder, ns)) == 20
    again = make_tier(ns)
    s = again.stats()
    assert (s.manifest_compactions, s.manifest_records_removed, s.warm_start_gone) == (1, 20, 16), s
    assert len(records(holder, ns)) == 1
    assert {e.key for e in again.extents()} == set(live)
    again.close(5)
    third = make_tier(ns)
    assert {e.key for e in third.extents()} == set(live)
    assert third.stats().manifest_compactions == 0
    for i, key in enumerate(live, start=16):
        assert_exact(third, key, i, CHUNK + i)


def test_a_few_records_are_not_compacted(make_tier: MakeTier, holder: StoreClient) -> None:
    """Below `COMPACT_MIN_RECORDS` records a warm start rewrites nothing, however dead they are."""
    ns = fresh_ns("few")
    garbage(make_tier, ns, count=manifest_mod.COMPACT_MIN_RECORDS - 1, live=1)
    again = make_tier(ns)
    assert again.stats().manifest_compactions == 0
    assert len(records(holder, ns)) == manifest_mod.COMPACT_MIN_RECORDS - 1


class Hooked(StoreClient):
    """A real client that runs `hook` once, before its first `put` (a compaction's first claim)."""

    def __init__(self, inner: StoreClient, hook: Callable[[], None]) -> None:
        super().__init__(inner._store)
        self._hook: Callable[[], None] | None = hook

    def put(self, name: str, data: bytes, copies: int = 1) -> Reply:
        hook, self._hook = self._hook, None
        if hook is not None:
            hook()
        return super().put(name, data, copies)


def test_a_compaction_beside_another_writer_loses_none_of_its_entries(make_tier: MakeTier) -> None:
    """Server A stores twenty extents in twenty records and removes sixteen. Server B opens and
    compacts; between B's scan and its removal, A stores two more and writes their record (into
    the slot B was about to claim), and stores a third it has not recorded yet. B removes only
    the twenty records it read; a server opened after A closes finds all seven live extents."""
    ns = fresh_ns("beside")
    a = make_tier(ns)
    keys = stored_in_records(a, 20)
    assert a.wait(a.submit_remove(keys[:16]), 30).ok
    later: list[ExtentKey] = []

    def meanwhile() -> None:
        later.extend(store(a, i, CHUNK + i) for i in (20, 21))
        assert manifest_of(a).flush() == 1
        later.append(store(a, 22, CHUNK + 22))  # waits for A's next flush (at its close)

    b = make_tier(ns, client=lambda c: Hooked(c, meanwhile))
    assert len(later) == 3, "the compaction did not run"
    assert (b.stats().manifest_compactions, b.stats().manifest_records_removed) == (1, 20)
    a.close(5)
    c = make_tier(ns)
    assert {e.key for e in c.extents()} == {*keys[16:], *later}
    for i, key in [*enumerate(keys[16:], start=16), *enumerate(later, start=20)]:
        assert_exact(c, key, i, CHUNK + i)


def test_two_compactions_at_once_and_a_writer_in_an_emptied_slot_lose_nothing(
    make_tier: MakeTier, holder: StoreClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two compactors read the same twenty records. The first compacts; a writer opened after it
    finds slot 0 empty and records a new extent there. The second compacts: it rewrites the live
    entries (a duplicate record, harmless: records carry a nonce, so it claims a slot of its own) and removes what still holds the records it read, not
    slot 0 (the writer's record, which it never read). A scan then finds the four live entries and
    the writer's. With scan windows of four slots, a scan still reaches the records beyond the
    emptied ones: `m/head` was not lowered by the writer's slot 0, and where a racing writer wrote
    back an older head the scan looks a window beyond it."""
    ns = fresh_ns("twice")
    live = garbage(make_tier, ns)
    seal, names = DirectoryMac(open_trusted(tmp_path / "tier", ns.id.hex())), Names(ns.id)
    m1, m2 = Manifest(holder, names, seal), Manifest(holder, names, seal)
    entries: list[tuple[ExtentKey, bytes | None]] = [(k, None) for k in live]
    for m in (m1, m2):
        assert {k for k, _ in m.scan()} >= set(live)
    done = m1.compact(entries)
    assert done is not None and done.removed == 20, done
    monkeypatch.setattr(manifest_mod, "SCAN_WINDOW", 4)
    writer = Manifest(holder, names, seal)
    writer.scan()
    newcomer = key_of(ns, 99)
    writer.add(newcomer, None)
    assert writer.flush() == 1 and 0 in records(holder, ns)
    assert {k for k, _ in Manifest(holder, names, seal).scan()} == {*live, newcomer}
    # A writer that read `m/head` before the compaction raised it writes what it read (19) back:
    # the window of slots 16-19 is empty now, and a scan still looks one window further.
    assert holder.write(names.head(), b"19").ok
    assert {k for k, _ in Manifest(holder, names, seal).scan()} == {*live, newcomer}
    done = m2.compact(entries)
    assert done is not None and done.removed == 0, done
    assert 0 in records(holder, ns), "the second compactor removed a record it never read"
    assert {k for k, _ in Manifest(holder, names, seal).scan()} == {*live, newcomer}


class FailingPut(StoreClient):
    """A real client whose `put` fails from its `after`-th call on (a store call failing midway)."""

    def __init__(self, inner: StoreClient, after: int) -> None:
        super().__init__(inner._store)
        self.after = after

    def put(self, name: str, data: bytes, copies: int = 1) -> Reply:
        self.after -= 1
        return Reply(code=-1) if self.after < 0 else super().put(name, data, copies)


def test_a_compaction_that_fails_midway_removes_nothing_and_the_next_open_compacts(
    make_tier: MakeTier, holder: StoreClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records of two entries: the four live entries make two new records, and the store fails
    the second's put. No record is removed; the tier opens with every live extent indexed (the
    failure counted as an I/O error); the next open compacts and still finds them all."""
    ns = fresh_ns("fault")
    live = garbage(make_tier, ns)
    monkeypatch.setattr(manifest_mod, "RECORD_ENTRIES", 2)
    failing = make_tier(ns, client=lambda c: FailingPut(c, after=1))
    s = failing.stats()
    assert (s.manifest_compactions, s.manifest_records_removed, s.io_errors) == (0, 0, 1), s
    assert {e.key for e in failing.extents()} == set(live)
    assert len(records(holder, ns)) == 21  # the twenty read, and the one new record confirmed
    failing.close(5)
    again = make_tier(ns)
    assert again.stats().manifest_compactions == 1
    assert {e.key for e in again.extents()} == set(live)
    assert len(records(holder, ns)) == 2


def test_a_store_that_cannot_tell_is_no_reason_to_compact(make_tier: MakeTier, holder: StoreClient) -> None:
    """An existence check the store did not answer marks nothing dead: no compaction, every
    record stays."""
    ns = fresh_ns("unsure")
    garbage(make_tier, ns)

    class Mute(StoreClient):
        def exist(self, names: list[str]) -> list[int]:
            got = super().exist(names)
            return got if any("/m/" in n for n in names) else [-1] * len(names)

    again = make_tier(ns, client=lambda c: Mute(c._store))
    assert again.extents() == [] and again.stats().manifest_compactions == 0
    assert len(records(holder, ns)) == 20


def test_two_records_of_the_same_entries_differ_and_each_writer_claims_its_own_slot(
    holder: StoreClient, tmp_path: Path
) -> None:
    """A record carries a nonce: two writers recording the same entries never share one slot by
    byte-equal read-back (else a compactor could later remove a record written after its scan,
    byte-equal to one it read). A record of the earlier format (no nonce) still reads."""
    ns = fresh_ns("nonce")
    seal, names = DirectoryMac(open_trusted(tmp_path / "tier", ns.id.hex())), Names(ns.id)
    entries: list[tuple[ExtentKey, bytes | None]] = [(key_of(ns, 1), None), (key_of(ns, 2), b"s" * MAC_BYTES)]
    a, b = manifest_mod.encode_record(entries, seal), manifest_mod.encode_record(entries, seal)
    assert a != b and manifest_mod.decode_record(a, seal) == manifest_mod.decode_record(b, seal) == entries
    body = (
        b"SGLHCMR1"
        + (2).to_bytes(4, "little")
        + b"".join(bytes([s is not None]) + k + (s or bytes(MAC_BYTES)) for k, s in entries)
    )
    assert manifest_mod.decode_record(body + seal.record(body), seal) == entries
    m1, m2 = Manifest(holder, names, seal), Manifest(holder, names, seal)
    for m in (m1, m2):
        m.scan()
        m.add(*entries[0])
        assert m.flush() == 1
    assert records(holder, ns) == [0, 1]


class HeadUnanswered(StoreClient):
    """A real client for which the store never answers about `m/head` (a segment holding it is
    unreachable): existence NO_ANSWER, reads None."""

    def __init__(self, inner: StoreClient, names: Names) -> None:
        super().__init__(inner._store)
        self.head = names.head()

    def get(self, name: str) -> bytes | None:
        return None if name == self.head else super().get(name)

    def exist(self, names: list[str]) -> list[int]:
        return [-1 if n == self.head else x for n, x in zip(names, super().exist(names), strict=True)]


def test_an_unanswered_head_is_never_lowered_and_stops_a_compaction(
    make_tier: MakeTier, holder: StoreClient, tmp_path: Path
) -> None:
    """A writer that cannot read `m/head` records its entries but writes no head (it would lower a
    head it cannot see: later scans would stop before records beyond it), and a compaction whose
    scan could not read the head does nothing (its new records might lie beyond a lowered head)."""
    ns = fresh_ns("headless")
    live = garbage(make_tier, ns)
    seal, names = DirectoryMac(open_trusted(tmp_path / "tier", ns.id.hex())), Names(ns.id)
    assert holder.write(names.head(), b"200").ok
    blind = Manifest(HeadUnanswered(holder, names), names, seal)
    assert {k for k, _ in blind.scan()} >= set(live)
    assert blind.compact([(k, None) for k in live]) is None
    assert len(records(holder, ns)) == 20, "a compaction that could not read the head removed records"
    blind.add(key_of(ns, 77), None)
    assert blind.flush() == 1
    assert holder.get(names.head()) == b"200", "a writer that could not read the head lowered it"
