"""Mooncake-format traces: read, synthesize, and turn into token-level requests.

A trace is JSONL, one request per line: `{"timestamp": ms, "input_length": n, "output_length": n,
"hash_ids": [...]}`, each hash id standing for one 512-token block; equal ids mean a shared prefix
(the format of Mooncake's published traces, e.g. `conversation_trace.jsonl`). The token ids of a
block are derived from its hash id, so equal ids give equal tokens. `token_scale` shrinks blocks,
inputs and outputs alike (a 512-token block becomes `round(512 * token_scale)` tokens) and
`time_scale` stretches or compresses arrival times, so a production trace fits this machine. A
replay's `salt` changes every block's token ids, so two replays of one trace on one server share no
KV. `Cut.CONVERSATIONS` keeps whole conversations of a file (`whole_conversations`) where the first
lines would keep mostly first turns.

The synthesized trace (`synthesize`) is multi-turn chat in that format: sessions that share one
system-prompt block, each turn repeating the session's earlier blocks plus new ones.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.bench.spec import Cut, SpecError, Trace
from benchmarks.bench.workload import Request, token_ids

BLOCK_TOKENS = 512
SEED_BLOCK = 7_000_003
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(frozen=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read(path: Path, limit: int) -> list[TraceRecord]:
    """The first `limit` records of a JSONL trace; a malformed line is a SpecError naming it."""
    records: list[TraceRecord] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if len(records) >= limit:
                break
            if line.strip():
                records.append(_parse(line, f"{path}:{lineno}"))
    if not records:
        raise SpecError(f"trace {path} has no records")
    return records


def _parse(line: str, where: str) -> TraceRecord:
    try:
        obj = json.loads(line)
        missing = [k for k in _FIELDS if k not in obj]
        if missing:
            raise SpecError(f"{where}: missing {', '.join(missing)}")
        record = TraceRecord(
            float(obj["timestamp"]), int(obj["input_length"]), int(obj["output_length"]),
            tuple(int(h) for h in obj["hash_ids"]),
        )  # fmt: skip
    except (ValueError, TypeError) as e:
        raise SpecError(f"{where}: not a Mooncake trace record ({e})") from None
    if record.input_length < 1 or record.output_length < 1 or not record.hash_ids:
        raise SpecError(f"{where}: input_length, output_length and hash_ids must be non-empty")
    if record.input_length > len(record.hash_ids) * BLOCK_TOKENS:
        raise SpecError(
            f"{where}: input_length {record.input_length} exceeds its {len(record.hash_ids)} blocks"
        )
    return record


def synthesize(n: int, seed: int) -> list[TraceRecord]:
    """`n` records of multi-turn sessions: block 0 is a system prompt shared by all sessions; a
    session opens with 6 blocks of its own and each later turn adds 2 (question and answer)."""
    rng = np.random.default_rng(seed)
    sessions = max(2, n // 4)
    records: list[TraceRecord] = []
    blocks = [[0, *range(1 + 6 * s, 7 + 6 * s)] for s in range(sessions)]
    next_id = 1 + 6 * sessions
    turn = 0
    while len(records) < n:
        for s in range(sessions):
            if len(records) == n:
                break
            if turn:
                blocks[s] += [next_id, next_id + 1]
                next_id += 2
            ts = s * 1500.0 + turn * 9000.0 + float(rng.uniform(0, 1000))
            ids = tuple(blocks[s])
            input_length = len(ids) * BLOCK_TOKENS - int(rng.integers(0, BLOCK_TOKENS // 2))
            records.append(TraceRecord(ts, input_length, int(rng.integers(64, 257)), ids))
        turn += 1
    return sorted(records, key=lambda r: r.timestamp_ms)


def load(spec: Trace) -> list[TraceRecord]:
    if spec.path is None:
        return synthesize(spec.requests, spec.seed)
    if spec.cut is Cut.CONVERSATIONS:
        return whole_conversations(read(spec.path, sys.maxsize), spec.requests)
    return read(spec.path, spec.requests)


def whole_conversations(records: list[TraceRecord], limit: int) -> list[TraceRecord]:
    """Of `records`, every request of whole conversations (the requests that share their first hash
    id), conversations taken in the order of their first request, each one that still fits in
    `limit` requests; in time order. SpecError if none fits."""
    conversations: dict[int, list[TraceRecord]] = {}
    for r in sorted(records, key=lambda r: r.timestamp_ms):
        conversations.setdefault(r.hash_ids[0], []).append(r)
    kept: list[TraceRecord] = []
    for turns in conversations.values():
        if len(kept) + len(turns) <= limit:
            kept += turns
    if not kept:
        raise SpecError(f"no conversation of the trace has at most {limit} requests")
    return sorted(kept, key=lambda r: r.timestamp_ms)


def _lengths(r: TraceRecord, spec: Trace) -> tuple[int, int, int]:
    """(block, input, output) tokens of `r` scaled by `spec.token_scale`."""
    block = max(1, round(BLOCK_TOKENS * spec.token_scale))
    n_in = min(max(1, round(r.input_length * spec.token_scale)), len(r.hash_ids) * block)
    return block, n_in, max(1, round(r.output_length * spec.token_scale))


def longest(records: list[TraceRecord], spec: Trace) -> int:
    """The most tokens one request of `records` holds once scaled: its prompt and its answer."""
    return max(n_in + n_out for _, n_in, n_out in (_lengths(r, spec) for r in records))


def to_requests(records: list[TraceRecord], spec: Trace, vocab: int) -> list[Request]:
    """Scaled, time-ordered requests. A request is `resumed` when at least half of its blocks are a
    prefix an earlier request already sent (its conversation comes back), not merely a shared
    system prompt; it `follows` the latest earlier request that sent that prefix (its
    conversation's previous turn), whether or not that one will have finished when it is sent."""
    t0 = min(r.timestamp_ms for r in records)
    sent_by: dict[tuple[int, ...], str] = {}  # each prefix of blocks sent: the latest request that sent it
    out = []
    for i, r in enumerate(sorted(records, key=lambda r: r.timestamp_ms)):
        block, n_in, n_out = _lengths(r, spec)
        used = r.hash_ids[: -(-n_in // block)]
        ids = [t for h in used for t in token_ids(SEED_BLOCK * (1 + spec.salt) + h, block, vocab)]
        reused = next((k for k in range(len(used), 0, -1) if used[:k] in sent_by), 0)
        follows = sent_by[used[:reused]] if reused else None
        sent_by.update((used[:k], f"t{i}") for k in range(1, len(used) + 1))
        out.append(Request(
            key=f"t{i}", group=used[0], round=reused, input_ids=tuple(ids[:n_in]),
            output_tokens=n_out,
            resumed=2 * reused >= len(used), at_s=(r.timestamp_ms - t0) / 1e3 * spec.time_scale,
            prefix_tokens=min(n_in, reused * block), follows=follows,
        ))  # fmt: skip
    return out
