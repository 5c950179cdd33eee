"""The Mooncake Store tier against a real master and clients on loopback (issue 26): what a store
of objects adds to the contract both backends pass (test_contract.py).

Every load is bit-exact or refused: objects another deployment or a tamperer wrote (CORRUPT /
MISMATCH, never bytes), keys the master evicted or another client removed (a clean MISS), a master
restart mid-run (failed operations come back as statuses, none raises; then stores and loads work
again).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sgl_hicache.config import SpillBackend, TierConfig
from sgl_hicache.tier import ROOT_KEY, ExtentKey, IndexedTier, Namespace, Status, chain_key, open_tier
from sgl_hicache.tier.mooncake.client import Names
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
             **kw: Any) -> IndexedTier:  # fmt: skip
        kw.setdefault("directory", tmp_path / "tier")
        kw.setdefault("chunk_bytes", CHUNK)
        kw.setdefault("io_threads", 4)
        cfg = TierConfig(
            backend=SpillBackend.MOONCAKE, mooncake=(master_ or master).config(segment_bytes), **kw
        )
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
    assert client.remove(names.chunk(key, 1)).ok and client.write(names.chunk(key, 1), bad.tobytes()).ok
    assert load(tier, key, 2 * CHUNK)[0] is Status.CORRUPT
    assert load(tier, key, CHUNK)[0] is Status.MISS  # dropped: never served, even its good prefix

    key_a, key_b = store(tier, 10, CHUNK), key_of(ns, 11)  # b's header is a's, sealed and all
    header = client.get(names.header(key_a))
    assert header is not None and client.write(names.header(key_b), header).ok
    assert client.write(names.chunk(key_b, 0), payload_for(10, CHUNK).tobytes()).ok
    assert load(tier, key_b, CHUNK)[0] in (Status.CORRUPT, Status.MISMATCH)


def test_a_key_another_client_removed_is_a_clean_miss(make_tier: MakeTier) -> None:
    ns = fresh_ns("removed")
    writer, other = make_tier(ns), make_tier(ns)
    keys = [store(writer, i, 2 * CHUNK) for i in range(3)]
    names = Names(ns.id)
    other._client.remove(names.header(keys[0]))  # type: ignore[attr-defined]
    other._client.remove(names.chunk(keys[1], 1))  # type: ignore[attr-defined]
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
