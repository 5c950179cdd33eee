"""Hook 16 (`hooks.fit_prompt`, `server/prompt_fit.py`) against sglang 0.5.23's own prefill admission
(`PrefillAdder.add_one_req`) on a real paged pool under our cache: a prompt that is not refused at
arrival is admitted by a pool holding nothing else (its history resident or not), and one that is
refused is never admitted. sglang's own clip (the control) lets through a prompt it never admits:
such a request waited at the head of the queue forever, and every request behind it."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from sgl_hicache.server import hooks
from tests.cache.conftest import Stack

PAGE, POOL = 16, 256
LONGEST = POOL - 6  # sglang's length check refuses a prompt of max_req_input_len = POOL - 1 - 5 or more
PROMPTS = range(POOL - 3 * PAGE, LONGEST + 1)


def clip(allocator: Any, prompt: int, max_new: int, ours: bool) -> int | None:
    """`max_new_tokens` as the scheduler sets it at arrival (None: refused), through our hook or not."""
    from sglang.srt.mem_cache.allocator import BaseTokenToKVPoolAllocator

    sglangs = BaseTokenToKVPoolAllocator.max_new_tokens_for_memory
    kw = {"token_capacity": POOL, "sliding_window_size": None, "chunk_size": None}
    if ours:
        return hooks.fit_prompt(sglangs, allocator, prompt, max_new, **kw)
    return sglangs(allocator, prompt, max_new, **kw)


def admitted(stack: Stack, ids: list[int], max_new: int, chunk: int | None) -> bool:
    """Whether sglang's admission takes the request now (the scheduler's path: match, then add)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req("r", "", array("q", ids), SamplingParams(max_new_tokens=max_new, temperature=0))
    req.init_next_round_input(stack.cache)
    adder = PrefillAdder(PAGE, stack.cache, stack.allocator, None, 1.0, 16 * POOL, chunk)
    try:
        adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
        return req in adder.can_run_list
    finally:
        if req in adder.can_run_list:  # the next request finds the pool as this one did
            stack.cache.unlock(req.lock)


def prompt_ids(n: int) -> list[int]:
    return [(i * 7) % 900 + 20 for i in range(n)]


@pytest.fixture
def empty_pool(make_stack: Callable[..., Stack]) -> Iterator[Stack]:
    """Our cache on an empty pool, with the scheduler's configuration published (admission reads it)."""
    from sglang.srt.runtime_context import get_context

    with get_context().override_server_args(page_size=PAGE, device="cpu"):
        yield make_stack(size=POOL, page_size=PAGE, spill=False)


@pytest.mark.parametrize("chunk", [None, 4 * PAGE])
@pytest.mark.parametrize("history", [0, POOL // 2])
def test_a_prompt_let_through_is_admitted_and_one_refused_never_is(
    empty_pool: Stack, history: int, chunk: int | None
) -> None:
    """`history`: the prompt's first tokens resident in the tree, as the long-history benchmark's
    turn whose 16K history was resident (that prefix is locked while admission checks)."""
    if history:
        empty_pool.insert(prompt_ids(history))
    for prompt in PROMPTS:
        max_new = clip(empty_pool.allocator, prompt, 8, ours=True)
        if max_new is None:
            assert not admitted(empty_pool, prompt_ids(prompt), 0, chunk), f"{prompt} refused, yet admitted"
        else:
            assert admitted(empty_pool, prompt_ids(prompt), max_new, chunk), (
                f"{prompt} queued, never admitted"
            )
    assert clip(empty_pool.allocator, POOL - 2 * PAGE, 64, ours=True) == PAGE - 1  # sglang's clip, untouched


def test_control_sglangs_own_clip_queues_a_prompt_it_never_admits(empty_pool: Stack) -> None:
    never = [p for p in PROMPTS if clip(empty_pool.allocator, p, 8, ours=False) is not None
             and not admitted(empty_pool, prompt_ids(p), 0, None)]  # fmt: skip
    assert POOL - PAGE in never  # the benchmark's case: a prompt of pool - page tokens
