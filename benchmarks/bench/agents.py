"""The `agents` workload: agent loops whose contexts grow by tool results until they are long.

An agent's turn sends its whole context so far (a system prompt every agent shares, its task, then
each earlier tool call and tool result); the server answers with a tool call (`output_tokens`,
greedy: the real output ids join the context, as the model gave them), the tool runs for `think_s`
seconds, and its result (`tool_tokens`, a size drawn per turn from the agent's seed) joins the
context too. An agent stops before a turn whose context would pass `max_context`. Sizes are nominal
(1-8K-token tool results up to 32K-token contexts, as agents see on a GPU) and multiplied by
`token_scale`, so that this CPU can prefill them; the run says the scale in its final line.

Agents send their turns in a fixed cycle (`Cycle`): agent 0, 1, ..., N-1, then 0 again, each once the
one before it has sent (an agent that stops leaves the cycle), so between two turns of one agent
every other agent sends one (`send_order`). The device pool holds one long context (`pool_tokens`)
and host memory as much again (`host_budget_mb`), so N agents' contexts do not fit:
`check_leaves_memory` refuses a shape in which the other agents' turns would not push most resumed
turns' contexts out of device and host memory before they come back (`pushed_out`), and the run
reports where each resumed turn found its prefix (`summary.resumed_sources`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.bench.spec import HICACHE, LMCACHE, OURS_FLAGS, Shape, SpecError
from benchmarks.bench.systems import host_tokens, kv_bytes_per_token
from benchmarks.bench.workload import Request, token_ids

SEED_AGENTS = 3_000_017


@dataclass(frozen=True)
class Agents:
    """N agent loops; token counts nominal (before `token_scale`)."""

    count: int = 12
    think_s: float = 2.0  # a tool's run between an answer and the agent's next turn
    tool_tokens: tuple[int, int] = (1024, 8192)  # a tool result's size: uniform in [min, max]
    max_context: int = 32768
    first_tokens: int = 2048  # the first turn: the shared system prompt + the agent's task
    shared_tokens: int = 1024  # of those, the system prompt every agent shares
    output_tokens: int = 256  # a turn's answer (a tool call)
    token_scale: float = 1 / 16
    seed: int = 0

    def __post_init__(self) -> None:
        low, high = self.tool_tokens
        if self.count < 2:
            raise SpecError(f"agents: --agents must be >= 2 (the others push an agent's context out), "
                            f"got {self.count}")  # fmt: skip
        if not (self.think_s >= 0 and self.token_scale > 0):
            raise SpecError("agents: think time must be >= 0 and the token scale > 0")
        if not 1 <= low <= high:
            raise SpecError(f"agents: tool tokens must be 1 <= min <= max, got {low},{high}")
        if not 1 <= self.shared_tokens < self.first_tokens or self.output_tokens < 1:
            raise SpecError(
                "agents: the shared prompt must be shorter than the first turn, an answer >= 1 token"
            )
        if self.first_tokens + self.output_tokens + high > self.max_context:
            raise SpecError(
                f"agents: --max-context {self.max_context} leaves no second turn after a first of "
                f"{self.first_tokens} tokens, an answer of {self.output_tokens} and a tool result of {high}"
            )

    @property
    def name(self) -> str:
        return "agents"

    def scaled(self, n: int) -> int:
        return max(1, round(n * self.token_scale))

    def tool_sizes(self, index: int) -> list[int]:
        """Agent `index`'s tool results, scaled, as many as it could need."""
        low, high = self.scaled(self.tool_tokens[0]), self.scaled(self.tool_tokens[1])
        most = self.scaled(self.max_context) // (low + self.scaled(self.output_tokens)) + 1
        rng = np.random.default_rng([self.seed, index])
        return [int(n) for n in rng.integers(low, high + 1, size=most)]

    def plan(self, index: int) -> list[int]:
        """The prompt lengths of agent `index`'s turns, in order (every answer `output_tokens` long)."""
        lengths, n = [], self.scaled(self.first_tokens)
        for tool in self.tool_sizes(index):
            lengths.append(n)
            n += self.scaled(self.output_tokens) + tool
            if n > self.scaled(self.max_context):
                break
        return lengths

    def pool_tokens(self, page_size: int) -> int:
        """A device pool that holds one agent's longest turn and its answer, with room to spare (x1.25)."""
        longest = max(max(self.plan(i)) for i in range(self.count)) + self.scaled(self.output_tokens)
        return math.ceil(1.25 * longest / page_size) * page_size

    def total_tokens(self) -> int:
        """Every prompt token and answer of the workload, counted once: the agents' final contexts."""
        return sum(self.plan(i)[-1] + self.scaled(self.output_tokens) for i in range(self.count))


def host_budget_mb(pool_tokens: int, model: Path) -> int:
    """A host budget that holds as much KV as the device pool (MiB, rounded up)."""
    return max(1, math.ceil(pool_tokens * kv_bytes_per_token(model) / 2**20))


