"""Layer-wise restore on the recording device (fake_device.py): per-layer events.

A restore admitted once its first layer group landed; the forward then reads layer by layer, each
read queued on the forward stream right after sglang's per-layer wait (`get_key_buffer`, our
`LayerCounter`). Rules, each put to the order that breaks it:

1. the forward's read of layer l runs only after group(l)'s unpack (its event, on our load stream);
2. it waits for that group's event only: layer l is read before group l+1's unpack has run, when
   the device runs the forward first;
3. a group's unpack waits only for the forwards queued when the restore's slots were handed over,
   not for the forward reading it: with our stream run first, group 1 is unpacked before the
   forward's read of layer 0 (the load overlaps the forward).
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.cache.conftest import Stack, build_stack, close_stack, fill_kv, read_kv
from tests.cache.fake_device import RecordingStreams, reuse_freed_slots_first

A = list(range(100, 164))  # 64 tokens: one 4 KiB chunk per layer group
LAYERS = 4  # four groups of one layer: groups 1-3 are still read when the forward starts


@pytest.fixture
def stack(tmp_path: Path) -> Any:
    s = build_stack(tmp_path / "tier", size=256, streams=RecordingStreams(), chunk_bytes=4096,
                    layerwise_restore=True, layers=LAYERS)  # fmt: skip
    reuse_freed_slots_first(s.allocator)
    yield s
    close_stack(s)


def device(s: Stack) -> RecordingStreams:
    return s.cache.controller.engine.streams  # type: ignore[no-any-return]


def admitted_layerwise(s: Stack) -> torch.Tensor:
    """A computed, spilled, then read slowly (group 1 lands a second after group 0) and admitted
    layer-wise; the free slots poisoned first. Returns the restored slots."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier

    slots = s.allocator.alloc(len(A))
    streams = device(s)
    streams.launch(streams.forward, lambda: fill_kv(s.pool, slots, A))
    s.cache.insert(InsertParams(key=RadixKey(array("q", A)), value=slots))
    s.cache.evict(EvictParams(num_tokens=10**9))
    streams.drain(random.Random(0))
    s.cache.controller.wait_writes()
    s.cache.controller.tier = FaultyTier(s.cache.controller.tier, FaultSpec(latency_s=4.0))
    free = s.allocator.free_pages
    fill_kv(s.pool, free, [5000 + i for i in range(len(free))])
    m = s.match(A)
    req = SimpleNamespace(last_node=m.last_device_node, rid="r")
    params = InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req)
    deadline = time.monotonic() + 30
    while (answer := s.cache.init_load_back(params)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    (restore,) = s.cache.layerwise.active
    assert restore.overlapped
    return s.cache.path_device_indices(answer[1])


def layer_ids(s: Stack, slots: torch.Tensor, layer: int) -> list[int] | None:
    try:
        return read_kv(s.pool, slots, range(layer, layer + 1))
    except AssertionError:
        return None


def forward_by_layer(s: Stack, slots: torch.Tensor) -> list[tuple[int, Any, Any]]:
    """sglang's forward: per layer, the pool's wait, then the attention's read queued on the forward
    stream. Each read records (layer, what that layer holds, what the next layer holds then)."""
    streams, seen = device(s), []
    for layer in range(LAYERS):
        s.pool.get_key_buffer(layer)
        nxt = min(layer + 1, LAYERS - 1)
        streams.launch(streams.forward, lambda layer=layer, nxt=nxt: seen.append(
            (layer, layer_ids(s, slots, layer), layer_ids(s, slots, nxt))))  # fmt: skip
    return seen


def test_1_2_each_layer_is_read_after_its_own_group_and_only_that(stack: Stack) -> None:
    slots = admitted_layerwise(stack)
    seen = forward_by_layer(stack, slots)
    streams = device(stack)
    streams.drain(random.Random(0), prefer=lambda st: st is streams.forward)
    assert [(layer, ids) for layer, ids, _ in seen] == [(i, A) for i in range(LAYERS)], (
        "read before its unpack"
    )
    assert all(nxt != A for _, _, nxt in seen[:-1]), "a layer's read waited for the next group's unpack too"
    assert stack.cache.after_forward([]) == []
    stack.cache.check_integrity()


def test_3_a_group_is_unpacked_beside_the_forward_not_behind_it(stack: Stack) -> None:
    slots = admitted_layerwise(stack)
    seen = forward_by_layer(stack, slots)
    streams = device(stack)
    streams.drain(random.Random(0), prefer=lambda st: st is not streams.forward)
    assert [ids for _, ids, _ in seen] == [A] * LAYERS
    assert seen[0][2] == A, "group 1's unpack waited for the forward reading layer 0"
    assert stack.cache.after_forward([]) == []


def test_review_a_restore_settled_by_a_poll_before_its_forward_is_waited_for(stack: Stack) -> None:
    """Review of issue 37 (closes a test gap; passes on main): a layer-wise restore whose last
    groups land and are unpacked by a poll (`Layerwise.advance`: another request's admission, the
    idle hook) before any forward reached them leaves the table settled, so no later forward's
    per-layer wait looks at it: only the settle's `forward_waits(last_copy)` orders the next
    forward's reads after those unpacks. No other test fails when that line is dropped."""
    slots = admitted_layerwise(stack)
    lw = stack.cache.layerwise
    deadline = time.monotonic() + 30
    while lw.active:
        stack.cache.poll()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    seen = forward_by_layer(stack, slots)
    streams = device(stack)
    streams.drain(random.Random(0), prefer=lambda st: st is streams.forward)
    assert [(layer, ids) for layer, ids, _ in seen] == [(i, A) for i in range(LAYERS)], (
        "read before the unpack of a restore settled by a poll"
    )
    assert stack.cache.after_forward([]) == []
    stack.cache.check_integrity()
