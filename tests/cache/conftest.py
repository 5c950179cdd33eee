"""A real sglang 0.5.23 RadixCache stack on CPU (pool, allocator) under our SpillRadixCache."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

LAYERS, HEADS, HEAD_DIM = 2, 2, 8


@dataclass
class Stack:
    cache: Any
    pool: Any
    allocator: Any
    tier_dir: Path
    metrics: Any
    tier: Any = None  # the controller's, kept here: `disable_spill` drops the controller, not its tier

    def insert(
        self, tokens: list[int], salt: str | None = None, ids: list[int] | None = None
    ) -> torch.Tensor:
        """Allocate slots for `tokens`, write the markers of `ids` (default: the tokens) there,
        insert into the tree."""
        from array import array

        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        slots = self.allocator.alloc(len(tokens))
        assert slots is not None, "test pool too small"
        fill_kv(self.pool, slots, tokens if ids is None else ids)
        key = RadixKey(array("q", tokens), cache_salt=salt)
        result = self.cache.insert(InsertParams(key=key, value=slots))
        dup = slots[: result.prefix_len]
        if len(dup):
            self.allocator.free(dup)
        return slots

    def match(self, tokens: list[int], salt: str | None = None) -> Any:
        from array import array

        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens), cache_salt=salt)))

    def load_back(self, match: Any, rid: str = "req-0") -> tuple[int, Any]:
        """What the scheduler does: retry admission while the cache answers None (reads in flight)."""
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

        req = SimpleNamespace(last_node=match.last_device_node, rid=rid)
        params = InitLoadBackParams(
            best_match_node=match.best_match_node, host_hit_length=match.host_hit_length, req=req
        )
        deadline = time.monotonic() + 30
        while (result := self.cache.init_load_back(params)) is None:
            assert time.monotonic() < deadline, "admission deferred for 30 s"
            time.sleep(0.005)
        return result  # type: ignore[no-any-return]

    def evict_all(self) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.cache.evict(EvictParams(num_tokens=10**9))
        if self.cache.controller is not None:
            self.cache.controller.wait_writes()


def shrink_staging(stack: Stack, nbytes: int) -> None:
    """Replace the controller's idle staging arena by one of `nbytes` (below the flag's 1 MiB floor:
    a test's histories are small), so restores must stream through it."""
    from sgl_hicache.cache.staging import StagingPool

    ctl = stack.cache.controller
    assert ctl.staging.used_bytes == 0, "staging is in use"
    ctl.staging = StagingPool(nbytes, ctl.tier.host_memory)  # made and registered as the server does
    ctl.tier.register_host_memory(ctl.staging.arena)


MARK_BITS = 14  # each bf16 element holds 14 bits of a marker: sign and top exponent bit stay 0 (finite)
MARK_MAX = 1 << (2 * MARK_BITS)  # ids are spread over two elements: lossless up to 2**28


def expected_kv(ids: list[int]) -> list[int]:
    """What `read_kv` returns for slots filled with `ids` (lossless: the ids themselves)."""
    return [int(i) for i in ids]


def marker_bits(ids: torch.Tensor, layer: int, which: int) -> torch.Tensor:
    """The raw bits of every K (which=0) / V (which=1) element of `layer` for tokens `ids`: element
    (head 0, dim 0) holds the low 14 bits of the id, (0, 1) the high 14, every other element an
    injective function of the id and its own position, so a wrong byte anywhere changes the id read."""
    mask = (1 << MARK_BITS) - 1
    pos = torch.arange(HEADS * HEAD_DIM, dtype=torch.int64, device=ids.device).view(HEADS, HEAD_DIM)
    salt = (pos * 131 + layer * 977 + which * 389)[None]
    bits = (ids[:, None, None] + salt) & mask
    bits[:, 0, 0] = ids & mask
    bits[:, 0, 1] = (ids >> MARK_BITS) & mask
    return bits.to(torch.int16)


def fill_kv(pool: Any, slots: torch.Tensor, ids: list[int]) -> None:
    """Write the lossless marker of each id (see `marker_bits`) into every element of its slot."""
    vals = torch.tensor(ids, dtype=torch.int64)
    assert all(0 <= i < MARK_MAX for i in ids), "marker ids out of range"
    for layer in range(len(pool.k_buffer)):
        for which, buf in enumerate((pool.k_buffer[layer], pool.v_buffer[layer])):
            buf.view(torch.int16)[slots] = marker_bits(vals.to(buf.device), layer, which)


def read_kv(pool: Any, slots: torch.Tensor, layers: range | None = None) -> list[int]:
    """The id whose marker each slot holds; asserts every element of every layer (of `layers`, by
    default all) agrees with it."""
    layers = range(len(pool.k_buffer)) if layers is None else layers
    k0 = pool.k_buffer[layers[0]].view(torch.int16)[slots].to(torch.int64)
    ids = k0[:, 0, 0] | (k0[:, 0, 1] << MARK_BITS)  # every layer's K holds the id there
    for layer in layers:
        for which, buf in enumerate((pool.k_buffer[layer], pool.v_buffer[layer])):
            got = buf.view(torch.int16)[slots]
            assert torch.equal(got, marker_bits(ids, layer, which)), (
                "a slot's KV elements disagree with its id"
            )
    return [int(i) for i in ids]


