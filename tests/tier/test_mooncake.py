"""The Mooncake Store tier against a real master and clients on loopback (issue 26): what a store
of objects adds to the contract both backends pass (test_contract.py).

Every load is bit-exact or refused: objects another deployment or a tamperer wrote (CORRUPT /
MISMATCH, never bytes), keys the master evicted or another client removed (a clean MISS), a master
restart mid-run (failed operations come back as statuses, none raises; then stores and loads work
again). Issue 40: a store and a load are a few calls of the store, whatever the number of chunks
(counted on the real store by `CallRecorder`); a tier opened again on the store finds what was
stored (warm start); a purge removes every object of its salt, and one the store failed is retried.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sgl_hicache.config import MooncakeConfig, SpillBackend, TierConfig
from sgl_hicache.tier import ROOT_KEY, ExtentKey, IndexedTier, Namespace, Status, chain_key, open_tier
from sgl_hicache.tier.mooncake import backend as mooncake_backend
from sgl_hicache.tier.mooncake import objects
from sgl_hicache.tier.mooncake.client import Names, Reply, StoreClient, connect
from sgl_hicache.tier.mooncake.manifest import Manifest
from tests.mooncake_master import MooncakeMaster, skip_without_mooncake
from tests.tier.common import CHUNK, NS, payload_for
from tests.tier.test_contract import close_all

skip_without_mooncake()

MakeTier = Callable[..., IndexedTier]


@pytest.fixture
def master(mooncake_master: MooncakeMaster) -> MooncakeMaster:
    return mooncake_master


@pytest.fixture
def make_tier(master: MooncakeMaster, tmp_path: Path) -> Iterator[MakeTier]:
    """Mooncake tiers (clients of `master`) sealed with the secret of `tmp_path/tier` unless given."""
    opened: list[IndexedTier] = []

    def make(ns: Namespace = NS, segment_bytes: int = 64 << 20, master_: MooncakeMaster | None = None,
             placement: str = "any", **kw: Any) -> IndexedTier:  # fmt: skip
        kw.setdefault("directory", tmp_path / "tier")
        kw.setdefault("chunk_bytes", CHUNK)
        kw.setdefault("io_threads", 4)
        mooncake = dataclasses.replace((master_ or master).config(segment_bytes), placement=placement)
        cfg = TierConfig(backend=SpillBackend.MOONCAKE, mooncake=mooncake, **kw)
        tier = open_tier(cfg, ns)
        opened.append(tier)
        return tier

    yield make
    close_all(opened)


def fresh_ns(name: str) -> Namespace:
    """A namespace of its own per test: tests share the module's master."""
    return Namespace(f"{name}-{time.monotonic_ns()}", NS.layout)


def key_of(ns: Namespace, i: int) -> ExtentKey:
    return chain_key(ns.id, ROOT_KEY, [i, i + 1])


def store(tier: IndexedTier, i: int, nbytes: int) -> ExtentKey:
    key = key_of(tier.namespace, i)
    done = tier.wait(tier.submit_store(key, payload_for(i, nbytes), [i, i + 1], ROOT_KEY), 30)
    assert done.ok, done
    return key


def load(
    tier: IndexedTier, key: ExtentKey, nbytes: int, want: int | None = None
) -> tuple[Status, np.ndarray]:
    dest = np.zeros(nbytes, dtype=np.uint8)
    done = tier.wait(tier.submit_load(key, dest, want), 30)
    assert done.ok == (done.status is Status.OK)
    if done.ok:
        assert done.nbytes == (nbytes if want is None else want)
    return done.status, dest


def extent_objects(tier: IndexedTier, key: ExtentKey) -> tuple[str, list[str]]:
    """The names of `key`'s header and chunk objects, as `tier` finds them (with its salt of `key`)."""
    t: Any = tier
    ext = objects.open_header(t._client, t._names, t.namespace.id, key, t._salt(key), t._seal, t._scratch)
    return t._names.header(key, ext.salt), ext.chunk_names(t._names)


def test_a_second_store_of_a_key_writes_nothing_and_keeps_the_first(make_tier: MakeTier) -> None:
    tier = make_tier(fresh_ns("again"))
    key = store(tier, 3, 10_000)
    done = tier.wait(tier.submit_store(key, payload_for(3, 10_000), [3, 4], ROOT_KEY), 30)
    assert done.ok
    assert np.array_equal(load(tier, key, 10_000)[1], payload_for(3, 10_000))


