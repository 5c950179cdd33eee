"""The `agents` workload: contexts that grow by real answers and tool results, think time, the order
in which agents send, the token scale, and the check that contexts leave device and host memory."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from tqdm import tqdm

from benchmarks.bench import drive, systems
from benchmarks.bench.agents import (
    AgentLoop,
    Agents,
    Cycle,
    check_leaves_memory,
    host_budget_mb,
    memory_tokens,
    pushed_out,
    send_order,
)
from benchmarks.bench.spec import SYSTEMS, Shape, SpecError
from tests.bench.standin_http import serving

VOCAB = 1024
SMALL = Agents(count=3, think_s=0.0, tool_tokens=(64, 256), max_context=1024, first_tokens=128, shared_tokens=64,
               output_tokens=16, token_scale=1.0)  # fmt: skip


def test_a_context_grows_by_each_answer_and_tool_result_up_to_the_max() -> None:
    for i in range(SMALL.count):
        plan, tools = SMALL.plan(i), SMALL.tool_sizes(i)
        assert plan[0] == 128 and len(plan) >= 2
        assert all(64 <= t <= 256 for t in tools)
        assert [b - a for a, b in itertools.pairwise(plan)] == [16 + t for t in tools[: len(plan) - 1]]
        assert plan[-1] <= 1024 < plan[-1] + 16 + tools[len(plan) - 1], "it stops before passing the max"
    assert SMALL.plan(0) != SMALL.plan(1), "each agent draws its own tool results"
    assert Agents(seed=1).plan(0) != Agents(seed=0).plan(0)


def test_the_real_answer_and_the_tool_result_become_the_next_turn() -> None:
    loop, other = AgentLoop.open(SMALL, 0, VOCAB), AgentLoop.open(SMALL, 1, VOCAB)
    first = loop.next_turn()
    assert first is not None and not first.resumed and first.prefix_tokens == 0 and first.output_tokens == 16
    assert first.input_ids[:64] == tuple(other.context[:64]), "the system prompt is shared"
    assert first.input_ids[64:] != tuple(other.context[64:]), "the task is the agent's own"
    answer = list(range(500, 516))
    loop.answered(first, answer)
    second = loop.next_turn()
    assert second is not None and second.resumed and second.round == 1 and second.key == "a0t1"
    assert second.input_ids[: 128 + 16] == (*first.input_ids, *answer)
    assert len(second.input_ids) == SMALL.plan(0)[1] and second.prefix_tokens == 128 + 16
    assert all(100 <= t < VOCAB - 100 for t in second.input_ids[144:]), (
        "the tool result: ids in the vocabulary"
    )
    lengths = [len(first.input_ids), len(second.input_ids)]
    turn = second
    while True:
        loop.answered(turn, [7] * 16)
        nxt = loop.next_turn()
        if nxt is None:
            break
        lengths.append(len(nxt.input_ids))
        turn = nxt
    assert lengths == SMALL.plan(0) and loop.done


def test_the_token_scale_shrinks_every_size() -> None:
    full, scaled = Agents(token_scale=1.0), Agents(token_scale=1 / 16)
    assert scaled.plan(0)[0] == 128 and full.plan(0)[0] == 2048
    assert all(64 <= t <= 512 for t in scaled.tool_sizes(0))
    assert max(scaled.plan(0)) <= 2048 and max(full.plan(0)) <= 32768
    assert scaled.pool_tokens(16) % 16 == 0 and scaled.pool_tokens(16) >= 1.25 * (max(scaled.plan(0)) + 16)


def test_agents_send_in_a_cycle_and_one_that_stops_leaves_it() -> None:
    c = Cycle(3)
    seen = []
    for _ in range(4):
        seen.append(c.current)
        c.sent(c.current)  # type: ignore[arg-type]
    assert seen == [0, 1, 2, 0]
    with pytest.raises(ValueError, match="out of turn"):
        c.sent(0)
    c.leave(1)  # the current one stops: the next one's turn
    assert c.current == 2
    c.sent(2)
    c.leave(2)  # one before the current stops
    assert c.current == 0 and c.order == [0]
    c.leave(0)
    assert c.current is None


def test_the_send_order_is_round_robin_and_shorter_agents_drop_out() -> None:
    order = send_order(SMALL)
    turns = [len(SMALL.plan(i)) for i in range(SMALL.count)]
    assert order[:3] == [(0, 0), (1, 0), (2, 0)] and len(order) == sum(turns)
    for a, k in order:
        if k + 1 == turns[a]:
            continue
        between = order[order.index((a, k)) + 1 : order.index((a, k + 1))]
        # every other agent that still has a turn then sends exactly one: those after a their turn k,
        # those before a their turn k + 1
        others = [b for b in range(SMALL.count) if (b > a and k < turns[b]) or (b < a and k + 1 < turns[b])]
        assert sorted(b for b, _ in between) == others


def test_contexts_are_pushed_out_when_the_others_send_more_than_memory_holds() -> None:
    even = Agents(count=3, tool_tokens=(100, 100), max_context=1000, first_tokens=100, shared_tokens=50,
                  output_tokens=10, token_scale=1.0)  # fmt: skip
    assert even.plan(0) == [100, 210, 320, 430, 540, 650, 760, 870, 980]
    # Between its turns k-1 and k (each prompt + its answer of 10): agent 0 sees agents 1 and 2 send
    # their turn k-1, pushed out from k = 4 on (2 x 430 > 660); agent 1 sees 2's turn k-1 and 0's turn
    # k, from k = 3 (330 + 440); agent 2 sees turn k of 0 and 1, from k = 3 (2 x 440).
    pushed, resumed = pushed_out(even, memory_tokens=2 * (320 + 10))
    assert (pushed, resumed) == (5 + 6 + 6, 3 * 8)
    assert pushed_out(even, memory_tokens=0) == (24, 24)
    assert pushed_out(even, memory_tokens=10**6) == (0, 24)


def test_a_shape_that_keeps_the_contexts_in_memory_is_refused(model: Path) -> None:
    spec = Agents()  # 12 agents, contexts up to 2,048 tokens
    pool = spec.pool_tokens(16)
    fit = Shape(model=str(model), pool_tokens=pool, host_budget_mb=host_budget_mb(pool, model), page_size=16)
    budget = fit.host_budget_mb * 2**20 // 23040  # SmolLM2's KV bytes per token
    assert pool <= budget < pool + 2**20 // 23040, "the host budget holds the device pool (whole MiB)"
    assert memory_tokens(["ours", "lmcache-disk", "recompute", "resident"], fit, model) == pool + budget
    assert memory_tokens(["hicache-wait-r2"], fit, model) == 2 * pool, "host pool 2 x device, one copy of it"
    assert memory_tokens(["recompute"], fit, model) == pool
    check_leaves_memory(spec, ["ours", "lmcache-disk", "hicache-wait-r2"], fit, model)
    roomy = Shape(model=str(model), pool_tokens=pool, host_budget_mb=4096, page_size=16)
    with pytest.raises(
        SpecError, match=r"agents: only \d+ of \d+ resumed turns would find their context out"
    ):
        check_leaves_memory(spec, ["ours"], roomy, model)
    check_leaves_memory(spec, ["recompute"], roomy, model)  # no host memory: the device pool alone


@pytest.mark.parametrize(
    "name, extra",
    [
        ("ours-reused", ("--hicache-spill-admission", "reused")),
        ("ours-layerwise", ("--hicache-spill-layerwise",)),
        ("ours-nohold", ("--hicache-spill-extra-config", '{"admission_hold": 0}')),
        ("ours-reserve", ("--hicache-spill-extra-config", '{"restore_reserve": true}')),
        ("ours-keepreads", ("--hicache-spill-extra-config", '{"take_back_reads": false}')),
        (
            "ours-ordered",
            ("--hicache-spill-extra-config", '{"restores_in_order": true, "restores_take_back": true}'),
        ),
        ("ours-restore-takeback", ("--hicache-spill-extra-config", '{"restores_take_back": true}')),
    ],
)
def test_ours_variants_are_ours_with_their_flag_and_its_memory(
    model: Path, tmp_path: Path, name: str, extra: tuple[str, ...]
) -> None:
    """`ours-reused` (issue 37's admission rule, chosen on `agents`) and `ours-layerwise` are ours'
    server with their flags more, named systems of the benchmark, and hold ours' memory (so a shape
    is checked against them as against ours)."""
    assert name in SYSTEMS
    shape = Shape(model=str(model), pool_tokens=1024, host_budget_mb=32, page_size=16)
    ours = systems.build("ours", shape, model, tmp_path)
    variant = systems.build(name, shape, model, tmp_path)
    assert variant.module == ours.module == "sgl_hicache.launch_server"
    own_tier = tuple(str(ours.tier_dir) if f == str(variant.tier_dir) else f for f in variant.flags)
    assert own_tier == (*ours.flags, *extra)
    assert extra[0] not in ours.flags
    assert memory_tokens([name], shape, model) == memory_tokens(["ours"], shape, model) > 1024


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"count": 1}, "--agents must be >= 2"),
        ({"think_s": -1.0}, "think time must be >= 0"),
        ({"tool_tokens": (9, 8)}, "tool tokens must be 1 <= min <= max"),
        ({"max_context": 4096}, "leaves no second turn"),
        ({"token_scale": 0.0}, "token scale > 0"),
    ],
)
def test_bad_settings_are_one_line(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        Agents(**kwargs)


def _agent_of(spec: Agents, ids: list[int]) -> tuple[int, int]:
    """(agent, turn) of a prompt the driver sent (salt 1): its opening context names the agent."""
    agent = next(
        i for i in range(spec.count) if ids[: len(o := AgentLoop.open(spec, i, VOCAB, 1).context)] == o
    )
    return agent, spec.plan(agent).index(len(ids))


async def _drive(spec: Agents, fail: tuple[int, int] | None = None) -> tuple[drive.Driven, list[list[int]]]:
    """The agents against a stand-in server whose answer to a prompt of n tokens is n % 900 + 100, ...;
    it records the prompts in arrival order, and fails the turn `fail` (agent, turn)."""
    arrived: list[list[int]] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        ids, n = body["input_ids"], body["sampling_params"]["max_new_tokens"]
        arrived.append(ids)
        if _agent_of(spec, ids) == fail:
            return web.Response(status=500, text="boom")
        resp = web.StreamResponse()
        await resp.prepare(request)
        out = [(len(ids) + j) % 900 + 100 for j in range(n)]
        meta = {"cached_tokens": 0, "finish_reason": {"type": "length"}}
        await resp.write(b"data: " + json.dumps({"output_ids": out, "meta_info": meta}).encode() + b"\n\n")
        return resp

    async with serving(handler) as url:
        driven = await drive.agents(url, spec, VOCAB, 1, lambda: None, tqdm(disable=True))
    return driven, arrived


def test_the_driver_interleaves_the_agents_and_feeds_the_real_answers_back() -> None:
    spec = Agents(count=3, think_s=0.05, tool_tokens=(64, 256), max_context=1024, first_tokens=128,
                  shared_tokens=64, output_tokens=16, token_scale=1.0)  # fmt: skip
    driven, arrived = asyncio.run(_drive(spec))
    results = {r.key: r for r in driven.results}
    assert driven.workload == "agents" and all(r.error is None for r in driven.results)
    assert [_agent_of(spec, ids) for ids in arrived] == send_order(spec), "sent in the cycle's order"
    prompts = {_agent_of(spec, ids): ids for ids in arrived}
    for i in range(spec.count):
        for k in range(1, len(spec.plan(i))):
            before, now = results[f"a{i}t{k - 1}"], results[f"a{i}t{k}"]
            n = spec.plan(i)[k - 1]
            answer = [(n + j) % 900 + 100 for j in range(16)]
            assert before.output_ids == answer and prompts[(i, k)][: n + 16] == [
                *prompts[(i, k - 1)],
                *answer,
            ]
            assert now.sent_s - before.sent_s >= spec.think_s, (
                "the tool ran between the answer and the next turn"
            )
            assert now.resumed and now.prefix_tokens == n + 16


def test_a_failed_turn_stops_its_agent_and_the_others_go_on() -> None:
    driven, _ = asyncio.run(_drive(SMALL, fail=(1, 1)))  # agent 1's second turn fails
    keys = [r.key for r in driven.results]
    assert "a1t1" in keys and "a1t2" not in keys
    assert [r.key for r in driven.results if r.error is not None] == ["a1t1"]
    for i in (0, 2):
        assert sum(k.startswith(f"a{i}t") for k in keys) == len(SMALL.plan(i)), f"agent {i} ran all its turns"
