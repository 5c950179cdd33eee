"""Issue 37 item 1, measured: a layer-wise restore of a history of several extents must be admitted
once layer group 0 of each has landed, not once most of the history has. The tier reads a restore's
extents layer group by layer group (`Tier.submit_load(batch=...)`): every extent's group 0 before
any byte of a later group, so the prefill starts after about 1/groups of the restore's reads.

The tier has one I/O thread here and the test holds it at its first chunk until the admission has
started every read (so the order does not depend on thread timing), then at the first chunk of a
later group: the restore must be admitted layer-wise with that thread still held. Read extent by
extent (group 0 of the second extent queued behind the first extent's group 1), it never is.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from tests.cache.conftest import LAYERS, expected_kv
from tests.cache.test_layerwise import forward, take_completions

CHUNK = 4096
TURN = 200  # tokens a node, so an extent: 25,600 B of packed KV (128 B a token), 12,800 B a group
GROUP_CHUNKS = 4  # chunks of 4 KiB a group
TURNS = 4


def test_a_restore_of_several_extents_is_admitted_before_any_later_group_is_read(
    make_stack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    from sgl_hicache.tier.file import backend

    s = make_stack(size=2048, chunk_bytes=CHUNK, layerwise_restore=True, io_threads=1)
    tokens = list(range(300, 300 + TURN * TURNS))
    for end in range(TURN, len(tokens) + 1, TURN):
        s.insert(tokens[:end])  # one node (one extent) per turn
    s.evict_all()
    assert s.cache.controller.layout.count == LAYERS == 2

    started, later = threading.Event(), threading.Event()
    reads: list[tuple[bytes, int]] = []  # (extent key, layer group) of each chunk read, in order
    real = backend.read_chunk

    def read_chunk(ext: Any, piece: Any, dest: Any) -> int:
        group = bisect.bisect_right(list(itertools.accumulate(ext.header.sections)), piece.raw_off)
        reads.append((bytes(ext.header.key), group))
        started.wait(30)  # the first read waits until the admission has started every read
        if group > 0:
            later.wait(30)  # hold the only I/O thread at the first chunk of a later group
        return real(ext, piece, dest)

    monkeypatch.setattr(backend, "read_chunk", read_chunk)
    keys = {bytes(node.spill.extent.key) for node in spilled_chain(s, tokens)}
    assert len(keys) == TURNS
    m = s.match(tokens)
    assert m.host_hit_length == len(tokens)
    req = SimpleNamespace(last_node=m.last_device_node, rid="resume")
    params = InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req)
    t0 = time.monotonic()
    try:
        assert s.cache.init_load_back(params) is None, "admitted before any read landed"
        started.set()
        deadline = time.monotonic() + 20
        while (answer := s.cache.init_load_back(params)) is None:
            assert time.monotonic() < deadline, (
                f"not admitted while a later group's read waits: read so far {[g for _, g in reads]}"
            )
            time.sleep(0.005)
        groups = [g for _, g in reads]
        assert answer[0] == len(tokens), f"recomputed: group 0 never landed (groups read: {groups})"
        (restore,) = s.cache.layerwise.active
        assert restore.overlapped and not restore.done(1)
        first = TURNS * GROUP_CHUNKS  # every chunk of group 0, then (perhaps) the held one
        assert groups[:first] == [0] * first and groups[first:] in ([], [1]), groups
        assert {key for key, _ in reads} == keys
    finally:
        started.set()
        later.set()
    _, node = answer
    req.last_node = node
    s.cache.inc_lock_ref(node)
    assert forward(s, s.cache.path_device_indices(node)) == [expected_kv(tokens)] * LAYERS
    assert s.cache.after_forward([req]) == []
    take_completions(s)  # the scheduler's next polls take the reads' completions
    elapsed = time.monotonic() - t0
    totals = s.metrics.totals
    assert totals["layerwise_overlapped_restores"] == 1 and totals["restored_tokens"] == len(tokens)
    assert 0 < totals["restore_read_seconds"] <= elapsed, "the restore's reads were not counted"
    s.cache.dec_lock_ref(node)
    s.cache.check_integrity()


def spilled_chain(s: Any, tokens: list[int]) -> list[Any]:
    """The spilled nodes `tokens` match, top down."""
    m = s.match(tokens)
    return [n for n in s.cache.tree.path_up(m.best_match_node, s.cache.root_node) or [] if n.evicted]


def test_a_restore_never_joins_a_read_another_request_started(make_stack: Any) -> None:
    """A restore's reads are batched with the first read *it* started, never with an older one
    (another request's prefetch of the shared first extent): loads joining an older batch would
    rank ahead of every read and lookup submitted since, for as long as requests kept joining."""
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier

    s = make_stack(size=2048, chunk_bytes=CHUNK, layerwise_restore=True)
    tokens = list(range(300, 300 + TURN * TURNS))
    for end in range(TURN, len(tokens) + 1, TURN):
        s.insert(tokens[:end])
    s.evict_all()
    ctl = s.cache.controller
    ctl.tier = FaultyTier(ctl.tier, FaultSpec(latency_s=1.0))
    loads: list[tuple[bytes, Any, Any]] = []  # (key, batch, ticket) of each load submitted
    submit = ctl.tier.submit_load

    def recording(key: Any, dest: Any, nbytes: Any = None, group_layers: Any = None, batch: Any = None,
                  group_order: bool = True) -> Any:  # fmt: skip
        assert group_order, "a layer-wise restore's reads must land group by group"
        ticket = submit(key, dest, nbytes, group_layers, batch, group_order)
        loads.append((bytes(key), batch, ticket))
        return ticket

    ctl.tier.submit_load = recording  # type: ignore[method-assign]
    chain = spilled_chain(s, tokens)
    assert ctl.reads.prefetch([chain[0].spill]) > 0  # another request's read of the shared prefix
    ((_, _, older),) = loads
    m = s.match(tokens)
    req = SimpleNamespace(last_node=m.last_device_node, rid="resume")
    assert s.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req)) is None
    ours = loads[1:]
    assert [key for key, _, _ in ours] == [bytes(n.spill.extent.key) for n in chain[1:]]
    assert all(batch != older for _, batch, _ in ours), "the restore joined another request's read"
    first = ours[0][2]
    assert [batch for _, batch, _ in ours] == [None] + [first] * (len(ours) - 1), ours
    deadline = time.monotonic() + 20
    while s.cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    s.cache.check_integrity()


@pytest.mark.parametrize("batches", [False, True])
def test_a_whole_restore_is_one_batch_where_the_tier_batches_loads(make_stack: Any, batches: bool) -> None:
    """Issue 40: on a tier whose batches cost fewer calls (`Tier.batches_loads`: Mooncake, one store
    call for a batch's objects), a restore that is not layer-wise still submits its reads as one
    batch (each joins the first), and without group order (`group_order` False: the tier may read
    every group of the batch in one call); on the file tier each extent is read on its own, as
    before."""
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier

    s = make_stack(size=2048, chunk_bytes=CHUNK)
    tokens = list(range(300, 300 + TURN * TURNS))
    for end in range(TURN, len(tokens) + 1, TURN):
        s.insert(tokens[:end])
    s.evict_all()
    ctl = s.cache.controller
    if batches:  # the file tier made to say so, so that this test needs no Mooncake master
        ctl.tier.batches_loads = True
    ctl.tier = FaultyTier(ctl.tier, FaultSpec(latency_s=0.5))
    loads: list[tuple[Any, Any]] = []  # (batch, ticket) of each load submitted
    orders: list[bool] = []  # group_order of each
    submit = ctl.tier.submit_load

    def recording(key: Any, dest: Any, nbytes: Any = None, group_layers: Any = None, batch: Any = None,
                  group_order: bool = True) -> Any:  # fmt: skip
        ticket = submit(key, dest, nbytes, group_layers, batch, group_order)
        loads.append((batch, ticket))
        orders.append(group_order)
        return ticket

    ctl.tier.submit_load = recording  # type: ignore[method-assign]
    m = s.match(tokens)
    req = SimpleNamespace(last_node=m.last_device_node, rid="resume")
    params = InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req)
    assert s.cache.init_load_back(params) is None  # reads started, none landed yet
    assert len(loads) == TURNS
    first = loads[0][1]
    want = [None] + [first if batches else None] * (TURNS - 1)
    assert [batch for batch, _ in loads] == want
    assert orders == [False] * TURNS, "a restore that is not layer-wise needs no group order"
    deadline = time.monotonic() + 20
    while (answer := s.cache.init_load_back(params)) is None:
        assert time.monotonic() < deadline, "never admitted"
        time.sleep(0.01)
    assert answer[0] == len(tokens)
    _, node = answer
    assert forward(s, s.cache.path_device_indices(node)) == [expected_kv(tokens)] * LAYERS
    s.cache.check_integrity()
