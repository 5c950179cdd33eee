"""Unpacking overlaps the remaining reads: verified chunks are unpacked while later ones are read,
and nothing is served before the whole restore is verified.

The tier reads B (200 tokens of 128 bytes) as seven 4 KiB chunks; a slow FaultyTier reveals the
verified chunks over one second, as a slow disk would, and holds the completion until then.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from tests.cache.conftest import expected_kv, read_kv

B = list(range(300, 500))
CHUNK = 4096
RID = "resume-1"


def spilled_behind_a_slow_tier(make_stack: Any, bad_chunk: int | None = None, **overrides: Any) -> Any:
    """B inserted, spilled to one extent (chunk `bad_chunk` flipped on disk), read at 1 s latency."""
    from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier

    s = make_stack(size=512, chunk_bytes=CHUNK, **overrides)
    s.insert(B)
    s.evict_all()
    if bad_chunk is not None:
        (path,) = [p for p in s.tier_dir.rglob("*") if p.is_file() and p.stat().st_size > CHUNK]
        raw = bytearray(path.read_bytes())
        raw[4096 + bad_chunk * CHUNK + 5] ^= 0xFF  # header_len is 4096 for 200 tokens
        path.write_bytes(bytes(raw))
    s.cache.controller.tier = FaultyTier(s.cache.controller.tier, FaultSpec(latency_s=1.0))
    return s


def admission(s: Any) -> tuple[Any, Any]:
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    m = s.match(B)
    req = SimpleNamespace(last_node=m.last_device_node, rid=RID)
    return m, InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req)


def retry_until_answered(s: Any, m: Any, params: Any) -> Any:
    """The scheduler's retries; while deferred, the restore may hold slots but serves nothing."""
    deadline = time.monotonic() + 30
    while (answer := s.cache.init_load_back(params)) is None:
        assert m.best_match_node.evicted, "a node became resident before its restore was verified"
        s.cache.check_integrity()  # partial restores' slots are accounted, owned by no node
        assert time.monotonic() < deadline, "admission deferred for 30 s"
        time.sleep(0.005)
    return answer


def test_landed_chunks_are_unpacked_while_later_ones_are_read(make_stack: Any) -> None:
    s = spilled_behind_a_slow_tier(make_stack)
    m, params = admission(s)
    seen_partial = []
    deadline = time.monotonic() + 30
    while (answer := s.cache.init_load_back(params)) is None:
        progress = s.cache.controller.restores.get(RID)
        if progress is not None and any(progress.unpacked[0]):
            layout = s.cache.controller.layout
            for g, n in enumerate(progress.unpacked[0]):  # each layer group's verified prefix
                got = read_kv(s.pool, progress.slots[:n], range(*layout.ranges[g])) if n else []
                assert got == expected_kv(B[:n]), "early unpack wrote wrong KV"
            seen_partial.append(list(progress.unpacked[0]))
        assert m.best_match_node.evicted and time.monotonic() < deadline
        time.sleep(0.005)
    loaded, last = answer
    assert loaded == len(B) and read_kv(s.pool, last.value) == expected_kv(B)
    stats = s.cache.controller.restores.stats
    assert stats.steps >= 1 and stats.tokens > 0 and stats.finished == 1
    assert seen_partial and seen_partial == sorted(seen_partial)
    assert s.cache.controller.restores.held_tokens == 0
    s.cache.check_integrity()


def test_a_corrupt_later_chunk_abandons_a_partly_unpacked_restore(make_stack: Any) -> None:
    s = spilled_behind_a_slow_tier(make_stack, bad_chunk=4)
    m, params = admission(s)
    free_before = s.allocator.available_size()
    assert retry_until_answered(s, m, params) == (0, m.last_device_node)
    stats = s.cache.controller.restores.stats
    assert stats.tokens > 0, "the chunks before the corrupt one should have been unpacked early"
    assert stats.tokens <= 4 * CHUNK // 128, "nothing past the corrupt chunk is unpacked"
    assert s.allocator.available_size() == free_before, "the abandoned restore's slots are freed"
    assert s.cache.controller.restores.held_tokens == 0 and stats.finished == 0
    totals = s.metrics.totals
    assert (totals["corrupt_extents"], totals["restore_failures"], totals["restored_tokens"]) == (1, 1, 0)
    assert s.match(B).host_hit_length == 0, "the lost node is pruned, nothing was restored"
    s.cache.check_integrity()


