"""Faults around the controller's copies (found by review of the controller / device split, issue
24; each test failed before its fix).

1. A restore's unpack that raises after it enqueued part of its copies (a multi-chunk unpack whose
   later chunk fails) leaves `progress.last_copy` at the copy before it, so `Restores.drop` orders
   the next forward only after that one: the freed slots are rewritten by a forward while the
   enqueued scatter still writes them (wrong KV on a GPU; shown on the recording fake).
   `store` guards the same shape with `write_barrier()`; the unpack path has no such barrier.
2. `SpillController.close` (the shutdown path, `shutdown.close_tier`) closes the tier without
   submitting the writes whose packs are done but not yet submitted. On an asynchronous device a
   pack is never done when `store` returns, so every spill waits for a later `poll`; an idle
   server (nothing polls) that shuts down loses them, though their bytes sit in staging.
3. `StagingPool` makes an arena of `capacity_bytes` but a free list of `capacity_bytes` rounded up
   to 4096: with a staging size that is not a multiple of 4096 (`--hicache-spill-staging 1.1G`)
   the last block is a truncated slice, and its release subtracts fewer bytes than its acquire
   added (accounting drift, `check_integrity` fails).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from sgl_hicache.cache import device as device_module
from tests.cache.conftest import Stack, build_stack, close_stack, fill_kv, read_kv
from tests.cache.fake_device import RecordingStreams, reuse_freed_slots_first
from tests.cache.test_ordering import (
    OTHER,
    A,
    compute,
    device,
    evict_all,
    forward_first,
    ours_first,
    reads_ready,
)

TOKEN_BYTES = 2 * 2 * 2 * 8 * 2  # conftest's pool: layers x (K, V) x heads x head_dim x bf16


@pytest.fixture
def stack(tmp_path: Path) -> Any:
    s = build_stack(tmp_path / "tier", size=256, streams=RecordingStreams())
    reuse_freed_slots_first(s.allocator)
    yield s
    close_stack(s)


def test_an_unpack_that_raises_midway_is_ordered_before_its_slots_are_reused(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(device_module, "TEMP_BYTES", 8 * TOKEN_BYTES)  # 64 tokens: 8 chunks
    compute(stack, A)
    forward_first(stack)
    evict_all(stack)
    ours_first(stack)
    stack.cache.controller.wait_writes()  # A is on the tier only
    m = reads_ready(stack, A)

    streams = device(stack)
    engine = stack.cache.controller.engine
    real_launch, loads = streams.launch, []

    def launch(stream: Any, work: Any) -> None:
        if stream is engine._load:
            loads.append(work)
            if len(loads) == 2:  # the second chunk fails to launch (e.g. its device temp: OOM)
                raise RuntimeError("injected: chunk 2 of the unpack")
        real_launch(stream, work)

    streams.launch = launch  # type: ignore[method-assign]
    n, _ = stack.load_back(m)
    streams.launch = real_launch  # type: ignore[method-assign]
    assert len(loads) == 2 and n == 0, "the restore failed after chunk 1 was enqueued"
    assert stack.cache.controller.restores.get("req-0") is None, "its slots were freed"

    reused = stack.allocator.alloc(len(A))  # a request takes the freed slots at once ...
    streams.launch(streams.forward, lambda: fill_kv(stack.pool, reused, OTHER))  # ... and writes them
    streams.drain(random.Random(0), prefer=lambda st: st is streams.forward)
    assert read_kv(stack.pool, reused) == OTHER, "chunk 1 of the failed unpack overwrote a forward's KV"


def test_close_submits_the_writes_whose_packs_are_done(tmp_path: Path) -> None:
    s = build_stack(tmp_path / "tier", size=256, streams=RecordingStreams())
    compute(s, A)
    forward_first(s)
    evict_all(s)  # write-back: A's only copy is its extent, packed into staging (not done yet)
    ours_first(s)  # the device finishes the pack; the server is idle now, so nothing polls
    s.cache.controller.close(5.0)  # what a SIGTERM does (shutdown.close_tier)
    again = build_stack(tmp_path / "tier", size=256)
    try:
        assert again.match(A).host_hit_length == len(A), "the spilled KV never reached the tier"
    finally:
        close_stack(again)


def test_staging_blocks_are_whole_when_the_size_is_not_a_multiple_of_4096() -> None:
    from sgl_hicache.cache.staging import StagingPool

    pool = StagingPool(1_000_001)  # e.g. --hicache-spill-staging 1.1G is not a multiple of 4096 either
    held = []
    while (buf := pool.acquire(4097)) is not None:  # each takes two pages of the free list
        held.append(buf)
    last = pool.acquire(4000)  # fits the byte budget, and the free list has a page for it
    assert last is not None
    try:
        assert last.numel() == 4000, f"asked for 4000 B, got a block of {last.numel()} B"
    finally:
        pool.release(last)
        for buf in held:
            pool.release(buf)
    assert pool.used_bytes == 0, f"{pool.used_bytes} B still counted as used with nothing held"


def test_a_disabled_caches_tier_is_still_closed_at_shutdown_with_its_writes(tmp_path: Path) -> None:
    """After spill was switched off for good (`disable_spill`: a fallback failed), the shutdown hook
    still closes the tier, which submits the spills packed before: nothing acknowledged is lost."""
    from types import SimpleNamespace

    from sgl_hicache.server.hooks import close_tier_first

    s = build_stack(tmp_path / "tier", size=256, streams=RecordingStreams())
    compute(s, A)
    forward_first(s)
    evict_all(s)  # write-back: A's only copy is its extent, packed into staging (not done yet)
    ours_first(s)
    s.cache.disable_spill()
    close_tier_first(SimpleNamespace(tree_cache=s.cache))  # sglang's graceful shutdown path
    again = build_stack(tmp_path / "tier", size=256)
    try:
        assert again.match(A).host_hit_length == len(A), "the spilled KV never reached the tier"
    finally:
        close_stack(again)
        close_stack(s)


def test_a_close_whose_device_wait_fails_still_closes_the_tier_and_says_so(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A device error while waiting for the packs at shutdown: the tier is closed all the same (its
    writes in flight get their time, its temp files go), and the log says the close failed."""
    import logging

    from sgl_hicache.server.shutdown import close_tier
    from sgl_hicache.tier import Status
    from tests.tier.common import key_for

    compute(stack, A)
    forward_first(stack)
    evict_all(stack)  # a pack not yet done: close waits for it
    io = stack.cache.controller
    tier = io.tier

    def device_lost(*_args: Any) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(io.engine.streams, "synchronize", device_lost)
    assert tier.wait(tier.submit_load(key_for(1), bytearray(1))).status is Status.MISS  # open
    with caplog.at_level(logging.WARNING, "sgl_hicache"):
        assert close_tier(io, "test") is False
    assert "closing the spill tier (test) failed" in caplog.text and "illegal memory access" in caplog.text
    assert tier.wait(tier.submit_load(key_for(1), bytearray(1))).status is Status.REJECTED  # closed


@pytest.mark.parametrize("error", [MemoryError("no shared memory"), OSError(12, "Cannot allocate memory")])
def test_no_staging_memory_means_serving_without_spill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    """The tier's host memory cannot be had (a real client's allocator refusing, mmap failing): the
    server serves as sglang would, its evictions dropped, the tier it opened closed; it starts."""
    from sgl_hicache.tier.file.backend import FileTier

    closed: list[bool] = []

    def refuse(self: FileTier, nbytes: int) -> memoryview:
        raise error

    real_close = FileTier.close
    monkeypatch.setattr(FileTier, "host_memory", refuse)
    monkeypatch.setattr(
        FileTier, "close", lambda self, *a, **k: (closed.append(True), real_close(self, *a, **k))[1]
    )
    stack = build_stack(tmp_path / "tier")
    assert stack.cache.controller is None and closed == [True]
