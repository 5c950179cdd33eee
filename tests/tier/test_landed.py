"""`Tier.landed`: the verified prefix of a load in flight, readable before its completion."""

from __future__ import annotations

import time
from pathlib import Path

from sgl_hicache.tier import ROOT_KEY, Status, Tier
from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier
from tests.tier.common import CHUNK, key_for, payload_for

SIZE = 5 * CHUNK + 1000  # six chunks, the last one short


def stored(tier: Tier, tmp_path: Path, bad_chunk: int | None = None) -> bytes:
    """Store extent 1 (SIZE bytes); flip a byte of chunk `bad_chunk` on disk if given."""
    data = payload_for(1, SIZE)
    assert tier.wait(tier.submit_store(key_for(1), data, [1, 2], ROOT_KEY)).ok
    if bad_chunk is not None:
        (path,) = tmp_path.rglob("*.ext")
        raw = bytearray(path.read_bytes())
        raw[4096 + bad_chunk * CHUNK + 7] ^= 0xFF  # header_len is 4096 for two tokens
        path.write_bytes(bytes(raw))
    return data.tobytes()


def until(cond: object, what: str) -> None:
    deadline = time.monotonic() + 30
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what} did not happen within 30 s"
        time.sleep(0.002)


def test_landed_is_the_whole_load_until_its_completion_is_returned(make_tier, tmp_path):
    tier = make_tier()
    data = stored(tier, tmp_path)
    dest = bytearray(SIZE)
    ticket = tier.submit_load(key_for(1), dest)
    until(lambda: tier.stats().loads == 1, "the load")
    assert tier.landed(ticket) == SIZE and bytes(dest) == data
    assert tier.wait(ticket).ok
    assert tier.landed(ticket) == 0, "nothing is reported once the completion was returned"


def test_landed_stops_before_a_corrupt_chunk(make_tier, tmp_path):
    tier = make_tier()
    data = stored(tier, tmp_path, bad_chunk=3)
    dest = bytearray(SIZE)
    ticket = tier.submit_load(key_for(1), dest)
    until(lambda: tier.stats().checksum_failures == 1, "the failed load")
    assert tier.landed(ticket) == 3 * CHUNK, "chunks after the bad one are verified but not a prefix"
    assert bytes(dest[: 3 * CHUNK]) == data[: 3 * CHUNK]
    assert tier.wait(ticket).status is Status.CORRUPT and tier.landed(ticket) == 0


def test_landed_of_stores_and_unknown_tickets_is_zero(make_tier):
    tier = make_tier()
    ticket = tier.submit_store(key_for(2), payload_for(2, 100), [2, 3], ROOT_KEY)
    assert tier.landed(ticket) == 0
    tier.wait(ticket)
    assert tier.landed(ticket) == 0 and tier.landed(ticket + 1000) == 0  # type: ignore[operator]


def samples_until_done(tier: Tier, ticket: object, dest: bytearray, data: bytes) -> tuple[list[int], Status]:
    """Poll `landed` until the completion comes; every landed prefix must already hold the data."""
    samples: list[int] = []
    deadline = time.monotonic() + 30
    while True:
        n = tier.landed(ticket)  # type: ignore[arg-type]
        assert bytes(dest[:n]) == data[:n], "landed bytes must be final, verified payload"
        samples.append(n)
        done = [c for c in tier.get_finished() if c.ticket == ticket]
        if done:
            return samples, done[0].status
        assert time.monotonic() < deadline
        time.sleep(0.002)


def test_slow_faulty_tier_reveals_a_growing_verified_prefix(make_tier, tmp_path):
    tier = FaultyTier(make_tier(), FaultSpec(latency_s=0.2))
    data = stored(tier, tmp_path)
    dest = bytearray(SIZE)
    samples, status = samples_until_done(tier, tier.submit_load(key_for(1), dest), dest, data)
    assert status is Status.OK
    assert samples == sorted(samples) and max(samples) <= SIZE


def test_slow_faulty_tier_never_reveals_past_the_inner_failure(make_tier, tmp_path):
    tier = FaultyTier(make_tier(), FaultSpec(latency_s=0.2))
    data = stored(tier, tmp_path, bad_chunk=2)
    dest = bytearray(SIZE)
    samples, status = samples_until_done(tier, tier.submit_load(key_for(1), dest), dest, data)
    assert status is Status.CORRUPT
    assert samples == sorted(samples) and max(samples) <= 2 * CHUNK


def test_a_load_bound_to_be_corrupted_reveals_nothing(make_tier, tmp_path):
    tier = FaultyTier(make_tier(), FaultSpec(latency_s=0.1, corrupt_rate=1.0))
    data = stored(tier, tmp_path)  # corruption is injected into loads only
    dest = bytearray(SIZE)
    samples, status = samples_until_done(tier, tier.submit_load(key_for(1), dest), dest, data)
    assert status is Status.CORRUPT and set(samples) == {0}
