"""FaultyTier: deterministic by seed; latency, failures and corruption as the real tier reports them."""

from __future__ import annotations

import time

import pytest

from sgl_hicache.tier import ROOT_KEY, Status
from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier
from tests.tier.common import key_for, payload_for, tokens_for


def run(tier) -> list[Status]:
    statuses = []
    for i in range(30):
        statuses.append(
            tier.wait(tier.submit_store(key_for(i), payload_for(i, 3000), tokens_for(i), ROOT_KEY)).status
        )
        statuses.append(tier.wait(tier.submit_load(key_for(i), bytearray(3000))).status)
    return statuses


def test_same_seed_same_faults(make_tier, tmp_path):
    spec = FaultSpec(seed=7, fail_rate=0.2, corrupt_rate=0.2)
    a = run(FaultyTier(make_tier(directory=tmp_path / "a"), spec))
    b = run(FaultyTier(make_tier(directory=tmp_path / "b"), spec))
    c = run(
        FaultyTier(make_tier(directory=tmp_path / "c"), FaultSpec(seed=8, fail_rate=0.2, corrupt_rate=0.2))
    )
    assert a == b and a != c
    assert {Status.OK, Status.IO_ERROR, Status.CORRUPT} <= set(a)


def test_corruption_scribbles_and_discards(make_tier):
    tier = FaultyTier(make_tier(), FaultSpec(corrupt_rate=1.0))
    data = payload_for(1, 3000)
    assert tier.wait(tier.submit_store(key_for(1), data, tokens_for(1), ROOT_KEY)).ok
    buf = bytearray(3000)
    done = tier.wait(tier.submit_load(key_for(1), buf))
    assert done.status is Status.CORRUPT and bytes(buf) != data.tobytes()
    assert not tier.contains(key_for(1)) and tier.injected["corruptions"] == 1


def test_silent_corruption_completes_ok_with_wrong_bytes_and_never_shows_them_early(make_tier):
    tier = FaultyTier(make_tier(), FaultSpec(latency_s=0.2, silent_corrupt_rate=1.0))
    data = payload_for(1, 3000)
    assert tier.wait(tier.submit_store(key_for(1), data, tokens_for(1), ROOT_KEY)).ok
    buf = bytearray(3000)
    ticket = tier.submit_load(key_for(1), buf)
    seen = []
    while not (done := [c for c in tier.get_finished() if c.ticket == ticket]):
        seen.append(tier.landed(ticket))
        time.sleep(0.005)
    assert done[0].status is Status.OK and done[0].nbytes == 3000
    assert set(seen) == {0}, "a silently corrupted load must not show its verified bytes early"
    expected = data.copy()
    expected[0::2] ^= 0x55  # every value of the payload is perturbed
    assert bytes(buf) == expected.tobytes()
    assert tier.contains(key_for(1)) and tier.injected["silent_corruptions"] == 1


def test_failures_are_not_passed_on(make_tier):
    inner = make_tier()
    tier = FaultyTier(inner, FaultSpec(fail_rate=1.0))
    assert (
        tier.wait(tier.submit_store(key_for(1), b"x" * 10, tokens_for(1), ROOT_KEY)).status is Status.IO_ERROR
    )
    assert inner.stats().stores == 0 and not tier.contains(key_for(1))


def test_latency_holds_completions(make_tier):
    tier = FaultyTier(make_tier(), FaultSpec(latency_s=1.0))
    t0 = time.monotonic()
    ticket = tier.submit_store(key_for(1), b"x" * 10, tokens_for(1), ROOT_KEY)
    time.sleep(0.05)
    assert tier.get_finished() == [] or time.monotonic() - t0 >= 1.0  # (a stalled test machine)
    assert tier.wait(ticket).ok and time.monotonic() - t0 >= 1.0
    with pytest.raises(KeyError):
        tier.wait(ticket)


@pytest.mark.parametrize("field", ["fail_rate", "corrupt_rate", "silent_corrupt_rate"])
@pytest.mark.parametrize("value", [-0.1, 1.5])
def test_spec_is_validated(field, value):
    with pytest.raises(ValueError):
        FaultSpec(**{field: value})
