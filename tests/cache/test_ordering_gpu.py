"""The ordering rules of cache/device.py on a real GPU (skipped without one): sglang's forward is a
CUDA stream kept busy by `torch.cuda._sleep` before it writes or reads, so a copy of ours that did
not wait for it (or a forward that did not wait for ours) would move the wrong bytes. The same
scenarios run on the CPU against the recording fake in test_ordering.py."""

from __future__ import annotations

from array import array
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.cache.conftest import Stack, build_stack, close_stack, fill_kv, read_kv
from tests.cache.fake_device import reuse_freed_slots_first

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

A = list(range(100, 164))
OTHER = list(range(1000, 1064))
BUSY = 200_000_000  # cycles the forward stream sleeps first: ~0.1 s, far longer than any copy here


@pytest.fixture
def stack(tmp_path: Path) -> Any:
    s = build_stack(tmp_path / "tier", size=256, device="cuda")
    reuse_freed_slots_first(s.allocator)  # a freed slot is handed out again at once
    forward = torch.cuda.Stream()
    s.cache.set_forward_streams([forward])
    yield s, forward
    torch.cuda.synchronize()
    close_stack(s)


def on_forward(forward: Any, work: Any) -> None:
    """A forward that runs late: the stream sleeps, then `work` touches the pool."""
    with torch.cuda.stream(forward):
        torch.cuda._sleep(BUSY)
        work()


def compute(s: Stack, forward: Any, tokens: list[int]) -> torch.Tensor:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    slots = s.allocator.alloc(len(tokens))
    on_forward(forward, lambda: fill_kv(s.pool, slots, tokens))
    s.cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=slots))
    return slots


def evict_and_restore(s: Stack, tokens: list[int]) -> Any:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    s.cache.evict(EvictParams(num_tokens=10**9))
    s.cache.controller.wait_writes()
    m = s.match(tokens)
    n, node = s.load_back(m)
    assert n == len(tokens)
    return node


def test_a_pack_waits_for_the_forward_that_wrote_its_slots(stack: Any) -> None:
    s, forward = stack
    compute(s, forward, A)  # written ~0.1 s from now
    node = evict_and_restore(s, A)  # packed at once: it must wait for that write
    torch.cuda.synchronize()
    assert read_kv(s.pool, node.value) == A


def test_a_forward_reads_restored_slots_after_their_unpack(stack: Any) -> None:
    s, forward = stack
    compute(s, forward, A)
    torch.cuda.synchronize()
    with torch.cuda.stream(s.cache.controller.engine._load):
        torch.cuda._sleep(BUSY)  # our load stream is late: the unpack lands ~0.1 s from now
    node = evict_and_restore(s, A)
    seen: list[list[int]] = []
    with torch.cuda.stream(forward):  # no sleep: the read is queued right behind the unpack's event
        got = s.pool.k_buffer[0][node.value].clone()
    torch.cuda.synchronize()
    seen.append(read_kv(s.pool, node.value))
    assert seen == [A]
    assert torch.equal(got, s.pool.k_buffer[0][node.value])


def test_freed_slots_are_rewritten_only_after_the_pack_gathered_them(stack: Any) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    s, forward = stack
    compute(s, forward, A)
    torch.cuda.synchronize()
    with torch.cuda.stream(s.cache.controller.engine._write):
        torch.cuda._sleep(BUSY)  # our write stream is late this time
    freed = s.cache.root_node.children[A[0]].value.clone()
    s.cache.evict(EvictParams(num_tokens=10**9))
    slots = s.allocator.alloc(len(A))
    assert set(slots.tolist()) == set(freed.tolist())
    with torch.cuda.stream(forward):  # a forward reuses the freed slots at once
        fill_kv(s.pool, slots, OTHER)
    s.cache.controller.wait_writes()
    torch.cuda.synchronize()
    s.allocator.free(slots)
    m = s.match(A)
    n, node = s.load_back(m)
    torch.cuda.synchronize()
    assert n == len(A) and read_kv(s.pool, node.value) == A