def test_objects_not_sealed_with_our_secret_are_refused(make_tier: MakeTier, tmp_path: Path) -> None:
    ns = fresh_ns("foreign")
    foreign = make_tier(ns, directory=tmp_path / "other")  # another deployment: another secret
    key = store(foreign, 5, 3 * CHUNK)
    ours = make_tier(ns)
    status, _got = load(ours, key, 3 * CHUNK)
    assert status is Status.CORRUPT
    assert ours.stats().checksum_failures == 1
    assert load(ours, key, 3 * CHUNK)[0] is Status.MISS  # the bad header was dropped
    key2 = store(foreign, 6, 3 * CHUNK)  # a store over another deployment's objects writes ours
    assert store(ours, 6, 3 * CHUNK) == key2
    status, got = load(ours, key2, 3 * CHUNK)
    assert status is Status.OK and np.array_equal(got, payload_for(6, 3 * CHUNK))


def test_a_tampered_chunk_is_corrupt_and_a_borrowed_header_a_mismatch(make_tier: MakeTier) -> None:
    ns = fresh_ns("tamper")
    tier = make_tier(ns)
    client, names = tier._client, Names(ns.id)  # type: ignore[attr-defined]
    key = store(tier, 2, 2 * CHUNK)
    bad = payload_for(2, CHUNK).copy()
    bad[100] ^= 1
    chunk = extent_objects(tier, key)[1][1]
    assert client.remove(chunk).ok and client.write(chunk, bad.tobytes()).ok
    assert load(tier, key, 2 * CHUNK)[0] is Status.CORRUPT
    assert load(tier, key, CHUNK)[0] is Status.MISS  # dropped: never served, even its good prefix

    key_a, key_b = store(tier, 10, CHUNK), key_of(ns, 11)  # b's header is a's, sealed and all
    header = client.get(names.header(key_a))
    assert header is not None and client.write(names.header(key_b), header).ok
    assert load(tier, key_b, CHUNK)[0] in (Status.CORRUPT, Status.MISMATCH)


def test_a_key_another_client_removed_is_a_clean_miss(make_tier: MakeTier) -> None:
    ns = fresh_ns("removed")
    writer, other = make_tier(ns), make_tier(ns)
    keys = [store(writer, i, 2 * CHUNK) for i in range(3)]
    other._client.remove(extent_objects(writer, keys[0])[0])  # type: ignore[attr-defined]
    other._client.remove(extent_objects(writer, keys[1])[1][1])  # type: ignore[attr-defined]
    assert load(writer, keys[0], 2 * CHUNK)[0] is Status.MISS
    assert load(writer, keys[1], 2 * CHUNK)[0] is Status.MISS
    assert not writer.contains(keys[0]) and not writer.contains(keys[1])
    status, got = load(writer, keys[2], 2 * CHUNK)
    assert status is Status.OK and np.array_equal(got, payload_for(2, 2 * CHUNK))


def test_what_the_master_evicts_is_a_clean_miss(make_tier: MakeTier) -> None:
    """A store four times the size of the only segment: the master evicts; whatever loads is exact."""
    ns = fresh_ns("evict")
    tier = make_tier(ns, segment_bytes=16 << 20)  # Mooncake's least segment
    stored = []
    for i in range(64):  # 64 MiB into 16 MiB
        key = key_of(ns, i)
        done = tier.wait(tier.submit_store(key, payload_for(i, 1 << 20), [i, i + 1], ROOT_KEY), 30)
        if done.ok:
            stored.append((i, key))
        else:
            assert done.status in (Status.NO_SPACE, Status.IO_ERROR), done
    outcomes = {}
    for i, key in stored:
        status, got = load(tier, key, 1 << 20)
        assert status in (Status.OK, Status.MISS), status
        assert status is not Status.OK or np.array_equal(got, payload_for(i, 1 << 20))
        outcomes[i] = status
    assert Status.MISS in outcomes.values(), "nothing was evicted: the test proves nothing"
    assert Status.OK in outcomes.values()


