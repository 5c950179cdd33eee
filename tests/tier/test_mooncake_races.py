"""Mooncake tier: a load that straddles a re-publish of its key is never a mix (issue 38.2, 40).

Server A loads key K (header, then its chunks) while server B re-publishes K with its own bytes
(chunks first, header last). Chunk names are unique per publish (client.py), so A reads the chunks
of the header it verified, or misses them if they went: never B's under A's header. If A's chunk
fails anyway under a header replaced since, A acts only on what it saw (the file tier's rule,
test_load_races.py): a clean MISS, counted as a miss (not a checksum failure, which operators alert
on), and B's good header stays. A chunk truly corrupted under an unchanged header is still CORRUPT,
counted, and its header removed.

An in-memory store stands in for the Mooncake client (`StoreClient`'s methods): no master needed.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import sgl_hicache.tier.mooncake.backend as mc
from sgl_hicache.config import MooncakeConfig, SpillBackend, TierConfig
from sgl_hicache.tier import ROOT_KEY, ExtentKey, Status
from sgl_hicache.tier.codec import prepare, store_request
from sgl_hicache.tier.directio import alloc_aligned
from sgl_hicache.tier.mooncake import objects
from sgl_hicache.tier.mooncake.client import Names, Reply
from sgl_hicache.tier.results import Ticket
from tests.tier.common import CHUNK, NS, key_for, payload_for, tokens_for

NBYTES = 4 * CHUNK
GONE, TOO_LARGE = -704, -600  # OBJECT_NOT_FOUND, INVALID_PARAMS (mooncake_client.py)


class FakeStore:
    """Objects by name; every write replaces its object, as Mooncake's upsert does (`put` keeps
    one). `before_get`, if set, runs before each object a get reads (with the object's name)."""

    def __init__(self) -> None:
        self.objs: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.before_get: Callable[[str], None] | None = None

    def host_memory(self, nbytes: int) -> memoryview:
        return alloc_aligned(nbytes)

    def addressable(self, view: memoryview) -> bool:
        return True

    def write_from(self, name: str, data: memoryview) -> Reply:
        return self.write(name, bytes(data))

    def write_many_from(self, names: list[str], data: list[memoryview]) -> list[Reply]:
        return [self.write(n, bytes(d)) for n, d in zip(names, data, strict=True)]

    def write(self, name: str, data: bytes, copies: int = 1) -> Reply:
        with self.lock:
            self.objs[name] = bytes(data)
        return Reply()

    def write_many(self, names: list[str], data: list[bytes]) -> Reply:
        for n, d in zip(names, data, strict=True):
            self.write(n, d)
        return Reply()

    def put(self, name: str, data: bytes, copies: int = 1) -> Reply:
        with self.lock:
            self.objs.setdefault(name, bytes(data))
        return Reply()

    def size(self, name: str) -> Reply:
        with self.lock:
            obj = self.objs.get(name)
        return Reply(code=GONE) if obj is None else Reply(n=len(obj))

    def get_into(self, name: str, dest: memoryview) -> Reply:
        if self.before_get is not None:
            self.before_get(name)
        with self.lock:
            obj = self.objs.get(name)
        if obj is None:
            return Reply(code=GONE)
        if len(obj) > dest.nbytes:
            return Reply(code=TOO_LARGE)
        dest[: len(obj)] = obj
        return Reply(n=len(obj))

    def get_many_into(self, names: list[str], dest: list[memoryview]) -> list[Reply]:
        return [self.get_into(n, d) for n, d in zip(names, dest, strict=True)]

    def get(self, name: str) -> bytes | None:
        with self.lock:
            return self.objs.get(name)

    def get_many(self, names: list[str]) -> list[bytes | None]:
        return [self.get(n) for n in names]

    def exist(self, names: list[str]) -> list[int]:
        with self.lock:
            return [1 if n in self.objs else 0 for n in names]

    def remove(self, name: str) -> Reply:
        with self.lock:
            gone = self.objs.pop(name, None)
        return Reply() if gone is not None else Reply(code=GONE)

    def remove_many(self, names: list[str]) -> list[Reply]:
        return [self.remove(n) for n in names]

    def remove_matching(self, pattern: str) -> Reply:
        with self.lock:
            gone = [n for n in self.objs if re.match(pattern, n)]
            for n in gone:
                del self.objs[n]
        return Reply(n=len(gone))

    def register(self, buf: memoryview) -> Reply:
        return Reply()

    def unregister(self, buf: memoryview) -> Reply:
        return Reply()

    def close(self) -> None:
        pass


def on_fake_store(tmp_path: Path) -> TierConfig:
    """A Mooncake tier's config whose store is whatever `mc.connect` returns (a `FakeStore`)."""
    return TierConfig(
        backend=SpillBackend.MOONCAKE, mooncake=MooncakeConfig(master="127.0.0.1:1"),
        directory=tmp_path / "tier", chunk_bytes=CHUNK, io_threads=2,
    )  # fmt: skip


@pytest.fixture
def servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeStore, mc.MooncakeTier, mc.MooncakeTier]]:  # fmt: skip
    """One store, and two servers (tiers) that are clients of it, sealed with one secret."""
    store = FakeStore()
    monkeypatch.setattr(mc, "connect", lambda cfg: store)
    cfg = on_fake_store(tmp_path)
    a, b = mc.MooncakeTier(cfg, NS), mc.MooncakeTier(cfg, NS)
    yield store, a, b
    a.close(5)
    b.close(5)


