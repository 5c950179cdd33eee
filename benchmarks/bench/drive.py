"""Drive one running server through one workload and collect a `Result` per request.

Multi-turn chat is closed-loop: every conversation's turn waits for its previous answer, and rounds
are separated by a barrier where the page cache is dropped with the clock stopped (nothing is in
flight then; the workload's wall time is the sum of its rounds). A trace is open-loop: requests are
sent at their (scaled) arrival times whatever the server's progress. Its page cache is dropped with
the clock stopped before the first request; during the replay some request is always in flight, so
the clock cannot stop: the drop runs every `DROP_EVERY_S` seconds in a thread, inside the timed
window, alike for every system.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import aiohttp
from tqdm import tqdm

from benchmarks.bench.agents import AgentLoop, Agents, Cycle
from benchmarks.bench.client import Result, generate, new_session
from benchmarks.bench.spec import MultiTurn
from benchmarks.bench.workload import Conversation, Request

DROP_EVERY_S = 2.0


class Dispatch(Enum):
    """How a round's turns of the multi-turn workload are sent."""

    TOGETHER = "together"  # all at once (one server: the order does not matter)
    ALTERNATE = "alternate"  # one after another, so that a round robin over two servers moves each turn
    SHUFFLED = "shuffled"  # one after another in a seeded random order (the same for every system)
    STICKY = "sticky"  # one after another in index order every round: a round robin over two servers
    # keeps each conversation on one server (for an even number), as a cache-aware router aims to


@dataclass(frozen=True)
class Driven:
    workload: str
    results: list[Result]
    wall_s: float


async def multiturn(base_url: str, spec: MultiTurn, vocab: int, salt: int, drop: Callable[[], object],
                    bar: tqdm, dispatch: Dispatch = Dispatch.TOGETHER, model: str | None = None) -> Driven:  # fmt: skip
    """Behind a router (`dispatch` ALTERNATE or SHUFFLED), each round's turns are dispatched one
    after another in `send_order` (`_in_order`). `model`: named in every request (`client.generate`)."""
    convs = [Conversation.open(salt * 10_000 + i, spec.first_tokens, vocab) for i in range(spec.concurrency)]
    results: list[Result] = []
    wall = 0.0
    async with new_session() as session:
        for k in range(spec.rounds):
            await asyncio.to_thread(drop)  # the barrier: nothing in flight, clock stopped
            turns = [c.next_turn(spec.question_tokens, spec.output_tokens) for c in convs]
            order = send_order(len(turns), k, dispatch, salt)
            t0 = time.perf_counter()
            if dispatch is not Dispatch.TOGETHER:
                sent = await _in_order(
                    session, base_url, [turns[i] for i in order], spec.name, t0, bar, model
                )
            else:
                sent = await asyncio.gather(*(_one(session, base_url, t, spec.name, t0, bar, model=model)
                                              for t in turns))  # fmt: skip
            done = [r for _, r in sorted(zip(order, sent, strict=True), key=lambda p: p[0])]
            wall += time.perf_counter() - t0
            for conv, turn, result in zip(convs, turns, done, strict=True):
                conv.answered(turn, result.output_ids or [])
            results += done
    return Driven(spec.name, results, wall)


def send_order(n: int, round_: int, dispatch: Dispatch, seed: int = 0) -> list[int]:
    """The conversations' indices in the order their turns of round `round_` are sent.
    ALTERNATE: the order in which a round robin over two servers, taking requests in this order,
    puts every turn on the other server than the conversation's previous turn: as is for odd `n`
    (each round shifts the router's parity by one), rotated by the round for even `n` (where it
    would not). SHUFFLED: a random order drawn from `seed` and the round, as clients' turns arrive
    (sent in index order every round, a round robin would keep each conversation on one server
    for even `n`). STICKY and TOGETHER: index order (STICKY: one after another)."""
    if dispatch is Dispatch.SHUFFLED:
        order = list(range(n))
        random.Random(seed * 1_000_003 + round_).shuffle(order)
        return order
    k = round_ % n if dispatch is Dispatch.ALTERNATE and n % 2 == 0 else 0
    return [*range(k, n), *range(k)]