def test_a_master_restart_mid_run_is_survived(make_tier: MakeTier, tmp_path: Path) -> None:
    own = MooncakeMaster(tmp_path)
    own.start()
    tier = None
    try:
        ns = fresh_ns("restart")
        tier = make_tier(ns, master_=own)
        before = store(tier, 1, 2 * CHUNK)
        own.restart()  # every object is gone with it
        outcomes = [load(tier, before, 2 * CHUNK)[0]]
        deadline, recovered = time.monotonic() + 30, False
        i = 2
        while not recovered and time.monotonic() < deadline:
            key = key_of(ns, i)
            done = tier.wait(tier.submit_store(key, payload_for(i, 2 * CHUNK), [i, i + 1], ROOT_KEY), 30)
            status, got = load(tier, key, 2 * CHUNK) if done.ok else (done.status, None)
            recovered = status is Status.OK and np.array_equal(got, payload_for(i, 2 * CHUNK))
            outcomes.append(status)
            i += 1
            time.sleep(0.2)
        assert outcomes[0] in (Status.MISS, Status.IO_ERROR)  # the old key: gone, never wrong
        assert recovered, f"no store and load worked again after the restart: {outcomes}"
        assert load(tier, before, 2 * CHUNK)[0] in (Status.MISS, Status.IO_ERROR)
    finally:
        if tier is not None:
            tier.close(5)  # before its master goes: a client without one takes long to leave
        own.stop()


class CallRecorder:
    """A client's real `MooncakeDistributedStore`, each call of it counted by method name: one
    count per call, however many objects the call names."""

    def __init__(self, store: Any) -> None:
        self._store, self.calls, self.order = store, Counter[str](), list[str]()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            self.order.append(name)
            return method(*args, **kwargs)

        return call


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[CallRecorder]:
    """Tiers opened from now on talk to the store through a `CallRecorder` each (in this list)."""
    made: list[CallRecorder] = []

    def recording(cfg: MooncakeConfig) -> StoreClient:
        client = connect(cfg)
        made.append(CallRecorder(client._store))
        return StoreClient(made[-1], client.segment)

    monkeypatch.setattr(mooncake_backend, "connect", recording)
    return made


def per_operation(calls: Counter[str]) -> int:
    """The calls counted but a thread's registrations of its scratch buffer (as it grows)."""
    return sum(n for name, n in calls.items() if name not in ("register_buffer", "unregister_buffer"))


