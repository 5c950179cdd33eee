"""The `Tier` contract the cache relies on, run against both backends (issue 26): a directory
(`FileTier`) and a Mooncake Store (`MooncakeTier`, a real master on loopback, its tiers clients of
the master or dummies of a real client: issue 40).

Two tiers of one namespace stand for two servers: one writes, the other reads and looks up. Every
load is bit-exact or a status; each completion is returned once; a closed tier rejects.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sgl_hicache.config import Compression, MiB, MooncakeConfig, SpillBackend, TierConfig
from sgl_hicache.tier import ROOT_KEY, ExtentKey, IndexedTier, Namespace, Status, chain_key, open_tier
from sgl_hicache.tier.keys import PathHasher
from sgl_hicache.tier.path_lookup import alias_marks
from sgl_hicache.tier.results import LookupRequest, LookupResult
from tests.tier.common import CHUNK, NS, payload_for

MakeTier = Callable[..., IndexedTier]


@pytest.fixture(params=["file", "mooncake", "mooncake-standalone"])
def make_tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MakeTier]:
    """Tiers of one backend on one store: a directory, the session's Mooncake master (each tier a
    client of it), or its real client (each tier a dummy of it: Mooncake's standalone mode)."""
    backend = SpillBackend.FILE if request.param == "file" else SpillBackend.MOONCAKE
    extra = {}
    if request.param == "mooncake":
        extra["mooncake"] = request.getfixturevalue("mooncake_master").config()
    elif request.param == "mooncake-standalone":
        real_client = request.getfixturevalue("mooncake_real_client").address
        extra["mooncake"] = MooncakeConfig(real_client=real_client, local_buffer_size=16 * MiB)
    ns = Namespace(f"contract-{time.monotonic_ns()}", NS.layout)  # the master is the session's
    opened: list[IndexedTier] = []

    def make(**kw: object) -> IndexedTier:
        cfg = TierConfig(backend=backend, directory=tmp_path / "tier", capacity_bytes=64 << 20, min_free_bytes=0,
                         chunk_bytes=CHUNK, io_threads=4, **extra, **kw)  # type: ignore[arg-type]  # fmt: skip
        opened.append(open_tier(cfg, ns))
        return opened[-1]

    yield make
    close_all(opened)


def close_all(tiers: list[IndexedTier]) -> None:
    """Close in parallel: a Mooncake client takes about 2 s to leave the store."""
    threads = [threading.Thread(target=tier.close, args=(5,)) for tier in tiers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def key_of(tier: IndexedTier, i: int) -> ExtentKey:
    return chain_key(tier.namespace.id, ROOT_KEY, [i, i + 1])


def store(tier: IndexedTier, i: int, nbytes: int) -> ExtentKey:
    key = key_of(tier, i)
    done = tier.wait(tier.submit_store(key, payload_for(i, nbytes), [i, i + 1], ROOT_KEY), 30)
    assert done.ok and done.nbytes == nbytes, done
    return key


def load(tier: IndexedTier, key: ExtentKey, size: int, want: int | None = None) -> tuple[Status, np.ndarray]:
    dest = np.zeros(size, dtype=np.uint8)
    done = tier.wait(tier.submit_load(key, dest, want), 30)
    assert not done.ok or done.nbytes == (size if want is None else want), done
    assert tier.landed(done.ticket) == 0  # nothing reported once the completion is returned
    return done.status, dest


@pytest.mark.parametrize("compression", [Compression.NONE, Compression.ZSTD])
@pytest.mark.parametrize("nbytes", [1, 3 * CHUNK + 4097])
def test_round_trip_whole_and_prefix_is_bit_exact(
    make_tier: MakeTier, compression: Compression, nbytes: int
) -> None:
    writer, reader = make_tier(compression=compression), make_tier()
    key = store(writer, 7, nbytes)
    status, got = load(reader, key, nbytes)
    assert status is Status.OK and np.array_equal(got, payload_for(7, nbytes))
    want = min(nbytes, CHUNK + 100)
    status, got = load(reader, key, nbytes, want)
    assert status is Status.OK and np.array_equal(got[:want], payload_for(7, nbytes)[:want])
    assert writer.contains(key) and reader.stats().loads == 2 and writer.stats().stores == 1


def test_misses_rejections_and_caller_bugs(make_tier: MakeTier) -> None:
    tier = make_tier()
    assert load(tier, key_of(tier, 99), 100)[0] is Status.MISS
    assert tier.stats().misses == 1
    key = store(tier, 1, 10_000)
    assert load(tier, key, 5_000)[0] is Status.REJECTED  # the destination cannot hold the extent
    assert load(tier, key, 100, 5_000)[0] is Status.REJECTED
    with pytest.raises(ValueError):
        tier.submit_store(key, payload_for(1, 10), [5, 6], ROOT_KEY)  # the key names other tokens
    with pytest.raises(KeyError):
        tier.wait(tier.submit_store(key, payload_for(1, 10_000), [1, 2], ROOT_KEY) + 1000, 1)


@pytest.mark.parametrize("compression", [Compression.NONE, Compression.ZSTD])
def test_written_bytes_are_what_a_store_put_and_a_store_of_a_present_key_puts_none(
    make_tier: MakeTier, compression: Compression
) -> None:
    """Issue 37: `written_bytes` counts every byte a store put on the tier (payload as stored and
    header), read back here from the store itself; a store that finds its extent writes nothing."""
    writer, other = make_tier(compression=compression), make_tier()
    nbytes = 3 * CHUNK + 4097
    key = store(writer, 8, nbytes)
    written = writer.stats().written_bytes
    assert written == stored_bytes(writer, key) and written > (
        nbytes if compression is Compression.NONE else 0
    )
    store(writer, 8, nbytes)
    store(other, 8, nbytes)  # another server's store of the same extent
    assert writer.stats().written_bytes == written and other.stats().written_bytes == 0


def stored_bytes(tier: IndexedTier, key: ExtentKey) -> int:
    """The bytes `key` occupies in its store: its file, or its header and chunk objects."""
    names = getattr(tier, "_names", None)
    if names is None:
        from sgl_hicache.tier.file.paths import ExtentPaths

        return ExtentPaths(tier._cfg.directory, tier.namespace.id).extent(key).stat().st_size  # type: ignore[attr-defined]
    from sgl_hicache.tier.mooncake import objects

    t: Any = tier
    ext = objects.open_header(t._client, names, t.namespace.id, key, t._salt(key), t._seal, t._scratch)
    return sum(t._client.size(n).n for n in [names.header(key, ext.salt), *ext.chunk_names(names)])  # type: ignore[no-any-return]


def test_duplicate_stores_and_each_completion_once(make_tier: MakeTier) -> None:
    tier = make_tier()
    key = key_of(tier, 4)
    tickets = {tier.submit_store(key, payload_for(4, 3 * CHUNK), [4, 5], ROOT_KEY) for _ in range(3)}
    done: list = []
    deadline = time.monotonic() + 30
    while len(done) < 3 and time.monotonic() < deadline:
        done += tier.get_finished()
        time.sleep(0.005)
    assert {c.ticket for c in done} == tickets and all(c.ok for c in done), done
    assert tier.get_finished() == []
    assert np.array_equal(load(tier, key, 3 * CHUNK)[1], payload_for(4, 3 * CHUNK))


def test_wait_posted_blocks_until_a_completion_waits_and_consumes_none(make_tier: MakeTier) -> None:
    """Admission's hold waits on it (cache/admission_hold.py): nothing in flight, it returns False
    after its timeout; a completion posted, it returns True at once and leaves it to `get_finished`."""
    tier = make_tier()
    t0 = time.monotonic()
    assert tier.wait_posted(0.2) is False
    assert time.monotonic() - t0 >= 0.19
    key = key_of(tier, 5)
    ticket = tier.submit_store(key, payload_for(5, 3 * CHUNK), [5, 6], ROOT_KEY)
    assert tier.wait_posted(30) is True
    t0 = time.monotonic()
    assert tier.wait_posted(5) is True and time.monotonic() - t0 < 1  # still there: not consumed
    done = tier.get_finished()
    assert [c.ticket for c in done] == [ticket] and done[0].ok
    assert tier.wait_posted(0.05) is False  # taken: nothing waits any more


PROMPT = np.array([(i * 7) % 50 + 1 for i in range(160)], dtype=np.uint32)


def test_another_tier_finds_verifies_and_loads_by_lookup(
    make_tier: MakeTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sgl_hicache.tier import path_lookup as lookup_mod

    monkeypatch.setattr(lookup_mod, "BLOCK_TOKENS", 16)
    writer, reader = make_tier(), make_tier()
    ns = writer.namespace.id

    def path_key(n: int) -> ExtentKey:
        return PathHasher(ns).update(PROMPT[:n]).key()

    cuts, keys = (0, 48, 112, 160), []
    for start, end in itertools.pairwise(cuts):
        marks = alias_marks(
            PathHasher(ns).update(PROMPT[:start]), start, PROMPT[start:end], NS.layout.page_size
        )
        key = chain_key(ns, path_key(start), PROMPT[start:end])
        done = writer.wait(writer.submit_store(key, payload_for(start, 20_000), PROMPT[start:end], path_key(start),
                                               aliases=marks), 30)  # fmt: skip
        assert done.ok, done
        keys.append(key)
    found = lookup(reader, 0)
    assert [(s.key, s.start, s.end) for s in found.segments] == list(zip(keys, cuts, cuts[1:], strict=False))
    assert found.refused == 0
    for seg in found.segments:
        status, got = load(reader, seg.key, 20_000)
        assert status is Status.OK and np.array_equal(got, payload_for(seg.start, 20_000))
    assert lookup(reader, 0, PROMPT[::-1].copy()).segments == ()  # other tokens: nothing
    assert lookup(reader, 0, PROMPT, tenant=b"salt").segments == ()  # another tenant: nothing


def test_a_salted_extent_is_found_by_a_lookup_of_its_salt_only(
    make_tier: MakeTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 40: an extent stored with a cache_salt is found (and then loads) by a lookup of its
    tenant and salt, by a tier that never saw it; a lookup of another salt finds nothing."""
    from sgl_hicache.tier import path_lookup as lookup_mod
    from sgl_hicache.tier.keys import tenant_of

    monkeypatch.setattr(lookup_mod, "BLOCK_TOKENS", 16)
    writer, reader = make_tier(), make_tier()
    ns, tenant = writer.namespace.id, tenant_of(None, "s1")
    tokens = PROMPT[:48]
    marks = alias_marks(PathHasher(ns, tenant), 0, tokens, NS.layout.page_size)
    key = chain_key(ns, PathHasher(ns, tenant).key(), tokens)
    done = writer.wait(writer.submit_store(key, payload_for(5, 20_000), tokens, PathHasher(ns, tenant).key(),
                                           store_tokens=False, aliases=marks, cache_salt="s1"), 30)  # fmt: skip
    assert done.ok, done
    found = lookup(reader, 0, PROMPT, tenant=tenant, cache_salt="s1")
    assert [(s.key, s.start, s.end) for s in found.segments] == [(key, 0, 48)]
    status, got = load(reader, key, 20_000)
    assert status is Status.OK and np.array_equal(got, payload_for(5, 20_000))
    other = tenant_of(None, "s2")
    assert lookup(reader, 0, PROMPT, tenant=other, cache_salt="s2").segments == ()


def lookup(tier: IndexedTier, start: int, tokens: np.ndarray = PROMPT, tenant: bytes = b"",
           cache_salt: str | None = None) -> LookupResult:  # fmt: skip
    tier.submit_lookup(LookupRequest(tokens, start, tenant, cache_salt=cache_salt))
    deadline = time.monotonic() + 20
    while not (done := tier.lookups_finished()):
        assert time.monotonic() < deadline, "lookup did not finish"
        time.sleep(0.005)
    return done[0]


def test_a_closed_tier_rejects_and_close_is_idempotent(make_tier: MakeTier) -> None:
    tier = make_tier()
    key = store(tier, 1, 5000)
    tier.close()
    tier.close()
    assert tier.wait(tier.submit_load(key, np.zeros(5000, dtype=np.uint8)), 5).status is Status.REJECTED
    done = tier.wait(tier.submit_store(key_of(tier, 2), payload_for(2, 10), [2, 3], ROOT_KEY), 5)
    assert done.status is Status.REJECTED
    assert lookup(tier, 0).segments == ()