def build_stack(tier_dir: Path, size: int = 256, spill: bool = True, chunk_bytes: int = 4 << 20,
                page_size: int = 1, capacity_bytes: int = 1 << 30, streams: Any = None,
                device: str = "cpu", kv_events: bool = False, layers: int = LAYERS, min_free_bytes: int = 0,
                io_threads: int | None = None, **overrides: Any) -> Stack:  # fmt: skip
    """A real sglang pool and allocator under a SpillRadixCache whose tier lives in `tier_dir`
    (`streams`: the copy streams' stand-in, see fake_device.py; default the CPU's; `kv_events`:
    record sglang's KV cache events, as `--kv-events-config` does; `io_threads`: the tier's, if not
    its default)."""
    from sgl_hicache_kernels import from_sglang_pool
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from sgl_hicache.cache.build import SpillCacheBuild
    from sgl_hicache.cache.metrics import SpillMetrics
    from sgl_hicache.cache.spill_radix_cache import SpillRadixCache
    from sgl_hicache.config import SpillConfig, TierConfig
    from sgl_hicache.server.factory import open_controller
    from sgl_hicache.tier import KVDtype, KVLayout, Namespace

    pool = MHATokenToKVPool(size, page_size, torch.bfloat16, HEADS, HEAD_DIM, layers, device, False)
    if page_size == 1:
        allocator = TokenToKVPoolAllocator(size, torch.bfloat16, device, pool, need_sort=False)
    else:
        allocator = PagedTokenToKVPoolAllocator(
            size, page_size, torch.bfloat16, device, pool, need_sort=False
        )
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        enable_kv_cache_events=kv_events,
    )
    tier = TierConfig(
        directory=tier_dir,
        capacity_bytes=capacity_bytes,
        min_free_bytes=min_free_bytes,
        chunk_bytes=chunk_bytes,
    )
    if io_threads is not None:
        tier = replace(tier, io_threads=io_threads)
    config = replace(SpillConfig(tier=tier), enabled=True, min_spill_tokens=4, **overrides)
    view = from_sglang_pool(pool)
    ns = Namespace("test-model", KVLayout(layers, HEADS, HEAD_DIM, KVDtype.BF16, page_size))
    metrics = SpillMetrics()
    controller = open_controller(config, ns, view, metrics, allocator, streams=streams) if spill else None
    build = SpillCacheBuild(
        params=params, config=config, metrics=metrics, controller=controller, namespace_id=ns.id
    )
    cache = SpillRadixCache(build)
    return Stack(cache, pool, allocator, tier_dir, metrics, controller.tier if controller else None)


def close_stack(stack: Stack) -> None:
    if stack.cache.controller is not None:
        stack.cache.controller.tier.close()  # idempotent; a test's wrapper (FaultyTier) included
    if stack.tier is not None:
        stack.tier.close()


@pytest.fixture
def make_stack(tmp_path: Path) -> Iterator[Callable[..., Stack]]:
    opened: list[Stack] = []

    def make(tier_dir: Path | None = None, **kw: Any) -> Stack:
        stack = build_stack(tier_dir or tmp_path / f"tier{len(opened)}", **kw)
        opened.append(stack)
        return stack

    yield make
    for stack in opened:
        close_stack(stack)


def run_ranks(group: Any, work: Callable[[int], Any], timeout_s: float = 300) -> None:
    """`work(rank)` on two threads, one per rank; fails if a rank raised or hung (the barrier of a
    rank that raised is aborted, so the other one cannot wait for it forever)."""
    errors: list[BaseException] = []

    def target(r: int) -> None:
        try:
            work(r)
        except BaseException as e:
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    assert not errors, errors


@dataclass
class TwoRanks:
    """Two TP ranks' stacks, each driven on its own thread, whose evictions and restores agree
    through a `ThreadedAgreement` (test_tp_agreement.py: the MIN collective between the threads)."""

    stacks: list[Stack]

    def run(self, work: Callable[[int, Stack], list[Any]], timeout_s: float = 120) -> list[Any]:
        """`work(rank, its stack)` on each rank's thread, its agreement set, returning the rank's
        record (what it saw, its tree digests). Asserts the two records are equal and, once each
        rank's writes are done, each cache's integrity; returns the record."""
        from tests.cache.test_tp_agreement import ThreadedAgreement

        group = ThreadedAgreement.Group(2)
        records: list[list[Any]] = [[], []]

        def rank(r: int) -> None:
            self.stacks[r].cache.agreement = ThreadedAgreement(group, r)
            records[r] = work(r, self.stacks[r])

        run_ranks(group, rank, timeout_s)
        assert records[0] == records[1], "the ranks' trees diverged"
        for stack in self.stacks:
            stack.cache.controller.wait_writes()
            stack.cache.check_integrity()
        return records[0]


@pytest.fixture
def two_ranks(make_stack: Callable[..., Stack], tmp_path: Path) -> Callable[..., TwoRanks]:
    """`TwoRanks` of two stacks built with `config` (in tier directories rank0, rank1), closed
    with `make_stack`'s."""

    def make(**config: Any) -> TwoRanks:
        return TwoRanks([make_stack(tmp_path / f"rank{r}", **config) for r in range(2)])

    return make
