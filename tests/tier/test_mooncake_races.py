"""Mooncake tier: a load that straddles a re-publish of its key is a race, not corruption (issue 38.2).

Server A loads key K (header, then chunk by chunk) while server B re-publishes K with its own bytes
(chunks first, header last). A chunk of B's then fails the checksum of the header A verified. The
load must act only on what it saw (the file tier's rule, test_load_races.py): B's header is not the
one A verified, so A's load is a clean MISS, counted as a miss (not a checksum failure, which
operators alert on), and B's good header stays. A chunk truly corrupted under an unchanged header
is still CORRUPT, counted, and its header removed.

An in-memory store stands in for the Mooncake client (`StoreClient`'s methods): no master needed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import sgl_hicache.tier.mooncake.backend as mc
from sgl_hicache.config import MooncakeConfig, SpillBackend, TierConfig
from sgl_hicache.tier import ROOT_KEY, ExtentKey, Status
from sgl_hicache.tier.mooncake.client import Names, Reply
from tests.tier.common import CHUNK, NS, key_for, payload_for, tokens_for

NBYTES = 4 * CHUNK
GONE, TOO_LARGE = -704, -600  # OBJECT_NOT_FOUND, INVALID_PARAMS (mooncake_client.py)


class FakeStore:
    """Objects by name; every write replaces its object, as Mooncake's upsert does. `before_get`,
    if set, runs before each `get_into` (with the object's name)."""

    def __init__(self) -> None:
        self.objs: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.before_get: Callable[[str], None] | None = None

    def write_from(self, name: str, data: memoryview) -> Reply:
        return self.write(name, bytes(data))

    def write(self, name: str, data: bytes) -> Reply:
        with self.lock:
            self.objs[name] = bytes(data)
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

    def get(self, name: str) -> bytes | None:
        with self.lock:
            return self.objs.get(name)

    def exist(self, names: list[str]) -> list[int]:
        with self.lock:
            return [1 if n in self.objs else 0 for n in names]

    def remove(self, name: str) -> Reply:
        with self.lock:
            gone = self.objs.pop(name, None)
        return Reply() if gone is not None else Reply(code=GONE)

    def register(self, buf: memoryview) -> Reply:
        return Reply()

    def close(self) -> None:
        pass


@pytest.fixture
def servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeStore, mc.MooncakeTier, mc.MooncakeTier]]:  # fmt: skip
    """One store, and two servers (tiers) that are clients of it, sealed with one secret."""
    store = FakeStore()
    monkeypatch.setattr(mc, "connect", lambda cfg: store)
    cfg = TierConfig(
        backend=SpillBackend.MOONCAKE, mooncake=MooncakeConfig(master="127.0.0.1:1"),
        directory=tmp_path / "tier", chunk_bytes=CHUNK, io_threads=2,
    )  # fmt: skip
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


def test_a_load_that_straddles_a_republish_is_a_miss_and_keeps_the_new_extent(
    servers: tuple[FakeStore, mc.MooncakeTier, mc.MooncakeTier],
) -> None:
    store, a, b = servers
    names, theirs = Names(NS.id), payload_for(2, NBYTES)
    key = store_as(a, 1, payload_for(1, NBYTES))  # A's bytes for K (same tokens, other KV bytes)
    assert store.remove(names.chunk(key, 3)).ok  # the master evicts a chunk of K: B will store K again
    republished: list[Status] = []

    def b_republishes(name: str) -> None:  # while A's load reads K's chunks
        if name == names.chunk(key, 2) and not republished:
            republished.append(b.wait(b.submit_store(key, theirs, tokens_for(1), ROOT_KEY), 10).status)

    store.before_get = b_republishes
    status, _ = load(a, key)
    store.before_get = None

    assert republished == [Status.OK]
    assert status is Status.MISS
    assert a.stats().checksum_failures == 0 and a.stats().misses == 1
    assert names.header(key) in store.objs  # B's header was not removed
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
    assert store.write(names.chunk(key, 2), bad.tobytes()).ok  # same length, one bit flipped

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


def test_a_load_that_meets_a_republish_still_under_way_is_a_miss(
    servers: tuple[FakeStore, mc.MooncakeTier, mc.MooncakeTier],
) -> None:
    """The likelier race: B has written some of its chunks but not yet its header when A's load
    reads one of them, so the header A re-reads at once is still the old one. A waits the grace
    for the publish to reach its header: a MISS, nothing removed, nothing counted as corrupt."""
    store, a, b = servers
    names, theirs = Names(NS.id), payload_for(2, NBYTES)
    key = store_as(a, 1, payload_for(1, NBYTES))
    assert store.remove(names.chunk(key, 3)).ok  # so B's store rewrites every object
    publish: list[threading.Thread] = []
    looked = threading.Event()
    get = store.get

    def get_header(name: str) -> bytes | None:  # A re-reads the header after its chunk failed
        found = get(name)
        looked.set()
        return found

    store.get = get_header  # type: ignore[method-assign]

    def b_is_publishing(name: str) -> None:
        if name == names.chunk(key, 2) and not publish:
            store.write(names.chunk(key, 2), theirs[2 * CHUNK : 3 * CHUNK].tobytes())  # B's chunk 2 first

            def rest() -> None:  # then, once A has seen the old header, the rest and the header
                assert looked.wait(10)
                assert b.wait(b.submit_store(key, theirs, tokens_for(1), ROOT_KEY), 10).status is Status.OK

            publish.append(threading.Thread(target=rest))
            publish[0].start()

    store.before_get = b_is_publishing
    status, _ = load(a, key)
    store.before_get = None
    publish[0].join(10)

    assert status is Status.MISS
    assert a.stats().checksum_failures == 0
    status, got = load(a, key)
    assert status is Status.OK and np.array_equal(got, theirs)