def store_as(tier: mc.MooncakeTier, i: int, data: np.ndarray) -> ExtentKey:
    key = key_for(i)
    assert tier.wait(tier.submit_store(key, data, tokens_for(i), ROOT_KEY), 10).status is Status.OK
    return key


def load(tier: mc.MooncakeTier, key: ExtentKey) -> tuple[Status, np.ndarray]:
    dest = np.zeros(NBYTES, dtype=np.uint8)
    return tier.wait(tier.submit_load(key, dest), 10).status, dest


def chunks_of(tier: mc.MooncakeTier, key: ExtentKey) -> list[str]:
    """The names of the chunks `key`'s header in the store names now."""
    t: Any = tier
    return objects.open_header(t._client, t._names, NS.id, key, None, t._seal, t._scratch).chunk_names(
        t._names
    )


def test_a_load_that_straddles_a_republish_is_a_miss_and_keeps_the_new_extent(
    servers: tuple[FakeStore, mc.MooncakeTier, mc.MooncakeTier],
) -> None:
    store, a, b = servers
    names, theirs = Names(NS.id), payload_for(2, NBYTES)
    key = store_as(a, 1, payload_for(1, NBYTES))  # A's bytes for K (same tokens, other KV bytes)
    ours = chunks_of(a, key)
    assert store.remove(ours[3]).ok  # the master evicts a chunk of K: B will store K again
    republished: list[Status] = []

    def b_republishes(name: str) -> None:  # while A's load reads K's chunks
        if name == ours[2] and not republished:
            republished.append(b.wait(b.submit_store(key, theirs, tokens_for(1), ROOT_KEY), 10).status)

    store.before_get = b_republishes
    status, _ = load(a, key)
    store.before_get = None

    assert republished == [Status.OK]
    assert status is Status.MISS
    assert a.stats().checksum_failures == 0 and a.stats().misses == 1
    assert names.header(key) in store.objs and set(chunks_of(b, key)).isdisjoint(ours)  # B's stays
    status, got = load(b, key)
    assert status is Status.OK and np.array_equal(got, theirs)
    status, got = load(a, key)  # and A, loading again, reads B's extent
    assert status is Status.OK and np.array_equal(got, theirs)


def test_a_corrupt_chunk_under_an_unchanged_header_is_corrupt_and_dropped(
    servers: tuple[FakeStore, mc.MooncakeTier, mc.MooncakeTier],
) -> None:
    store, a, b = servers
    names, data = Names(NS.id), payload_for(1, NBYTES)
    key = store_as(a, 1, data)
    bad = data[2 * CHUNK : 3 * CHUNK].copy()
    bad[100] ^= 1
    assert store.write(chunks_of(a, key)[2], bad.tobytes()).ok  # same length, one bit flipped

    status, _ = load(a, key)
    assert status is Status.CORRUPT
    assert a.stats().checksum_failures == 1 and a.stats().misses == 0
    assert names.header(key) not in store.objs  # dropped: never served to anyone
    assert load(b, key)[0] is Status.MISS


