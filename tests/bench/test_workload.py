"""Workloads: deterministic token ids, multi-turn prompts that grow by the real answer, and
Mooncake-format traces (read, scaled, synthesized, rejected when malformed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.bench import trace
from benchmarks.bench.spec import SpecError, Trace
from benchmarks.bench.workload import FIRST_TOKEN_ID, Conversation, token_ids

VOCAB = 1024


def test_token_ids_are_deterministic_and_in_range() -> None:
    a, b, c = token_ids(7, 500, VOCAB), token_ids(7, 500, VOCAB), token_ids(8, 500, VOCAB)
    assert a == b and a != c
    assert min(a) >= FIRST_TOKEN_ID and max(a) < VOCAB - FIRST_TOKEN_ID


def test_conversation_turns_extend_the_previous_prompt_and_answer() -> None:
    conv = Conversation.open(3, first_tokens=50, vocab=VOCAB)
    first = conv.next_turn(question_tokens=10, output_tokens=4)
    assert len(first.input_ids) == 50 and first.round == 0 and not first.resumed
    conv.answered(first, [901, 902, 903, 904])
    second = conv.next_turn(question_tokens=10, output_tokens=4)
    assert second.input_ids[:54] == (*first.input_ids, 901, 902, 903, 904)
    assert len(second.input_ids) == 64 and second.round == 1 and second.resumed
    other = Conversation.open(4, first_tokens=50, vocab=VOCAB).next_turn(10, 4)
    assert other.input_ids != first.input_ids


def _write(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_trace_blocks_map_hash_ids_to_shared_tokens(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", [
        {"timestamp": 1000, "input_length": 1000, "output_length": 40, "hash_ids": [5, 6]},
        {"timestamp": 3000, "input_length": 1500, "output_length": 80, "hash_ids": [5, 6, 9]},
        {"timestamp": 2000, "input_length": 512, "output_length": 8, "hash_ids": [7]},
    ])  # fmt: skip
    spec = Trace(path=path, token_scale=0.25, time_scale=0.5)
    reqs = trace.to_requests(trace.load(spec), spec, VOCAB)
    assert [r.key for r in reqs] == ["t0", "t1", "t2"]
    assert [r.at_s for r in reqs] == [0.0, 0.5, 1.0]  # ordered by time, scaled
    first, other, resumed = reqs
    assert len(first.input_ids) == 250 and first.output_tokens == 10
    assert len(resumed.input_ids) == 375 and resumed.output_tokens == 20
    assert resumed.input_ids[:250] == first.input_ids  # equal hash ids, equal tokens
    assert resumed.resumed and resumed.round == 2 and not first.resumed and not other.resumed
    assert other.input_ids[:50] != first.input_ids[:50]


def test_a_shared_system_prompt_alone_is_not_a_resume() -> None:
    recs = [trace.TraceRecord(0, 2048, 10, (0, 1, 2, 3)), trace.TraceRecord(1, 2048, 10, (0, 4, 5, 6))]
    reqs = trace.to_requests(recs, Trace(), VOCAB)
    assert reqs[1].round == 1 and not reqs[1].resumed


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"timestamp": 1, "input_length": 10, "output_length": 1}', "missing hash_ids"),
        (
            '{"timestamp": 1, "input_length": 600, "output_length": 1, "hash_ids": [1]}',
            "exceeds its 1 blocks",
        ),
        (
            '{"timestamp": "x", "input_length": 1, "output_length": 1, "hash_ids": [1]}',
            "not a Mooncake trace record",
        ),
        ("not json", "not a Mooncake trace record"),
        ('{"timestamp": 1, "input_length": 1, "output_length": 0, "hash_ids": [1]}', "must be non-empty"),
    ],
)
def test_malformed_trace_lines_are_named(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n' + line + "\n"
    )
    with pytest.raises(SpecError, match=rf"bad.jsonl:2: .*{message}"):
        trace.read(path, limit=10)


def test_synthesized_trace_is_multi_turn_chat() -> None:
    recs = trace.synthesize(24, seed=1)
    assert len(recs) == 24 and recs == trace.synthesize(24, seed=1)
    assert [r.timestamp_ms for r in recs] == sorted(r.timestamp_ms for r in recs)
    assert all(r.hash_ids[0] == 0 for r in recs)  # the shared system prompt
    assert all(r.input_length <= len(r.hash_ids) * trace.BLOCK_TOKENS for r in recs)
    reqs = trace.to_requests(recs, Trace(requests=24), VOCAB)
    resumed = [r for r in reqs if r.resumed]
    assert 0 < len(resumed) < len(reqs)  # later turns of each session resume
    assert all(not r.resumed for r in reqs[:2])
