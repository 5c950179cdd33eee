"""Round trips through the tier: dtypes, prefixes, compression, buffers, keys and namespaces."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
import torch

from sgl_hicache.config import Compression
from sgl_hicache.tier import ROOT_KEY, KVDtype, KVLayout, Namespace, Status, alloc_aligned, chain_key
from tests.tier.common import CHUNK, NS, key_for, payload_for, tokens_for

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("compression", [Compression.NONE, Compression.ZSTD])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_dtype(make_tier, dtype, compression):
    tier = make_tier(compression=compression)
    kv = torch.randn(3, 2, 5, 64).to(dtype)  # pages, layers, tokens, dim: page-major, odd sizes
    raw = kv.view(torch.uint8).numpy().reshape(-1)
    key = chain_key(NS.id, ROOT_KEY, range(5))
    assert tier.wait(tier.submit_store(key, raw, range(5), ROOT_KEY)).ok
    out = torch.empty_like(kv)
    done = tier.wait(tier.submit_load(key, out.view(torch.uint8).numpy()))
    assert (done.status, done.nbytes) == (Status.OK, raw.nbytes)
    assert torch.equal(out.view(torch.uint8), kv.view(torch.uint8))


@pytest.mark.parametrize("compression", [Compression.NONE, Compression.ZSTD])
@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 17, 10**9])
def test_prefix_reads(make_tier, nbytes, compression):
    tier = make_tier(compression=compression)
    data = payload_for(1, 3 * CHUNK + 4096 + 123)
    assert tier.wait(tier.submit_store(key_for(1), data, [1, 2], ROOT_KEY)).ok
    if nbytes > data.nbytes:  # more than the extent holds: never a short OK
        done = tier.wait(tier.submit_load(key_for(1), alloc_aligned(4096), nbytes))
        assert (done.status, done.nbytes) == (Status.MISMATCH, 0)
        assert not tier.contains(key_for(1)) and tier.stats().mismatches == 1
        return
    dest = alloc_aligned(nbytes)
    done = tier.wait(tier.submit_load(key_for(1), dest, nbytes))
    assert (done.status, done.nbytes) == (Status.OK, nbytes)
    assert bytes(dest) == data[:nbytes].tobytes()


def test_prefix_read_touches_only_needed_chunks(make_tier, tmp_path):
    """Corrupting chunk 2 does not fail a prefix inside chunks 0-1: only those are read and verified."""
    tier = make_tier()
    data = payload_for(2, 4 * CHUNK)
    assert tier.wait(tier.submit_store(key_for(2), data, [2, 3], ROOT_KEY)).ok
    path = next((tmp_path / "tier").rglob("*.ext"))
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size - 2 * CHUNK + 5)
        f.write(b"\xff\x00\xff")
    dest = alloc_aligned(2 * CHUNK)
    assert tier.wait(tier.submit_load(key_for(2), dest, 2 * CHUNK)).ok
    assert tier.wait(tier.submit_load(key_for(2), alloc_aligned(4 * CHUNK))).status is Status.CORRUPT
    assert not tier.contains(key_for(2)) and not path.exists()


@pytest.mark.parametrize("offset", [1, 7, 4095])
def test_unaligned_buffers(make_tier, offset):
    tier = make_tier()
    data = payload_for(3, 2 * CHUNK + 999)
    src = bytearray(data.nbytes + offset)
    src[offset:] = data.tobytes()
    assert tier.wait(tier.submit_store(key_for(3), memoryview(src)[offset:], [3, 4], ROOT_KEY)).ok
    dest = bytearray(data.nbytes + offset)
    assert tier.wait(tier.submit_load(key_for(3), memoryview(dest)[offset:])).ok
    assert bytes(dest[offset:]) == data.tobytes()


def test_small_destination_is_rejected_and_miss_is_clean(make_tier):
    tier = make_tier()
    data = payload_for(4, 10_000)
    assert tier.wait(tier.submit_store(key_for(4), data, [4, 5], ROOT_KEY)).ok
    assert tier.wait(tier.submit_load(key_for(4), bytearray(9_999))).status is Status.REJECTED
    assert tier.wait(tier.submit_load(key_for(99), bytearray(10))).status is Status.MISS
    assert tier.stats().misses == 1


def test_store_of_present_key_completes_ok_without_rewrite(make_tier):
    tier = make_tier()
    data = payload_for(5, 5000)
    assert tier.wait(tier.submit_store(key_for(5), data, [5, 6], ROOT_KEY)).ok
    assert tier.wait(tier.submit_store(key_for(5), data, [5, 6], ROOT_KEY)).detail == "present"
    assert tier.stats().stores == 1


def test_many_in_flight_and_get_finished(make_tier):
    tier = make_tier(io_threads=8)
    tickets = {
        tier.submit_store(key_for(i), payload_for(i, 20_000 + i), [i, i + 1], ROOT_KEY) for i in range(40)
    }
    done = []
    while len(done) < len(tickets):
        done += tier.get_finished()
    assert {c.ticket for c in done} == tickets and all(c.ok for c in done)
    bufs = {i: bytearray(20_000 + i) for i in range(40)}
    loads = {tier.submit_load(key_for(i), bufs[i]): i for i in range(40)}
    for ticket, i in loads.items():
        assert tier.wait(ticket, timeout=30).ok
        assert bytes(bufs[i]) == payload_for(i, 20_000 + i).tobytes()
    with pytest.raises(KeyError):
        tier.wait(next(iter(loads)))
    tier.check_integrity()


def test_tokens_parent_and_index_survive_restart(make_tier):
    tier = make_tier()
    k1 = chain_key(NS.id, ROOT_KEY, [7, 8, 9])
    k2 = chain_key(NS.id, k1, [10, 11])
    assert tier.wait(tier.submit_store(k1, payload_for(1, 100), [7, 8, 9], ROOT_KEY)).ok
    assert tier.wait(tier.submit_store(k2, payload_for(2, 200), [10, 11], k1)).ok
    tier.close()
    again = make_tier()
    info = again.lookup(k2)
    assert info is not None and (info.parent, info.token_count, info.payload_len) == (k1, 2, 200)
    assert again.read_tokens(k1).tolist() == [7, 8, 9]
    assert [e.key for e in again.extents()] == [k1, k2]


def test_namespaces_never_share_extents(make_tier):
    other = Namespace("test-model", KVLayout(2, 2, 64, KVDtype.FP16, 4))
    assert other.id != NS.id and chain_key(other.id, ROOT_KEY, [1]) != chain_key(NS.id, ROOT_KEY, [1])
    salted = Namespace("test-model", NS.layout, tenant_salt="tenant-b")
    assert salted.id != NS.id
    a, b = make_tier(NS), make_tier(other)
    assert a.wait(a.submit_store(key_for(1), payload_for(1, 100), [1, 2], ROOT_KEY)).ok
    assert b.wait(b.submit_load(key_for(1), bytearray(100))).status is Status.MISS


def test_file_names_are_hashes_and_modes_private(make_tier, tmp_path):
    tier = make_tier()
    assert tier.wait(tier.submit_store(key_for(1), payload_for(1, 100), [1, 2], ROOT_KEY)).ok
    path = next((tmp_path / "tier").rglob("*.ext"))
    rel = path.relative_to(tmp_path / "tier").parts
    assert rel == (NS.id.hex(), key_for(1).hex()[:2], key_for(1).hex() + ".ext")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for d in (path.parent, tmp_path / "tier" / rel[0], tmp_path / "tier"):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


def test_payload_starts_4096_aligned(make_tier, tmp_path):
    tier = make_tier()
    data = np.full(5000, 0xAB, dtype=np.uint8)
    tokens = list(range(3000))  # meta larger than one block
    assert tier.wait(tier.submit_store(chain_key(NS.id, ROOT_KEY, tokens), data, tokens, ROOT_KEY)).ok
    raw = next((tmp_path / "tier").rglob("*.ext")).read_bytes()
    start = raw.index(b"\xab" * 5000)
    assert start % 4096 == 0 and start >= 3000 * 4
    assert tier.read_tokens(chain_key(NS.id, ROOT_KEY, tokens)).tolist() == tokens


def test_closed_tier_rejects(make_tier):
    tier = make_tier()
    tier.close()
    assert tier.wait(tier.submit_load(key_for(1), bytearray(1))).status is Status.REJECTED
    assert tier.wait(tier.submit_store(key_for(1), b"x", tokens_for(1), ROOT_KEY)).status is Status.REJECTED


def test_bad_arguments_raise(make_tier):
    tier = make_tier()
    with pytest.raises(ValueError):
        tier.submit_load(b"short", bytearray(1))
    with pytest.raises(ValueError):
        tier.submit_load(key_for(1), b"read-only")
    with pytest.raises(ValueError):
        tier.submit_store(key_for(1), np.zeros((4, 4))[:, 1], tokens_for(1), ROOT_KEY)


def test_concurrent_stores_of_one_key_write_once(make_tier):
    tier = make_tier(io_threads=1)
    data = payload_for(6, 3 * CHUNK)
    tickets = [tier.submit_store(key_for(6), data, [6, 7], ROOT_KEY) for _ in range(5)]
    assert all(tier.wait(t).ok for t in tickets)
    assert tier.stats().stores == 1
    tier.check_integrity()


def test_torch_tensors_as_buffers(make_tier):
    tier = make_tier()
    kv = torch.randn(4, 3, 33).to(torch.bfloat16)
    assert tier.wait(tier.submit_store(key_for(8), kv, tokens_for(8), ROOT_KEY)).ok
    out = torch.empty_like(kv)
    assert tier.wait(tier.submit_load(key_for(8), out)).ok and torch.equal(out, kv)
    with pytest.raises(ValueError):
        tier.submit_load(key_for(8), out.transpose(0, 2))  # not contiguous


def test_a_key_must_name_what_the_extent_holds(make_tier):
    tier = make_tier()
    with pytest.raises(ValueError, match="chain_key"):
        tier.submit_store(key_for(1), b"x" * 10, tokens_for(2), ROOT_KEY)
    with pytest.raises(ValueError, match="chain_key"):
        tier.submit_store(key_for(1), b"x" * 10, tokens_for(1), key_for(0))  # right tokens, other start
