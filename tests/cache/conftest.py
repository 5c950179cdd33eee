"""A real sglang 0.5.23 RadixCache stack on CPU (pool, allocator) under our SpillRadixCache."""

from __future__ import annotations

import os
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

    def insert(self, tokens: list[int], salt: str | None = None) -> torch.Tensor:
        """Allocate slots for `tokens`, write recognizable KV there, insert into the tree."""
        from array import array

        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        slots = self.allocator.alloc(len(tokens))
        assert slots is not None, "test pool too small"
        fill_kv(self.pool, slots, tokens)
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
        if self.cache.spill_io is not None:
            self.cache.spill_io.wait_writes()


def expected_kv(tokens: list[int]) -> list[float]:
    """What `read_kv` returns for slots filled with `tokens` (values pass through bf16)."""
    return (torch.tensor(tokens, dtype=torch.float32) * 10).to(torch.bfloat16).float().tolist()


def fill_kv(pool: Any, slots: torch.Tensor, tokens: list[int]) -> None:
    vals = torch.tensor(tokens, dtype=torch.float32)
    for layer in range(LAYERS):
        for which, buf in enumerate((pool.k_buffer[layer], pool.v_buffer[layer])):
            buf[slots] = (
                (vals * 10 + layer * 3 + which).to(buf.dtype)[:, None, None].expand(-1, HEADS, HEAD_DIM)
            )


def read_kv(pool: Any, slots: torch.Tensor) -> list[float]:
    """The per-token KV value stored at `slots` (layer 0, K), checked consistent across all layers."""
    out = []
    for layer in range(LAYERS):
        for which, buf in enumerate((pool.k_buffer[layer], pool.v_buffer[layer])):
            got = buf[slots].float()
            assert torch.equal(got, got[:, :1, :1].expand_as(got)), "a token's KV rows differ within a slot"
            if layer == 0 and which == 0:
                out = got[:, 0, 0].tolist()
    return out


@pytest.fixture
def make_stack(tmp_path: Path) -> Iterator[Callable[..., Stack]]:
    from sgl_hicache.kernels import from_sglang_pool
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from sgl_hicache.cache.factory import open_spill_io
    from sgl_hicache.cache.spill_radix_cache import SpillRadixCache
    from sgl_hicache.config import SpillConfig, TierConfig
    from sgl_hicache.server.metrics import SpillMetrics
    from sgl_hicache.tier import KVDtype, KVLayout, Namespace

    opened: list[Stack] = []

    def make(size: int = 256, spill: bool = True, tier_dir: Path | None = None, chunk_bytes: int = 4 << 20,
             **overrides: Any) -> Stack:  # fmt: skip
        pool = MHATokenToKVPool(size, 1, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu", False)
        allocator = TokenToKVPoolAllocator(size, torch.bfloat16, "cpu", pool, need_sort=False)
        params = CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator, page_size=1
        )
        tier_dir = tier_dir or tmp_path / f"tier{len(opened)}"
        tier = TierConfig(
            directory=tier_dir, capacity_bytes=1 << 30, min_free_bytes=0, chunk_bytes=chunk_bytes
        )
        config = replace(SpillConfig(tier=tier), enabled=True, min_spill_tokens=4, **overrides)
        view = from_sglang_pool(pool)
        ns = Namespace("test-model", KVLayout(LAYERS, HEADS, HEAD_DIM, KVDtype.BF16, 1))
        metrics = SpillMetrics()
        io = open_spill_io(config, ns, view, metrics) if spill else None
        stack = Stack(SpillRadixCache(params, config, metrics, io, ns.id), pool, allocator, tier_dir, metrics)
        opened.append(stack)
        return stack

    yield make
    for stack in opened:
        if stack.cache.spill_io is not None:
            stack.cache.spill_io.tier.close()  # idempotent
