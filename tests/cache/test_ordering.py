"""The second law on a device whose streams run only when the test steps them (fake_device.py): each
rule of cache/device.py, put to the order that breaks it when it is missing. The forward is the
fake's forward stream; every copy moves real bytes when it runs, so a rule broken is a wrong byte.

1. a pack gathers only after the forward that wrote its slots;
2. a forward after an eviction writes the freed slots only after the pack gathered them;
3. an unpack writes its slots only after forwards queued before it (a slot freed as a duplicate
   may still be written by one);
4. an unpack from staging still being packed waits for that pack;
5. a forward reads restored slots only after their unpack;
6. slots of a restore given up are reused by a forward only after its unpack;
7. a staging block goes back only after the copies using it ran (8: also a streamed restore's,
   whose next read would land in it).
"""

from __future__ import annotations

import random
import time
from array import array
from pathlib import Path
from typing import Any

import pytest
import torch

from sgl_hicache.cache.reads import Readiness
from tests.cache.conftest import Stack, build_stack, close_stack, fill_kv, read_kv, shrink_staging
from tests.cache.fake_device import RecordingStreams, reuse_freed_slots_first

A = list(range(100, 164))  # 64 tokens
OTHER = list(range(1000, 1064))


@pytest.fixture
def stack(tmp_path: Path) -> Any:
    s = build_stack(tmp_path / "tier", size=256, streams=RecordingStreams())
    reuse_freed_slots_first(s.allocator)
    yield s
    close_stack(s)


def device(s: Stack) -> RecordingStreams:
    return s.cache.controller.engine.streams  # type: ignore[no-any-return]


def poison_free_slots(s: Stack) -> None:
    """Write other KV into every free slot (the device idle), so a copy that reads or a forward that
    reads a slot before its unpack sees it."""
    free = s.allocator.free_pages
    fill_kv(s.pool, free, [5000 + i for i in range(len(free))])


def ours_first(s: Stack) -> None:
    """Run our streams as far as they may go, then everything (the forward last)."""
    streams = device(s)
    streams.drain(random.Random(0), prefer=lambda st: st is not streams.forward)


def forward_first(s: Stack) -> None:
    streams = device(s)
    streams.drain(random.Random(0), prefer=lambda st: st is streams.forward)


def compute(s: Stack, tokens: list[int], ids: list[int] | None = None) -> torch.Tensor:
    """A request's forward: slots allocated now, its KV written by the forward stream (queued), the
    node inserted (as sglang inserts before the forward that writes its last token ran)."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    slots = s.allocator.alloc(len(tokens))
    assert slots is not None
    streams = device(s)
    streams.launch(streams.forward, lambda: fill_kv(s.pool, slots, ids or tokens))
    s.cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=slots))
    return slots


def forward_reads(s: Stack, slots: torch.Tensor, seen: list[list[int]]) -> None:
    streams = device(s)
    streams.launch(streams.forward, lambda: seen.append(read_kv(s.pool, slots)))


def reads_ready(s: Stack, tokens: list[int]) -> Any:
    """The match of `tokens`, once every read its restore needs has landed (no early unpack)."""
    ctl = s.cache.controller
    m = s.match(tokens)
    refs = tuple(n.spill for n in s.cache.tree.path_up(m.best_match_node, m.last_device_node))
    deadline = time.monotonic() + 10
    while ctl.readiness(refs)[0] is not Readiness.READY:
        assert time.monotonic() < deadline
        time.sleep(0.005)
        ctl.poll()
    return m


def evict_all(s: Stack) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    s.cache.evict(EvictParams(num_tokens=10**9))


def restore(s: Stack, tokens: list[int]) -> Any:
    """Match and restore (retrying while reads are in flight, the device idle meanwhile)."""
    m = s.match(tokens)
    assert m.host_hit_length == len(tokens)
    n, node = s.load_back(m)
    assert n == len(tokens)
    return node


def test_1_a_pack_waits_for_the_forward_that_wrote_its_slots(stack: Stack) -> None:
    compute(stack, A)  # its forward is queued, not run
    evict_all(stack)  # the pack is queued behind it
    ours_first(stack)  # the pack would gather unwritten slots if it did not wait
    stack.cache.controller.wait_writes()
    node = restore(stack, A)
    forward_first(stack)
    assert read_kv(stack.pool, node.value) == A


def test_1_a_write_through_waits_for_the_forward_that_writes_its_slots(tmp_path: Path) -> None:
    """sglang inserts a finished request while the forward that writes its last token may still
    run (the overlap scheduler): the write-through's pack at insert waits for it."""
    from sgl_hicache.config import WritePolicy

    stack = build_stack(
        tmp_path / "tier", size=256, streams=RecordingStreams(), write_policy=WritePolicy.WRITE_THROUGH
    )
    reuse_freed_slots_first(stack.allocator)
    compute(stack, A)  # written through at insert: its pack is queued behind the forward
    ours_first(stack)
    stack.cache.controller.wait_writes()
    stack.cache.controller.tier.close()  # the extent as written is what a restart finds
    again = build_stack(tmp_path / "tier", size=256)
    node = restore(again, A)
    assert read_kv(again.pool, node.value) == A
    close_stack(again)
    close_stack(stack)


