"""KV cache events of the spill cache (issue 27): the same hashes as sglang's plain radix cache, a
spilled block stays stored under DISK, a dropped or tier-evicted one is removed, a restore moves it
back to GPU, a flush clears; events of tier evictions reach the queue on the scheduler thread; with
`kv_events_medium` cpu_pinned, spilled blocks are announced under CPU_PINNED instead (smg's host tier)."""

from __future__ import annotations

import threading
from array import array
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from sglang.srt.mem_cache.base_prefix_cache import InsertParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from sgl_hicache.config import KvEventsMedium
from tests.cache.router_view import RouterView, medium_name, page_hashes, tree_view

A = list(range(100, 132))  # 32 tokens
B = list(range(300, 332))
BRANCH = A[:16] + list(range(700, 716))  # shares A's first 16 tokens: splits A's node


def _events_stack(make_stack: Any, **kw: Any) -> Any:
    return make_stack(kv_events=True, **kw)


def _kinds(events: list[Any]) -> list[tuple[str, str | None, int]]:
    """(event type, medium, number of blocks) of each event."""
    return [
        (
            type(e).__name__,
            medium_name(e.medium) if hasattr(e, "medium") else None,
            len(getattr(e, "block_hashes", ())),
        )
        for e in events
    ]


def _true_view(s: Any, view: RouterView) -> RouterView:
    view.apply(s.cache.take_events())
    assert view.view() == tree_view(s.cache)
    return view


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("salt", [None, "alice"])
def test_hashes_equal_sglang_radix_cache(make_stack: Any, page_size: int, salt: str | None) -> None:
    """The same inserts publish the same events (hashes, parents, tokens) as sglang's own cache."""
    s = _events_stack(make_stack, page_size=page_size)
    plain = RadixCache.create_simulated(page_size=page_size, enable_kv_cache_events=True)
    for tokens in (A, BRANCH, A + B[:8], B):
        s.insert(tokens, salt=salt)
        key = RadixKey(array("q", tokens), cache_salt=salt)
        plain.insert(InsertParams(key=key, value=torch.arange(len(tokens), dtype=torch.int64)))
    ours, theirs = s.cache.take_events(), plain.take_events()
    assert ours == theirs and len(ours) > 1
    stored = [h for e in ours if isinstance(e, BlockStored) for h in e.block_hashes]
    assert set(stored) == set().union(*tree_view(s.cache).values())
    assert page_hashes(A, salt, page_size) == stored[: len(A) // page_size]


@pytest.mark.parametrize("page_size", [1, 4])
def test_spill_keeps_blocks_stored_on_disk(make_stack: Any, page_size: int) -> None:
    s = _events_stack(make_stack, page_size=page_size)
    view = RouterView()
    s.insert(A)
    s.insert(BRANCH)
    _true_view(s, view)
    s.evict_all()
    events = s.cache.take_events()
    assert _kinds(events) == [  # each victim: stored on DISK first, then removed from GPU
        ("BlockStored", "DISK", n) if i % 2 == 0 else ("BlockRemoved", "GPU", n)
        for i, n in enumerate(_block_counts(events))
    ]
    view.apply(events)
    assert set(view.view()) == {"DISK"} and view.view() == tree_view(s.cache)
    assert len(view.view()["DISK"]) == (len(A) + 16) // page_size


def _block_counts(events: list[Any]) -> list[int]:
    return [len(e.block_hashes) for e in events]


def test_restore_moves_blocks_back_to_gpu(make_stack: Any) -> None:
    s = _events_stack(make_stack)
    view = RouterView()
    s.insert(A)
    s.evict_all()
    _true_view(s, view)
    loaded, _ = s.load_back(s.match(A + [1]))
    assert loaded == len(A)
    events = s.cache.take_events()
    assert _kinds(events) == [("BlockStored", "GPU", len(A)), ("BlockRemoved", "DISK", len(A))]
    view.apply(events)
    assert view.view() == {"GPU": set(page_hashes(A, None, 1))} == tree_view(s.cache)


def _pinned_tree_view(cache: Any) -> dict[str, set[int]]:
    """`tree_view` with spilled blocks under CPU_PINNED, as `kv_events_medium` cpu_pinned announces them."""
    return {"CPU_PINNED" if m == "DISK" else m: held for m, held in tree_view(cache).items()}


def test_cpu_pinned_announces_spilled_blocks_as_host_blocks(make_stack: Any) -> None:
    """A spill stores CPU_PINNED then removes GPU, a restore the reverse, a drop removes CPU_PINNED:
    the router's view stays the tree's, spilled blocks under the host medium."""
    s = _events_stack(make_stack, page_size=4, kv_events_medium=KvEventsMedium.CPU_PINNED)
    view = RouterView()
    s.insert(A)
    s.insert(B)
    view.apply(s.cache.take_events())
    s.evict_all()
    events = s.cache.take_events()
    assert _kinds(events) == [("BlockStored", "CPU_PINNED", 8), ("BlockRemoved", "GPU", 8)] * 2
    view.apply(events)
    assert view.view() == _pinned_tree_view(s.cache) and set(view.view()) == {"CPU_PINNED"}
    assert s.load_back(s.match(A + [1]))[0] == len(A)
    events = s.cache.take_events()
    assert _kinds(events) == [("BlockStored", "GPU", 8), ("BlockRemoved", "CPU_PINNED", 8)]
    view.apply(events)
    assert view.view() == _pinned_tree_view(s.cache) == {
        "GPU": set(page_hashes(A, None, 4)), "CPU_PINNED": set(page_hashes(B, None, 4))
    }  # fmt: skip
    s.cache.controller = None  # no tier any more: A is dropped at its eviction, B's spilled node stays
    s.evict_all()
    view.apply(s.cache.take_events())
    assert view.view() == _pinned_tree_view(s.cache) == {"CPU_PINNED": set(page_hashes(B, None, 4))}


def test_a_node_dropped_instead_of_spilled_is_removed(make_stack: Any) -> None:
    s = _events_stack(make_stack, spill=False)
    view = RouterView()
    s.insert(A)
    s.evict_all()
    events = s.cache.take_events()
    assert _kinds(events)[-1] == ("BlockRemoved", "GPU", len(A))
    view.apply(events)
    assert view.view() == {} == tree_view(s.cache)


def test_dropping_a_parent_removes_its_spilled_children(make_stack: Any) -> None:
    """A short resident parent whose children spilled, dropped at its eviction (too short to spill
    on its own would not apply: it has spilled children, so make its spill impossible)."""
    s = _events_stack(make_stack)
    view = RouterView()
    s.insert(A)
    s.insert(BRANCH)  # A's node splits: a 16-token parent with two children
    s.evict_all()
    (parent,) = s.cache.root_node.children.values()
    loaded, _ = s.load_back(s.match(A[:16] + [1]))  # only the parent comes back
    assert loaded == 16 and not parent.evicted and all(c.evicted for c in parent.children.values())
    _true_view(s, view)
    s.cache.controller = None  # no tier any more: the parent is dropped, with its spilled subtree
    s.evict_all()
    events = s.cache.take_events()
    view.apply(events)
    assert s.cache.root_node.children == {} and view.view() == {} == tree_view(s.cache)
    assert {medium_name(e.medium) for e in events if isinstance(e, BlockRemoved)} == {"GPU", "DISK"}


def test_flush_clears_and_warm_start_stores_the_tier_on_disk(make_stack: Any, tmp_path: Path) -> None:
    s = _events_stack(make_stack, tier_dir=tmp_path / "tier")
    view = RouterView()
    s.insert(A)
    s.insert(B)
    s.evict_all()
    _true_view(s, view)
    spilled = view.view()["DISK"]
    restarted = _events_stack(make_stack, tier_dir=tmp_path / "tier")  # a new process: warm start
    fresh = RouterView()
    events = restarted.cache.take_events()
    assert isinstance(events[0], AllBlocksCleared)
    fresh.apply(events)
    assert fresh.view() == {"DISK": spilled} == tree_view(restarted.cache)
    restarted.cache.reset()  # a flush: a new epoch, an empty tree
    assert _kinds(restarted.cache.take_events()) == [("AllBlocksCleared", None, 0)]


def test_tier_eviction_is_removed_at_the_next_match_on_the_scheduler_thread(
    make_stack: Any, tmp_path: Path
) -> None:
    """The tier evicts A's extent on its I/O thread to make room for B's: A's removal is recorded on
    the scheduler thread, by the next match (which prunes A: its restore could only miss)."""
    probe = make_stack(tier_dir=tmp_path / "probe")
    probe.insert(A)
    probe.evict_all()
    one_extent = probe.cache.controller.tier.stats().bytes_stored
    s = _events_stack(make_stack, capacity_bytes=one_extent * 3 // 2)
    threads = _record_threads(s.cache.kv_events)
    view = RouterView()
    s.insert(A)
    s.evict_all()
    s.insert(B)
    s.evict_all()  # B's write evicts A's extent
    assert s.cache.controller.tier.stats().evictions == 1
    assert _true_view(s, view).view()["DISK"] >= set(page_hashes(A, None, 1))  # not known yet
    assert s.match(B).host_hit_length == len(B)
    events = s.cache.take_events()
    assert _kinds(events) == [("BlockRemoved", "DISK", len(A))]
    view.apply(events)
    assert view.view() == {"DISK": set(page_hashes(B, None, 1))} == tree_view(s.cache)
    assert threads == {threading.get_ident()}


def test_a_failed_write_is_removed_at_the_next_match(make_stack: Any) -> None:
    from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier

    s = _events_stack(make_stack)
    s.cache.controller.tier = FaultyTier(s.cache.controller.tier, FaultSpec(fail_rate=1.0))
    view = RouterView()
    s.insert(A)
    s.evict_all()  # the write fails: A's extent is LOST
    _true_view(s, view)
    assert s.match(B).host_hit_length == 0
    view.apply(s.cache.take_events())
    assert view.view() == {} == tree_view(s.cache)


def test_disabled_events_record_nothing(make_stack: Any) -> None:
    s = make_stack()
    s.insert(A)
    s.evict_all()
    assert s.cache.take_events() == []
    assert all(getattr(n, "kv_medium", None) is None for n in s.cache.root_node.children.values())


def _record_threads(recorder: Any) -> set[int]:
    """The threads that enqueue events into `recorder` from now on."""
    seen: set[int] = set()
    real = recorder.enqueue

    def enqueue(event: Any) -> None:
        seen.add(threading.get_ident())
        real(event)

    recorder.enqueue = enqueue
    return seen


@pytest.mark.parametrize(
    ("salt", "medium"),
    [(None, KvEventsMedium.DISK), ("alice", KvEventsMedium.DISK), (None, KvEventsMedium.CPU_PINNED)],
)
def test_smgs_relay_takes_our_stream_and_checks_its_hashes(
    make_stack: Any, salt: str | None, medium: KvEventsMedium
) -> None:
    """Our events, encoded as sglang's publisher sends them, through the relay of smg's gRPC
    servicer (the one `--grpc-mode` runs): nothing dropped, spilled pages on smg's DISK tier (its
    HOST tier with cpu_pinned, the one its index routes on), and its own rehash of sglang's page
    hashing finds no mismatch."""
    relay = pytest.importorskip("smg_grpc_servicer.kv_relay")
    import msgspec
    from sglang.srt.disaggregation.kv_events import KVEventBatch
    from smg_grpc_proto.generated import common_pb2

    s = _events_stack(make_stack, page_size=4, kv_events_medium=medium)
    s.insert(A, salt=salt)
    s.insert(BRANCH, salt=salt)
    s.evict_all()
    s.load_back(s.match(A + [1], salt=salt))
    payload = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=0.0, events=s.cache.take_events()))
    normalizer = relay.Normalizer(hash_check="sglang")
    proto = normalizer.normalize_batch(relay.decode_batch(payload), 1)
    counts = normalizer.counts
    assert counts.dropped == {} and counts.hash_mismatch == 0 and counts.hash_checked > 0
    tiers = {(e.WhichOneof("data"), getattr(e, e.WhichOneof("data")).tier) for e in proto.events[1:]}
    disk = common_pb2.KV_CACHE_TIER_DISK if medium is KvEventsMedium.DISK else common_pb2.KV_CACHE_TIER_HOST
    device = common_pb2.KV_CACHE_TIER_DEVICE
    assert tiers == {("stored", disk), ("stored", device), ("removed", disk), ("removed", device)}