def wait_for_partial(s: Any, params: Any) -> None:
    deadline = time.monotonic() + 30
    while not s.cache.controller.restores.held_tokens:
        assert s.cache.init_load_back(params) is None, "the restore finished before any early unpack"
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_memory_pressure_frees_a_partial_restore_first_and_it_still_completes(make_stack: Any) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    s = spilled_behind_a_slow_tier(make_stack)
    s.insert(list(range(600, 640)))  # an evictable tree node
    m, params = admission(s)
    wait_for_partial(s, params)
    held, tree_evicted = s.cache.controller.restores.held_tokens, s.metrics.totals["evicted_tokens"]
    assert s.cache.evictable_size() == 40 + held, "sglang's budget sees partial restores as evictable"
    assert s.cache.evict(EvictParams(num_tokens=1)).num_tokens_evicted == held
    assert s.cache.controller.restores.stats.evicted == 1
    assert s.metrics.totals["evicted_tokens"] == tree_evicted, "no tree node was evicted"
    s.cache.check_integrity()
    loaded, last = retry_until_answered(s, m, params)
    assert loaded == len(B) and read_kv(s.pool, last.value) == expected_kv(B)
    s.cache.check_integrity()


def test_a_partial_restore_nobody_comes_back_for_expires(make_stack: Any) -> None:
    s = spilled_behind_a_slow_tier(make_stack, prefetch_ttl_s=0.8)
    free_before = s.allocator.available_size()
    _, params = admission(s)
    wait_for_partial(s, params)
    time.sleep(1.0)  # the request went away (aborted): no more retries
    s.cache.check_integrity()  # polls, which expires it
    assert s.cache.controller.restores.stats.expired == 1 and s.allocator.available_size() == free_before