@dataclass
class AgentLoop:
    """One agent of a run: its context grows by each answer (the real output ids) and tool result."""

    spec: Agents
    index: int
    vocab: int
    salt: int = 0
    context: list[int] = field(default_factory=list)
    turn: int = 0
    done: bool = False
    prefix: int = 0  # of the next turn: what the previous turn sent and got back

    @classmethod
    def open(cls, spec: Agents, index: int, vocab: int, salt: int = 0) -> AgentLoop:
        shared = token_ids(_seed(salt, -1, 0), spec.scaled(spec.shared_tokens), vocab)
        task = token_ids(_seed(salt, index, 0), spec.scaled(spec.first_tokens) - len(shared), vocab)
        return cls(spec, index, vocab, salt, shared + task)

    def next_turn(self) -> Request | None:
        """The next turn to send, or None once the agent has stopped."""
        if self.done:
            return None
        return Request(key=f"a{self.index}t{self.turn}", group=self.index, round=self.turn,
                       input_ids=tuple(self.context), output_tokens=self.spec.scaled(self.spec.output_tokens),
                       resumed=self.turn > 0, prefix_tokens=self.prefix)  # fmt: skip

    def answered(self, request: Request, output_ids: list[int]) -> None:
        """The turn's answer came: the tool's result joins the context, or the agent stops there."""
        tool = self.spec.tool_sizes(self.index)[self.turn]
        self.prefix = len(request.input_ids) + len(output_ids)
        self.context = [*request.input_ids, *output_ids, *token_ids(_seed(self.salt, self.index, self.turn + 1),
                                                                    tool, self.vocab)]  # fmt: skip
        self.turn += 1
        self.done = len(self.context) > self.spec.scaled(self.spec.max_context)


def _seed(salt: int, index: int, turn: int) -> int:
    return ((SEED_AGENTS + salt) * 100_000 + index + 1) * 10_000 + turn


class Cycle:
    """The order in which agents send: 0, 1, ..., N-1, 0, ...; an agent that stops leaves it."""

    def __init__(self, count: int) -> None:
        self.order = list(range(count))
        self.at = 0

    @property
    def current(self) -> int | None:
        """The agent whose turn it is to send (None once every agent has left)."""
        return self.order[self.at] if self.order else None

    def sent(self, agent: int) -> None:
        """`agent` (the current one) has sent its turn: the next agent's turn."""
        if agent != self.current:
            raise ValueError(f"agent {agent} sent out of turn (the turn is {self.current}'s)")
        self.at = (self.at + 1) % len(self.order)

    def leave(self, agent: int) -> None:
        k = self.order.index(agent)
        del self.order[k]
        if k < self.at:
            self.at -= 1
        if self.at >= len(self.order):
            self.at = 0


def send_order(spec: Agents) -> list[tuple[int, int]]:
    """(agent, turn) in the order the cycle sends them, every turn as planned (`Agents.plan`)."""
    turns = [len(spec.plan(i)) for i in range(spec.count)]
    return [(i, k) for k in range(max(turns)) for i in range(spec.count) if k < turns[i]]


def pushed_out(spec: Agents, memory_tokens: int) -> tuple[int, int]:
    """(resumed turns whose agent's previous turn was followed by more than `memory_tokens` tokens of
    other agents' prompts and answers before it, resumed turns): how many contexts the interleaving
    pushes out of a device pool and host memory of `memory_tokens` in all (LRU) before they return."""
    plans = [spec.plan(i) for i in range(spec.count)]
    out = spec.scaled(spec.output_tokens)
    since: dict[int, int] = {}  # agent -> tokens others sent since its last turn
    pushed = resumed = 0
    for agent, turn in send_order(spec):
        if turn > 0:
            resumed += 1
            pushed += since[agent] > memory_tokens
        for other in since:
            since[other] += plans[agent][turn] + out
        since[agent] = 0
    return pushed, resumed


def memory_tokens(names: Iterable[str], shape: Shape, model: Path) -> int:
    """The most KV any of the systems `names` keeps in device and host memory, tokens: its device pool
    and ours' staging, LMCache's L1 (the host budget) or HiCache's host pool beside its copies of the
    device pool; `resident` (which holds everything by design) left out."""
    budget = shape.host_budget_mb * 2**20 // kv_bytes_per_token(model)
    host = [0]
    for name in names:
        if name in HICACHE:
            c = HICACHE[name]
            host.append(c.cache_tokens(host_tokens(c.host, c.default_ratio, shape, model), shape.pool_tokens))
        elif name in OURS_FLAGS or name in LMCACHE:
            host.append(budget)
    return shape.pool_tokens + max(host)


def check_leaves_memory(spec: Agents, names: Iterable[str], shape: Shape, model: Path) -> None:
    """SpecError, in one line, if fewer than half of the resumed turns would find their context pushed
    out of device and host memory by the other agents' turns (`pushed_out`) in some system of `names`."""
    memory = memory_tokens(names, shape, model)
    pushed, resumed = pushed_out(spec, memory)
    if 2 * pushed < resumed:
        raise SpecError(
            f"agents: only {pushed} of {resumed} resumed turns would find their context out of device and host "
            f"memory ({memory} tokens): raise --agents, or lower --pool-tokens or --host-budget-mb"
        )