def test_2_a_forward_writes_freed_slots_only_after_the_pack_gathered_them(stack: Stack) -> None:
    compute(stack, A)
    forward_first(stack)  # A's KV is in its slots
    evict_all(stack)  # pack queued, slots freed
    compute(stack, OTHER)  # reuses A's slots at once; its forward is queued after the eviction
    forward_first(stack)  # the forward would overwrite A's slots before the gather if it did not wait
    stack.cache.controller.wait_writes()
    evict_all(stack)
    forward_first(stack)
    stack.cache.controller.wait_writes()
    node = restore(stack, A)
    ours_first(stack)
    assert read_kv(stack.pool, node.value) == A


def test_3_an_unpack_waits_for_forwards_queued_before_it(stack: Stack) -> None:
    compute(stack, A)
    forward_first(stack)
    evict_all(stack)
    ours_first(stack)
    stack.cache.controller.wait_writes()  # A is on the tier only
    poison_free_slots(stack)
    stale = stack.allocator.alloc(len(A))  # a request's slots, written by a forward still queued ...
    streams = device(stack)
    streams.launch(streams.forward, lambda: fill_kv(stack.pool, stale, OTHER))
    stack.allocator.free(stale)  # ... then freed (a duplicate), so the restore below takes them
    node = restore(stack, A)
    assert set(node.value.tolist()) == set(stale.tolist())
    ours_first(stack)  # the unpack would run before that forward's write if it did not wait
    assert read_kv(stack.pool, node.value) == A


def test_4_an_unpack_from_staging_waits_for_its_pack(stack: Stack) -> None:
    compute(stack, A)
    forward_first(stack)
    evict_all(stack)  # the pack into staging is queued, not run
    streams = device(stack)
    streams.launch(streams.forward, lambda: poison_free_slots(stack))  # a forward reuses the slots
    node = restore(stack, A)  # restored from staging at once (the write is not even submitted)
    engine = stack.cache.controller.engine
    while len(engine._write.queue) > 2:  # the gather runs; its host copy and its event wait
        assert streams.step(engine._write)
    while streams.step(streams.forward):  # the forward goes past the gather (its slots were freed)
        pass
    while streams.step(engine._load):  # the unpack would read staging before the pack's copy
        pass
    ours_first(stack)
    assert read_kv(stack.pool, node.value) == A


def test_5_a_forward_reads_restored_slots_only_after_their_unpack(stack: Stack) -> None:
    compute(stack, A)
    forward_first(stack)
    evict_all(stack)
    ours_first(stack)
    stack.cache.controller.wait_writes()
    poison_free_slots(stack)
    node = restore(stack, A)
    seen: list[list[int]] = []
    forward_reads(stack, node.value, seen)
    forward_first(stack)  # the read would see the slots before the unpack if it did not wait
    assert seen == [A]


def test_6_slots_of_a_restore_given_up_are_reused_only_after_its_unpack(stack: Stack) -> None:
    compute(stack, A)
    forward_first(stack)
    evict_all(stack)
    ours_first(stack)
    stack.cache.controller.wait_writes()
    poison_free_slots(stack)
    ctl = stack.cache.controller
    m = reads_ready(stack, A)
    refs = tuple(n.spill for n in stack.cache.tree.path_up(m.best_match_node, m.last_device_node))
    slots = stack.allocator.alloc(len(A))
    ctl.restores.open("r", refs, slots)
    ctl.unpack_landed("r")  # queued on the load stream, not run
    assert ctl.restores.get("r").last_copy is not None
    ctl.restores.drop("r")  # the request went away: its slots are free again ...
    reused = stack.allocator.alloc(len(A))
    assert set(reused.tolist()) == set(slots.tolist())
    streams = device(stack)
    streams.launch(streams.forward, lambda: fill_kv(stack.pool, reused, OTHER))  # ... and written
    forward_first(stack)  # the forward would write before the unpack if it did not wait
    assert read_kv(stack.pool, reused) == OTHER


