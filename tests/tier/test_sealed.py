"""Only extents sealed with the directory's secret are used; salted tenants' token ids never reach
the disk; a header whose digest does not name its key is a mismatch."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import xxhash

from sgl_hicache.tier import ROOT_KEY, Status, chain_key
from sgl_hicache.tier.codec import StoreRequest, prepare
from sgl_hicache.tier.file.store import write_extent
from sgl_hicache.tier.format import DirectoryMac
from sgl_hicache.tier.keys import ExtentKey, token_digest, tokens_to_bytes
from tests.tier.common import NS, payload_for

TOKENS = [0xDEADBEEF, 0x0BADF00D, 0xCAFEBABE, 0x8BADF00D]  # distinctive <u4 byte strings
PARENT = chain_key(NS.id, ROOT_KEY, [1, 2, 3])
KEY = chain_key(NS.id, PARENT, TOKENS)
DATA = payload_for(3, 70_000)


def plant(tier, req: StoreRequest, seal: DirectoryMac) -> Path:
    """Write `req` as a well-formed extent at its key's path with the format code, as a foreign
    writer could; returns the file."""
    write_extent(prepare(req, tier._cfg), tier._cfg, tier.namespace, tier._paths, False, seal)
    return tier._paths.extent(req.key)


def load(tier, key: ExtentKey = KEY) -> tuple[Status, bytes]:
    dest = bytearray(DATA.nbytes)
    return tier.wait(tier.submit_load(key, dest), timeout=30).status, bytes(dest)


def test_chain_key_is_over_the_count_and_digest_of_the_tokens():
    digest = xxhash.xxh3_128_digest(np.array(TOKENS, dtype="<u4").tobytes())
    assert token_digest(TOKENS) == digest
    want = xxhash.xxh3_128_digest(NS.id + PARENT + len(TOKENS).to_bytes(4, "little") + digest)
    assert want == KEY


@pytest.mark.parametrize("right_secret", [True, False], ids=["our-secret", "another-secret"])
def test_a_planted_extent_is_used_only_if_sealed_with_our_secret(make_tier, right_secret: bool):
    tier = make_tier()
    seal = tier._seal if right_secret else DirectoryMac(os.urandom(32))
    path = plant(tier, StoreRequest.of(KEY, PARENT, TOKENS, memoryview(DATA)), seal)

    tokens = tier.read_tokens(KEY)  # the warm start's read
    assert (tokens is not None and tokens.tolist() == TOKENS) is right_secret
    if not right_secret:
        assert not path.exists(), "read_tokens drops a file not sealed with our secret"
        plant(tier, StoreRequest.of(KEY, PARENT, TOKENS, memoryview(DATA)), seal)
    status, got = load(tier)
    if right_secret:
        assert status is Status.OK and got == DATA.tobytes()
    else:
        assert status is Status.CORRUPT and not path.exists()
        assert tier.stats().checksum_failures == 1


@pytest.mark.parametrize("right_secret", [True, False], ids=["our-secret", "another-secret"])
def test_the_scan_indexes_only_extents_sealed_with_our_secret(make_tier, right_secret: bool):
    tier = make_tier()
    seal = tier._seal if right_secret else DirectoryMac(os.urandom(32))
    path = plant(tier, StoreRequest.of(KEY, PARENT, TOKENS, memoryview(DATA)), seal)
    tier.close()
    again = make_tier()
    assert [info.key for info in again.extents()] == ([KEY] if right_secret else [])
    assert again.stats().removed_bad_files == (0 if right_secret else 1)
    assert path.exists() is right_secret
    again.check_integrity()


def test_a_salted_extent_holds_no_token_ids_and_still_verifies(make_tier):
    tier = make_tier()
    assert tier.wait(tier.submit_store(KEY, DATA, TOKENS, PARENT, store_tokens=False), timeout=30).ok
    raw = tier._paths.extent(KEY).read_bytes()
    assert tokens_to_bytes(TOKENS) not in raw
    assert not any(tokens_to_bytes([t]) in raw for t in TOKENS)
    assert tier.read_tokens(KEY) is None and tier.contains(KEY), "no ids to read, yet not dropped"
    assert load(tier) == (Status.OK, DATA.tobytes())
    tier.close()
    again = make_tier()
    info = again.lookup(KEY)
    assert info is not None and (info.parent, info.token_count) == (PARENT, len(TOKENS))
    assert load(again) == (Status.OK, DATA.tobytes())


def test_the_default_tenant_records_its_token_ids(make_tier):
    """The control for the test above: the search finds the ids when they are stored."""
    tier = make_tier()
    assert tier.wait(tier.submit_store(KEY, DATA, TOKENS, PARENT), timeout=30).ok
    assert tokens_to_bytes(TOKENS) in tier._paths.extent(KEY).read_bytes()
    assert tier.read_tokens(KEY).tolist() == TOKENS


@pytest.mark.parametrize("store_tokens", [True, False], ids=["with-ids", "salted"])
def test_a_sealed_header_whose_digest_names_other_tokens_is_a_mismatch(make_tier, store_tokens: bool):
    tier = make_tier()
    forged = StoreRequest.of(KEY, PARENT, [t ^ 1 for t in TOKENS], memoryview(DATA), store_tokens)
    path = plant(tier, forged, tier._seal)
    assert load(tier)[0] is Status.MISMATCH and not path.exists()
    assert tier.stats().mismatches == 1
    plant(tier, forged, tier._seal)
    assert tier.read_tokens(KEY) is None and not path.exists()
    plant(tier, forged, tier._seal)
    tier.close()
    again = make_tier()
    assert again.extents() == [] and again.stats().removed_bad_files == 1 and not path.exists()


def test_sealed_token_ids_that_do_not_hash_to_the_digest_are_a_mismatch(make_tier):
    tier = make_tier()
    other = tokens_to_bytes([t ^ 1 for t in TOKENS])
    forged = StoreRequest(KEY, PARENT, len(TOKENS), token_digest(TOKENS), other, memoryview(DATA))
    path = plant(tier, forged, tier._seal)
    assert tier.read_tokens(KEY) is None and not path.exists()
    plant(tier, forged, tier._seal)
    assert load(tier)[0] is Status.MISMATCH and not path.exists()