async def _in_order(session: aiohttp.ClientSession, base_url: str, turns: list[Request], workload: str,
                    t0: float, bar: tqdm, model: str | None) -> list[Result]:  # fmt: skip
    """Each turn sent once the previous one is dispatched (its response headers arrived: the router
    has picked its server), so a router takes them in this order: sent at once, near-simultaneous
    requests reach its round robin in any order. They still run side by side; each TTFT is timed
    from its own send."""
    tasks = []
    for turn in turns:
        dispatched = asyncio.Event()
        tasks.append(asyncio.create_task(_one(session, base_url, turn, workload, t0, bar, dispatched, model)))
        await dispatched.wait()
    return list(await asyncio.gather(*tasks))


async def agents(base_url: str, spec: Agents, vocab: int, salt: int, drop: Callable[[], object],
                 bar: tqdm) -> Driven:  # fmt: skip
    """The agent loops side by side, each sending once the one before it in the `Cycle` has sent; a
    failed turn stops its agent. The loops never all pause, so the page cache is dropped only before
    the clock starts."""
    loops = [AgentLoop.open(spec, i, vocab, salt) for i in range(spec.count)]
    cycle, changed = Cycle(spec.count), asyncio.Condition()
    await asyncio.to_thread(drop)
    async with new_session() as session:
        t0 = time.perf_counter()
        done = await asyncio.gather(
            *(_agent(session, base_url, loop, cycle, changed, t0, bar) for loop in loops)
        )
        wall = time.perf_counter() - t0
    return Driven(spec.name, [r for rs in done for r in rs], wall)


async def _agent(session: aiohttp.ClientSession, base_url: str, loop: AgentLoop, cycle: Cycle,
                 changed: asyncio.Condition, t0: float, bar: tqdm) -> list[Result]:  # fmt: skip
    """One agent's turns: each waits for the agent's place in `cycle`, is sent (the cycle moves on once
    the server took it), answered, and followed by the tool's run (`think_s`)."""
    results: list[Result] = []
    try:
        while (turn := loop.next_turn()) is not None:
            async with changed:
                await changed.wait_for(lambda: cycle.current == loop.index)
            dispatched = asyncio.Event()
            sending = asyncio.create_task(_one(session, base_url, turn, loop.spec.name, t0, bar, dispatched))
            await dispatched.wait()
            async with changed:
                cycle.sent(loop.index)
                changed.notify_all()
            results.append(await sending)
            if results[-1].error is not None:
                break
            loop.answered(turn, results[-1].output_ids)
            if not loop.done:
                await asyncio.sleep(loop.spec.think_s)
    finally:
        async with changed:
            cycle.leave(loop.index)
            changed.notify_all()
    return results


async def replay(base_url: str, requests: list[Request], drop: Callable[[], object], bar: tqdm,
                 evict: Callable[[], object] | None = None, name: str = "trace") -> Driven:  # fmt: skip
    """The open-loop replay (the workload `name`): something is always in flight, so the page cache
    is dropped before the clock starts and then `evict`ed (clean pages only: nothing written on the
    clock) every `DROP_EVERY_S` inside the timed window, the same for every system. Each request is
    sent at its `at_s`, whether or not the request it follows (`Request.follows`) has finished; its
    `Result.sent_s` and `done_s` share the replay's clock, so `summary.early_sources` can tell."""
    await asyncio.to_thread(drop)  # before the clock starts
    async with new_session() as session:
        t0 = time.perf_counter()
        dropper = asyncio.create_task(_drop_every(evict or drop, DROP_EVERY_S))
        try:
            done = await asyncio.gather(*(_at(session, base_url, r, t0, bar, name) for r in requests))
        finally:
            dropper.cancel()
        wall = time.perf_counter() - t0
    return Driven(name, list(done), wall)


async def _at(
    session: aiohttp.ClientSession, base_url: str, request: Request, t0: float, bar: tqdm, workload: str
) -> Result:
    await asyncio.sleep(max(0.0, t0 + request.at_s - time.perf_counter()))
    return await _one(session, base_url, request, workload, t0, bar)


async def _one(session: aiohttp.ClientSession, base_url: str, request: Request, workload: str, t0: float,
               bar: tqdm, dispatched: asyncio.Event | None = None, model: str | None = None) -> Result:  # fmt: skip
    result = await generate(session, base_url, request, workload, t0, dispatched, model)
    bar.update(1)
    return result


async def _drop_every(drop: Callable[[], object], every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        await asyncio.to_thread(drop)