def test_a_header_of_a_newer_format_version_is_a_miss_and_never_removed_nor_overwritten(
    servers: tuple[FakeStore, mc.MooncakeTier, mc.MooncakeTier], tmp_path: Path
) -> None:
    """Issue 38.10 on the store: a newer server's extent (its header's version raised, re-sealed) is
    skipped and counted in `newer_extents`, not dropped as corrupt, and a store of its key by this
    version leaves it as it is."""
    from sgl_hicache.tier import format as fmt
    from sgl_hicache.tier.format import FIXED_SIZE, MAC_BYTES, DirectoryMac
    from sgl_hicache.tier.trust import SECRET_NAME

    store, a, b = servers
    names, data = Names(NS.id), payload_for(1, NBYTES)
    key = store_as(b, 1, data)
    header = bytearray(store.objs[names.header(key)])
    header[8:10] = (fmt.VERSION + 1).to_bytes(2, "little")
    maced = FIXED_SIZE - MAC_BYTES
    header[maced:FIXED_SIZE] = DirectoryMac((tmp_path / "tier" / SECRET_NAME).read_bytes()).header(
        bytes(header[:maced])
    )
    assert store.write(names.header(key), bytes(header)).ok

    status, _ = load(a, key)
    assert status is Status.MISS
    assert a.stats().newer_extents == 1 and a.stats().checksum_failures == 0
    assert store.objs[names.header(key)] == bytes(header)  # kept
    store_as(a, 1, data)  # this version stores K: the newer header is left in place
    assert store.objs[names.header(key)] == bytes(header)


def test_a_load_that_meets_a_republish_under_way_reads_the_publish_it_verified(
    servers: tuple[FakeStore, mc.MooncakeTier, mc.MooncakeTier],
) -> None:
    """Issue 40: B re-publishes K (its chunks, then its header) while A's load, which verified A's
    header, reads A's chunks: B's chunks have names of their own, so A's load is A's bytes, exact;
    A's next load reads B's extent."""
    store, a, b = servers
    ours, theirs = payload_for(1, NBYTES), payload_for(2, NBYTES)
    key = store_as(a, 1, ours)
    first = chunks_of(a, key)[0]
    published: list[int] = []

    def b_publishes(name: str) -> None:  # as B does after finding K absent (its header evicted, say)
        if name == first and not published:
            t: Any = b
            req = store_request(NS, t._seal, key, theirs, tokens_for(1), ROOT_KEY, True, (), None, 0)
            published.append(
                objects.write_objects(store, Names(NS.id), prepare(req, t._cfg), t._cfg, NS, t._seal)
            )

    store.before_get = b_publishes
    status, got = load(a, key)
    store.before_get = None
    assert published and status is Status.OK and np.array_equal(got, ours)
    status, got = load(a, key)
    assert status is Status.OK and np.array_equal(got, theirs)


def test_a_store_of_a_salt_in_flight_when_it_is_purged_leaves_nothing(
    servers: tuple[FakeStore, mc.MooncakeTier, mc.MooncakeTier],
) -> None:
    """A purge queued while a store of its salt writes: the store completes REJECTED and no object
    of the salt is left, whichever ran first."""
    store, a, _ = servers
    purged: list[Ticket] = []
    write_many_from = store.write_many_from

    def purge_meanwhile(names: list[str], data: list[memoryview]) -> list[Reply]:
        purged.append(a.submit_purge("s1"))
        return write_many_from(names, data)

    store.write_many_from = purge_meanwhile  # type: ignore[method-assign]
    done = a.wait(
        a.submit_store(key_for(1), payload_for(1, NBYTES), tokens_for(1), ROOT_KEY, cache_salt="s1"), 10
    )
    store.write_many_from = write_many_from  # type: ignore[method-assign]
    assert done.status is Status.REJECTED and a.wait(purged[0], 10).ok
    tag = a._seal.salt("s1").hex()  # type: ignore[attr-defined]
    assert not [n for n in store.objs if f"/{tag}/" in n]
