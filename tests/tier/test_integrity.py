"""Corruption never becomes wrong data: bit flips and truncations are detected and dropped."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgl_hicache.config import Compression
from sgl_hicache.tier import ROOT_KEY, Status, chain_key
from sgl_hicache.tier.format import FIXED_SIZE, decode_fixed
from tests.tier.common import CHUNK, NS, key_for, payload_for, tokens_for

DATA = payload_for(7, 2 * CHUNK + 3000)
TOKENS = list(range(700))
KEY7 = chain_key(NS.id, ROOT_KEY, TOKENS)
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(params=[Compression.NONE, Compression.ZSTD])
def stored(request, make_tier, tmp_path):
    """A tier holding extent 7, its file path and pristine bytes."""
    tier = make_tier(compression=request.param)
    assert tier.wait(tier.submit_store(KEY7, DATA, TOKENS, ROOT_KEY)).ok
    path = next((tmp_path / "tier").rglob("*.ext"))
    return tier, path, path.read_bytes()


def covered(raw: bytes) -> list[range]:
    """Byte ranges protected by a checksum: fixed header + meta, and the stored chunks."""
    h = decode_fixed(raw, None)
    from sgl_hicache.tier.format import decode_meta

    _, chunks = decode_meta(h, raw, None)
    return [range(FIXED_SIZE + h.meta_len)] + [
        range(h.header_len + c.offset, h.header_len + c.offset + c.length) for c in chunks
    ]


def load_all(tier):
    dest = bytearray(DATA.nbytes)
    return tier.wait(tier.submit_load(KEY7, dest)), bytes(dest)


@FAST
@given(pos=st.integers(min_value=0), bit=st.integers(0, 7))
def test_bit_flips_are_detected(stored, pos, bit):
    tier, path, raw = stored
    pos %= len(raw)
    bad = bytearray(raw)
    bad[pos] ^= 1 << bit
    path.write_bytes(bytes(bad))
    done, got = load_all(tier)
    if any(pos in r for r in covered(raw)):
        assert done.status is Status.CORRUPT
        assert not path.exists()
    else:  # padding: harmless, but never wrong data
        assert done.status is Status.OK and got == DATA.tobytes()


@FAST
@given(cut=st.integers(min_value=0))
def test_truncations_are_detected(stored, cut):
    tier, path, raw = stored
    path.write_bytes(raw[: cut % len(raw)])
    done, _ = load_all(tier)
    assert done.status is Status.CORRUPT and not path.exists()


def test_corrupt_extent_leaves_index_and_accounting(stored):
    tier, path, raw = stored
    path.write_bytes(raw[:100])
    assert load_all(tier)[0].status is Status.CORRUPT
    s = tier.stats()
    assert (s.extents, s.bytes_stored, s.checksum_failures) == (0, 0, 1)
    tier.check_integrity()


def test_scan_drops_bad_headers_and_foreign_files(make_tier, tmp_path: Path):
    tier = make_tier()
    for i in range(3):
        assert tier.wait(tier.submit_store(key_for(i), payload_for(i, 5000), tokens_for(i), ROOT_KEY)).ok
    tier.close()
    files = sorted((tmp_path / "tier").rglob("*.ext"))
    files[0].write_bytes(b"garbage" * 1000)
    files[1].rename(files[1].with_name("0" * 32 + ".ext"))  # header key no longer matches its name
    again = make_tier()
    assert len(again.extents()) == 1 and again.stats().removed_bad_files == 2
    again.check_integrity()


def test_version_mismatch_is_corrupt(stored):
    tier, path, raw = stored
    bad = bytearray(raw)
    bad[8] = 2  # format version field: an older version no longer read (header checksum then also mismatches)
    path.write_bytes(bytes(bad))
    assert load_all(tier)[0].status is Status.CORRUPT


def test_a_newer_version_without_its_header_mac_is_corrupt(stored):
    """A newer version keeps the fixed header and its MAC (docs/FORMAT.md): a version field raised
    without it is a flipped bit, not a newer file (tests/tier/test_newer_format.py re-seals it as
    a newer writer would: then it is kept)."""
    tier, path, raw = stored
    bad = bytearray(raw)
    bad[8] = 99
    path.write_bytes(bytes(bad))
    assert load_all(tier)[0].status is Status.CORRUPT
    assert tier.stats().newer_extents == 0