def test_a_store_and_a_load_of_many_chunks_are_a_few_store_calls(
    make_tier: MakeTier, recorded: list[CallRecorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 40.1: a store of six chunks with four aliases is at most four calls of the store (its
    header looked for, the chunks in one batch, the header, the aliases in one batch), and a load,
    whole or a prefix, two (the header, the chunks in one batch)."""
    monkeypatch.setattr(mooncake_backend, "MANIFEST_FLUSH_S", 3600.0)  # no manifest write while counting
    ns = fresh_ns("calls")
    tier = make_tier(ns)
    calls = recorded[0].calls
    tokens = list(range(100, 164))
    key, nbytes = chain_key(ns.id, ROOT_KEY, tokens), 6 * CHUNK
    aliases = [(o, bytes([o]) * 16) for o in (16, 32, 48, 64)]
    calls.clear()
    done = tier.wait(tier.submit_store(key, payload_for(1, nbytes), tokens, ROOT_KEY, aliases=aliases), 30)
    assert done.ok, done
    assert per_operation(calls) <= 4, +calls
    for want in (None, 2 * CHUNK + 100):
        calls.clear()
        status, got = load(tier, key, nbytes, want)
        assert status is Status.OK and np.array_equal(
            got[: want or nbytes], payload_for(1, nbytes)[: want or nbytes]
        )
        assert per_operation(calls) == 2, +calls
    calls.clear()
    store(tier, 1, 10)  # another extent: the calls do not grow with its size
    assert per_operation(calls) <= 4, +calls


def test_close_unregisters_every_scratch_buffer_before_the_client_closes(
    make_tier: MakeTier, recorded: list[CallRecorder]
) -> None:
    """The I/O threads' scratch buffers (each registered with the store as it was made: headers, a
    prefix's chunk) are all unregistered at close, after the threads stopped and before the client
    closes: no registered memory outlives the tier."""
    tier = make_tier(fresh_ns("scratch"))
    key = store(tier, 1, 6 * CHUNK)
    for want in (None, 2 * CHUNK + 100):  # a prefix passes through the scratch buffer
        assert load(tier, key, 6 * CHUNK, want)[0] is Status.OK
    tier.close()
    calls, order = recorded[0].calls, recorded[0].order
    assert calls["register_buffer"] > 0
    assert calls["unregister_buffer"] == calls["register_buffer"], +calls
    assert order.index("close") > max(i for i, name in enumerate(order) if name == "unregister_buffer")


@pytest.fixture
def holder(master: MooncakeMaster) -> Iterator[StoreClient]:
    """A client that only gives the store memory (as a standalone `mooncake_client` or another
    server would): what lives in its segment outlives the tiers of a test."""
    client = connect(master.config(segment_bytes=128 << 20))
    yield client
    client.close()


def test_a_tier_opened_again_on_the_store_finds_what_was_stored_verified(
    make_tier: MakeTier, holder: StoreClient, tmp_path: Path
) -> None:
    """Issue 40.3, warm start: what a tier stored (with a salt or not) is indexed by the next tier
    of its namespace opened on the store, verified: loads bit-exact, token ids read back; an extent
    a chunk of which went is not indexed, nor anything by a tier of another secret. The tiers give
    the store no memory (a segment of 0 B): everything lives in the holder's segment."""
    ns = fresh_ns("warm")
    first = make_tier(ns, segment_bytes=0)
    keys = [store(first, i, 2 * CHUNK + 7 * i) for i in range(3)]
    salted = key_of(ns, 3)
    done = first.wait(first.submit_store(salted, payload_for(3, CHUNK), [3, 4], ROOT_KEY, store_tokens=False,
                                         cache_salt="s1"), 30)  # fmt: skip
    assert done.ok, done
    partial = store(first, 4, 2 * CHUNK)
    assert holder.remove(extent_objects(first, partial)[1][0]).ok
    first.close(5)

    again = make_tier(ns, segment_bytes=0)
    found = {e.key: e for e in again.extents()}
    assert set(found) == {*keys, salted}
    assert again.stats().scanned_extents == 4
    assert [found[k].token_count for k in keys] == [2, 2, 2]
    assert [found[k].payload_len for k in keys] == [2 * CHUNK + 7 * i for i in range(3)]
    assert again.read_tokens(keys[1]) is not None and again.read_tokens(keys[1]).tolist() == [1, 2]
    assert again.read_tokens(salted) is None  # stored without its token ids
    for i, key in enumerate(keys):
        status, got = load(again, key, 2 * CHUNK + 7 * i)
        assert status is Status.OK and np.array_equal(got, payload_for(i, 2 * CHUNK + 7 * i))
    status, got = load(again, salted, CHUNK)
    assert status is Status.OK and np.array_equal(got, payload_for(3, CHUNK))
    assert load(again, partial, 2 * CHUNK)[0] is Status.MISS
    other = make_tier(ns, segment_bytes=0, directory=tmp_path / "other")  # another deployment's secret
    assert other.extents() == []
    close_all([again, other])  # before the holder leaves


def test_a_restart_loses_what_its_own_segment_held_but_no_manifest_record(
    make_tier: MakeTier, holder: StoreClient
) -> None:
    """A tier whose client gives the store memory takes what its segment held when it closes (a
    Mooncake object lives in one client's segment; `placement` local put every object there: it
    had room); the manifest's records are kept in two segments, so the next tier
    still reads every entry, and indexes none of them (a warm start indexing, and loading exactly,
    what outlived its writer: the test above)."""
    ns = fresh_ns("own-segment")
    first = make_tier(ns, segment_bytes=64 << 20, placement="local")
    keys = [store(first, i, CHUNK + i) for i in range(12)]
    seal = first._seal  # type: ignore[attr-defined]
    first.close(5)
    assert len(Manifest(holder, Names(ns.id), seal).scan()) == len(keys)
    again = make_tier(ns, segment_bytes=0)
    assert again.extents() == []
    assert again.stats().scanned_extents == 0
    close_all([again])


def test_a_closed_tier_reads_no_tokens_and_discards_nothing(make_tier: MakeTier) -> None:
    """Once closed, its client is closing or gone: the calls a scheduler may still make answer
    without touching it (no token ids, nothing discarded), never raising."""
    tier = make_tier(fresh_ns("closed"))
    key = store(tier, 0, CHUNK)
    assert tier.read_tokens(key) is not None
    tier.close(5)
    assert tier.read_tokens(key) is None
    assert tier.discard(key) is False


def salted_store(tier: IndexedTier, i: int, salt: str | None) -> tuple[ExtentKey, list[str]]:
    """Store extent `i` of `salt` with two aliases; its key and the names of all its objects."""
    tokens = [i, i + 1, i + 2, i + 3]
    key = chain_key(tier.namespace.id, ROOT_KEY, tokens)
    aliases = [(2, bytes([i, 1]) * 8), (4, bytes([i, 2]) * 8)]
    done = tier.wait(tier.submit_store(key, payload_for(i, 3 * CHUNK), tokens, ROOT_KEY, store_tokens=salt is None,
                                       aliases=aliases, cache_salt=salt), 30)  # fmt: skip
    assert done.ok, done
    t: Any = tier
    tag = None if salt is None else t._seal.salt(salt)
    header, chunks = extent_objects(tier, key)
    return key, [header, *chunks, *(t._names.alias(pk, tag) for _, pk in aliases)]


def test_a_purge_removes_every_object_of_its_salt_in_every_namespace(make_tier: MakeTier) -> None:
    """Issue 40.3, purge: every object of the salt (headers, chunks, aliases), in this tier's
    namespace and in another's (another model, another TP rank), goes; other salts' and unsalted
    extents stay; a tier that stored the salt misses it since."""
    a, b = make_tier(fresh_ns("purge-a")), make_tier(fresh_ns("purge-b"))
    doomed = [salted_store(a, 1, "s1"), salted_store(b, 2, "s1")]
    kept = [(a, 3, salted_store(a, 3, "s2")), (b, 4, salted_store(b, 4, None))]
    names = [n for _, objs in doomed for n in objs]
    client: StoreClient = a._client  # type: ignore[attr-defined]
    assert client.exist(names) == [1] * len(names)
    done = a.wait(a.submit_purge("s1"), 30)
    assert done.ok and done.nbytes == len(names), done
    assert client.exist(names) == [0] * len(names)
    assert a.stats().purged_extents == len(names) and not a.contains(doomed[0][0])
    assert load(b, doomed[1][0], 3 * CHUNK)[0] is Status.MISS
    for tier, i, (key, objs) in kept:
        assert client.exist(objs) == [1] * len(objs)
        status, got = load(tier, key, 3 * CHUNK)
        assert status is Status.OK and np.array_equal(got, payload_for(i, 3 * CHUNK))


def test_a_purge_the_store_failed_is_retried_until_done(
    make_tier: MakeTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A purge whose call the store failed completes IO_ERROR (counted) and runs again on the
    tier's next tick (counted in `purge_retries`) until every object of the salt is gone."""
    tier = make_tier(fresh_ns("retry"))
    _, names = salted_store(tier, 1, "s1")
    client: StoreClient = tier._client  # type: ignore[attr-defined]
    remove_matching, failures = client.remove_matching, [-1]

    def fails_once(pattern: str) -> Reply:
        return Reply(code=failures.pop()) if failures else remove_matching(pattern)

    monkeypatch.setattr(client, "remove_matching", fails_once)
    done = tier.wait(tier.submit_purge("s1"), 30)
    assert done.status is Status.IO_ERROR and tier.stats().io_errors == 1
    deadline = time.monotonic() + 10
    while client.exist(names) != [0] * len(names):
        assert time.monotonic() < deadline, "the failed purge was not retried"
        time.sleep(0.05)
    assert tier.stats().purge_retries >= 1


def test_a_lookup_is_two_store_calls_the_aliases_and_their_headers(
    make_tier: MakeTier, recorded: list[CallRecorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 40.1: a cross-server lookup over the store reads the aliases of all the prompt's block
    positions in one call and the headers they name in another; the binary search and the walk back
    run on them, each header verified as a load's."""
    from sgl_hicache.tier import path_lookup as lookup_mod
    from sgl_hicache.tier.keys import PathHasher
    from sgl_hicache.tier.path_lookup import alias_marks
    from sgl_hicache.tier.results import LookupRequest

    monkeypatch.setattr(lookup_mod, "BLOCK_TOKENS", 16)
    monkeypatch.setattr(mooncake_backend, "MANIFEST_FLUSH_S", 3600.0)  # no manifest write while counting
    ns = fresh_ns("lookup")
    writer, reader = make_tier(ns), make_tier(ns)
    prompt = np.array([(i * 7) % 50 + 1 for i in range(160)], dtype=np.uint32)
    cuts, keys = (0, 48, 112, 160), []
    for start, end in itertools.pairwise(cuts):
        parent = PathHasher(ns.id).update(prompt[:start]).key()
        marks = alias_marks(
            PathHasher(ns.id).update(prompt[:start]), start, prompt[start:end], ns.layout.page_size
        )
        keys.append(chain_key(ns.id, parent, prompt[start:end]))
        done = writer.wait(writer.submit_store(keys[-1], payload_for(start, 5000), prompt[start:end], parent,
                                               aliases=marks), 30)  # fmt: skip
        assert done.ok, done
    calls = recorded[1].calls
    calls.clear()
    reader.submit_lookup(LookupRequest(prompt, 0))
    deadline = time.monotonic() + 20
    while not (found := reader.lookups_finished()):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert [s.key for s in found[0].segments] == keys
    assert calls["get_batch"] == 2 and per_operation(calls) == 2, +calls  # the aliases, their headers