def test_7_staging_goes_back_only_after_its_unpack_ran(stack: Stack) -> None:
    compute(stack, A)
    forward_first(stack)
    evict_all(stack)
    ours_first(stack)
    stack.cache.controller.wait_writes()
    used = stack.cache.controller.staging.used_bytes
    node = restore(stack, A)  # the unpack is queued; the read is finished with
    assert stack.cache.controller.staging.used_bytes > used, "the read's block went back under its unpack"
    ours_first(stack)
    stack.cache.controller.poll()
    assert stack.cache.controller.staging.used_bytes == used
    forward_first(stack)
    assert read_kv(stack.pool, node.value) == A
    stack.cache.check_integrity()


def test_8_a_streamed_restores_block_is_reused_only_after_the_unpack_that_read_it(tmp_path: Path) -> None:
    """Three 64-token turns (8 KiB extents) through 20 KiB of staging: the third read can start only
    in a block an earlier read gave back. The device runs every third admission attempt only, so a
    block given back at once would take the third read's bytes before its unpack copied it out."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    stack = build_stack(tmp_path / "tier", size=512, streams=RecordingStreams())
    reuse_freed_slots_first(stack.allocator)
    tokens = list(range(100, 292))
    for end in (64, 128, 192):
        stack.insert(tokens[:end])
    evict_all(stack)
    ours_first(stack)
    stack.cache.controller.wait_writes()
    shrink_staging(stack, 20 << 10)
    poison_free_slots(stack)
    ctl = stack.cache.controller
    m = stack.match(tokens)
    assert (m.device_prefix_len, m.host_hit_length) == (0, len(tokens))
    params = InitLoadBackParams(
        m.best_match_node, m.host_hit_length, req=SimpleNamespace(last_node=m.last_device_node, rid="r")
    )
    deadline, rounds = time.monotonic() + 30, 0
    while (answer := stack.cache.init_load_back(params)) is None:
        while ctl.reads.in_flight and time.monotonic() < deadline:  # the reads started land
            time.sleep(0.002)
            ctl.poll()
        rounds += 1
        if rounds % 3 == 0:
            ours_first(stack)
        assert time.monotonic() < deadline
    assert answer[0] == len(tokens), str({k: v for k, v in stack.metrics.totals.items() if v})
    assert stack.metrics.totals["restores_streamed"] == 1
    forward_first(stack)
    chain = stack.cache.tree.path_up(answer[1], stack.cache.root_node)
    assert read_kv(stack.pool, torch.cat([node.value for node in chain])) == tokens
    stack.cache.check_integrity()
    close_stack(stack)


def test_a_pack_waits_for_sglangs_forward_stream_when_it_is_not_the_current_one(tmp_path: Any) -> None:
    """Kills `CopyEngine._forwards` returning the current stream only (set_forward_streams
    ignored): under sglang's overlap scheduler the forward runs on `forward_stream`, the scheduler
    thread's current stream is `schedule_stream`. The recording fake makes them one stream, so no
    CPU test could tell."""

    class OverlapStreams(RecordingStreams):
        def __init__(self) -> None:
            super().__init__()
            self.schedule = self.new_stream("schedule")

        def current(self) -> Any:
            return self.schedule

    streams = OverlapStreams()
    s = build_stack(tmp_path / "tier", size=256, streams=streams)
    s.cache.set_forward_streams([streams.forward, streams.schedule])  # what at_loop_start hands over
    compute(s, A)  # its forward queued on the forward stream, not run
    evict_all(s)  # the pack must wait for it
    streams.drain(random.Random(0), prefer=lambda st: st is not streams.forward)  # ours first
    s.cache.controller.wait_writes()
    m = s.match(A)
    n, node = s.load_back(m)
    streams.drain(random.Random(0), prefer=lambda st: st is streams.forward)
    assert n == len(A) and read_kv(s.pool, node.value) == A
    close_stack(s)
