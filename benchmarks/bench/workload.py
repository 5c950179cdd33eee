"""Token-level workloads: the turns of multi-turn conversations and requests replayed from a
Mooncake-format trace. Everything is deterministic from seeds, so every system in a run gets the
same token ids."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FIRST_TOKEN_ID = 100  # keep clear of special tokens at the start of the vocabulary
SEED_MULTITURN = 1_000_003


@dataclass(frozen=True)
class Request:
    """One request to send: `key` names it in results (conversation/session and turn)."""

    key: str
    group: int  # the conversation (multi-turn) or the session's first block (trace)
    round: int  # the turn within the conversation; trace: how many leading blocks were sent before
    input_ids: tuple[int, ...]
    output_tokens: int
    resumed: bool  # its prefix was served before (a cache could reuse it)
    at_s: float = 0.0  # trace: arrival time after the replay starts
    # Of `input_ids`, the leading tokens an earlier request of its conversation sent or got back (what
    # a cache could hold when it comes; 0 for a first turn)
    prefix_tokens: int = 0
    # Trace: the key of the latest earlier request that sent the blocks this one reuses (its
    # conversation's previous turn; None for a first turn). Closed loops (multi-turn, agents) leave it
    # None: there a turn is sent only after its previous turn was answered
    follows: str | None = None


def token_ids(seed: int, n: int, vocab: int) -> list[int]:
    """`n` token ids drawn from `seed`, avoiding the first ids and the top of the vocabulary."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(FIRST_TOKEN_ID, vocab - FIRST_TOKEN_ID, size=n)]


@dataclass
class Conversation:
    """A conversation of a closed-loop multi-turn run: its history grows by each prompt and the
    answer the server gave (the real output ids, so the next turn's prefix is what a cache holds)."""

    index: int
    vocab: int
    history: list[int]
    rounds_done: int = 0

    @classmethod
    def open(cls, index: int, first_tokens: int, vocab: int) -> Conversation:
        return cls(index, vocab, token_ids(SEED_MULTITURN * (index + 1), first_tokens, vocab))

    def next_turn(self, question_tokens: int, output_tokens: int) -> Request:
        prompt = list(self.history)
        if self.rounds_done:
            seed = SEED_MULTITURN * (self.index + 1) + self.rounds_done
            prompt += token_ids(seed, question_tokens, self.vocab)
        return Request(
            key=f"c{self.index}r{self.rounds_done}",
            group=self.index,
            round=self.rounds_done,
            input_ids=tuple(prompt),
            output_tokens=output_tokens,
            resumed=self.rounds_done > 0,
            prefix_tokens=len(self.history) if self.rounds_done else 0,
        )

    def answered(self, request: Request, output_ids: list[int]) -> None:
        self.history = [*request.input_ids, *output_ids]
        self.rounds_done += 1