def test_a_second_deferred_request_frees_its_partial_restore_once_the_first_restored(make_stack: Any) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    s = spilled_behind_a_slow_tier(make_stack)
    free_before = s.allocator.available_size()
    m, first = admission(s)
    second = InitLoadBackParams(
        m.best_match_node,
        m.host_hit_length,
        req=SimpleNamespace(last_node=m.last_device_node, rid="resume-2"),
    )
    deadline = time.monotonic() + 30
    while s.cache.controller.restores.get("resume-2") is None:  # the second takes its slots early
        assert s.cache.init_load_back(second) is None, "the read landed before the second was deferred"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    while (answer := s.cache.init_load_back(first)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert answer[0] == len(B) and s.cache.controller.restores.get("resume-2") is not None
    assert s.cache.init_load_back(second) == (len(B), m.best_match_node), "B is resident now"
    assert s.cache.controller.restores.held_tokens == 0, "the second request's partial restore is freed"
    assert s.allocator.available_size() == free_before - len(B)
    s.cache.check_integrity()


class LateBytes:
    """A tier whose loads' bytes reach the caller's buffer only as `landed` reports them (and all at
    the completion), as a disk's would: the inner tier reads into a private buffer. A copy of bytes
    that have not landed yet then reads the poison the destination held."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.loads: dict[Any, tuple[Any, Any]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def submit_load(self, key: Any, dest: Any, nbytes: Any = None, group_layers: Any = None, batch: Any = None,
                    group_order: bool = True) -> Any:  # fmt: skip
        import numpy as np

        from sgl_hicache.tier import alloc_aligned

        private = np.frombuffer(alloc_aligned(max(dest.nbytes, 1)), dtype=np.uint8)[: dest.nbytes]
        ticket = self.inner.submit_load(key, private, nbytes, group_layers, batch, group_order)
        self.loads[ticket] = (private, dest)
        return ticket

    def landed(self, ticket: Any) -> int:
        n = self.inner.landed(ticket)
        if ticket in self.loads:
            private, dest = self.loads[ticket]
            dest[:n] = private[:n]
        return int(n)

    def get_finished(self) -> list[Any]:
        done = self.inner.get_finished()
        for c in done:
            if c.ticket in self.loads:
                private, dest = self.loads.pop(c.ticket)
                dest[:] = private
        return done


def _split_spilled_b_behind_a_slow_tier(make_stack: Any) -> Any:
    """B spilled as one 200-token extent, then split at 96 (a prompt sharing 96 tokens matched it),
    read at 1 s latency in 4 KiB chunks (32 tokens each); staging poisoned, so a byte copied before
    it landed is wrong KV (not the stale copy of B its block held since the spill)."""
    from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier

    s = make_stack(size=512, chunk_bytes=CHUNK)
    s.insert(B)
    s.evict_all()
    assert s.match(B[:96] + [7] * 8).host_hit_length == 96  # splits the spilled node: refs at 0 and 96
    s.cache.controller.staging._arena.fill_(0x55)
    s.cache.controller.tier = LateBytes(FaultyTier(s.cache.controller.tier, FaultSpec(latency_s=1.0)))
    return s


def test_early_unpack_of_a_split_extent_copies_only_landed_bytes(make_stack: Any) -> None:
    """Kills `unpack_landed: upto = min(ref.count, landed)` (the ref's offset ignored: bytes past
    the landed prefix are unpacked early, and never again)."""
    s = _split_spilled_b_behind_a_slow_tier(make_stack)
    m, params = admission(s)
    loaded, last = retry_until_answered(s, m, params)
    assert loaded == len(B)
    assert read_kv(s.pool, s.cache.path_device_indices(last)) == expected_kv(B)
    assert s.cache.controller.restores.stats.steps >= 1, "nothing was unpacked early"
    s.cache.check_integrity()


def test_a_partial_restore_whose_chain_was_split_meanwhile_is_replaced(make_stack: Any) -> None:
    """Kills `Restores.current` keeping a restore opened for other refs (the chain was split while
    the request was deferred): its slots leak, or its KV is handed to the wrong nodes."""
    s = spilled_behind_a_slow_tier(make_stack)
    _, params = admission(s)
    wait_for_partial(s, params)  # a partial restore of the one 200-token node
    assert s.match(B[:96] + [7] * 8).host_hit_length == 96  # another prompt splits that node
    _, params = admission(s)  # the request is matched again next round: two nodes now
    deadline = time.monotonic() + 30
    while (answer := s.cache.init_load_back(params)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    loaded, last = answer
    assert loaded == len(B), "the restore was reopened for the two nodes and completed"
    assert read_kv(s.pool, s.cache.path_device_indices(last)) == expected_kv(B)
    assert s.metrics.totals.get("internal_errors", 0) == 0
    assert s.cache.controller.restores.get(RID) is None
    s.cache.check_integrity()


class HeldCompletions:
    """A tier whose completions the caller gets only once `hold` is off (its loads land meanwhile)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.hold = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def get_finished(self) -> list[Any]:
        return [] if self.hold else self.inner.get_finished()


def test_a_restore_unpacked_whole_before_its_completion_counts_its_read_time(make_stack: Any) -> None:
    """`restore_read_seconds` counts every read a whole restore used, also those whose bytes were all
    unpacked early (here its only one: unpacked whole while the completion was still on its way)."""
    s = make_stack(size=512, chunk_bytes=CHUNK)
    s.insert(B)
    s.evict_all()
    tier = s.cache.controller.tier = HeldCompletions(s.cache.controller.tier)
    m, params = admission(s)
    t0 = time.monotonic()
    deadline = t0 + 30
    while not ((progress := s.cache.controller.restores.get(RID)) and progress.done_extents()):
        assert s.cache.init_load_back(params) is None, "admitted before its read completed"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    tier.hold = False
    loaded, last = retry_until_answered(s, m, params)
    assert loaded == len(B) and read_kv(s.pool, last.value) == expected_kv(B)
    assert 0 < s.metrics.totals["restore_read_seconds"] <= time.monotonic() - t0
    s.cache.check_integrity()
