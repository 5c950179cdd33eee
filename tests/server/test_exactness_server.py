"""Server differential test (issue 11): a spilling server gives exactly the never-evicting server's
greedy outputs.

A seeded workload of branching multi-turn conversations (token ids; each turn's real output is fed
back into the next prompt) is served, one request at a time and in the same order, by
- the reference: plain `sglang.launch_server` whose KV pool holds every token of the workload
  (it never evicts), built once, at page size 1; and
- our server (`--enable-hicache-spill`, a 1,024-token pool) at page size 1 and at page size 16.
Every request's output ids must be identical, but for a flip at a measured near-tie where ours
recomputed more than the reference (`tests/server/greedy.py`, which also holds ours to reuse the
reference's hit but for a dropped short leaf); the reference records its top-2 logprobs per output
token for that. The branching is chosen for the cache's hard paths:
forks cut inside earlier turns (a spilled node is split, restored in parts, re-spilled, restored
again), siblings sharing a system prefix, revisits of conversations pushed out of the pool long ago,
and prefixes of every length (page-misaligned).

Sensitivity: the same workload served by our server over a tier that silently flips the bytes of
every load (`FaultSpec.silent_corrupt_rate`) must give at least one different output, so a match
above means something.

The reference at page size 1 stands for both page sizes; `test_reference_ignores_page_size`
checks that assumption (a never-evicting page-16 plain server gives the same outputs).
"""

from __future__ import annotations

import json
import random
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench.server_process import CPU_FLAGS, ServerProcess
from sgl_hicache.config import SpillConfig
from tests.server.conftest import SPILL_FLAGS, metrics, post_json
from tests.server.greedy import TOP2, Answer, Served, common_prefix, transcript_mismatches

pytestmark = pytest.mark.server

REQUESTS = {1: 80, 16: 48}  # requests served per page size (the page-16 run serves the first 48)
POOL = 1024  # our server's device KV pool, tokens
REFERENCE_POOL = 65536  # holds every token of the workload (asserted), so the reference never evicts
SEED = 11
MAX_NEW = 8
MAX_HISTORY = 560  # a conversation longer than this is not continued (it must fit the pool)
SYSTEMS = (45, 77, 29)  # shared system prefixes, lengths that are not page multiples
DROPPED = SpillConfig().min_spill_tokens - 1  # a childless leaf shorter than the minimum is dropped


@dataclass
class Conversation:
    history: list[int]  # every prompt and output token so far
    system: int  # tokens of its system prefix
    touched: int = 0  # index of the last request that extended it


@dataclass(frozen=True)
class Sent:
    kind: str  # new | next | fork | revisit
    input_ids: list[int]
    reference: Answer  # the reference's answer: output, cached tokens, top-2 logprobs where asked

    @property
    def output_ids(self) -> list[int]:
        return list(self.reference.output_ids)


Send = Callable[[list[int]], Answer]


class Workload:
    """Branching conversations drawn from `random.Random(seed)`, built against a live server: the
    prompts depend on the outputs, so the workload is the reference's transcript (`sent`)."""

    def __init__(self, seed: int, send: Send) -> None:
        self.rng, self.send = random.Random(seed), send
        self.systems = [self.words(n) for n in SYSTEMS]
        self.convs: list[Conversation] = []
        self.sent: list[Sent] = []

    def words(self, n: int) -> list[int]:
        return [self.rng.randrange(20, 1000) for _ in range(n)]

    def serve(self, kind: str, conv: Conversation, prompt: list[int]) -> None:
        answer = self.send(prompt)
        conv.history, conv.touched = prompt + list(answer.output_ids), len(self.sent)
        self.sent.append(Sent(kind, prompt, answer))

    def new(self) -> None:
        k = self.rng.randrange(len(self.systems))
        conv = Conversation([], len(self.systems[k]))
        self.convs.append(conv)
        self.serve("new", conv, self.systems[k] + self.words(self.rng.randrange(30, 120)))

    def next(self, conv: Conversation, kind: str = "next") -> None:
        self.serve(kind, conv, conv.history + self.words(self.rng.randrange(10, 60)))

    def fork(self, parent: Conversation) -> None:
        """A sibling that diverges inside `parent`'s history (inside an earlier turn)."""
        cut = self.rng.randrange(parent.system + 1, len(parent.history))
        conv = Conversation([], parent.system)
        self.convs.append(conv)
        self.serve("fork", conv, parent.history[:cut] + self.words(self.rng.randrange(10, 60)))

    def step(self) -> None:
        live = [c for c in self.convs if len(c.history) < MAX_HISTORY]
        kind = (
            "new" if len(live) < 3 else self.rng.choices(["new", "next", "fork", "revisit"], [1, 4, 3, 2])[0]
        )
        if kind == "new":
            self.new()
        elif kind == "fork":
            self.fork(self.rng.choice(self.convs))
        elif kind == "next":
            self.next(self.rng.choice(live[-4:]))  # the recent ones: the pool fills, older ones spill
        else:
            self.next(min(live, key=lambda c: c.touched), "revisit")

    def run(self, n: int) -> list[Sent]:
        while len(self.sent) < n:
            self.step()
        return self.sent


def generate(base: str, ids: list[int], max_new: int = MAX_NEW, top2: bool = False) -> dict[str, Any]:
    """Greedy; with `top2`, also the two likeliest tokens' logprobs per output token (`TOP2`)."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}}
    return post_json(base + "/generate", body | (TOP2 if top2 else {}))


def counter(base: str, name: str) -> float:
    return metrics(base).get(f'sglang:hicache_spill_{name}_total{{tp_rank="0"}}', 0.0)


def replay(base: str, sent: list[Sent], stop_at_first_difference: bool = False) -> list[dict[str, Any]]:
    """Serve the reference's requests in order; returns each response (a mismatch does not cascade:
    the prompts are the reference's). A stop comes at the first difference `differences` names."""
    replies: list[dict[str, Any]] = []
    for s in sent:
        replies.append(generate(base, s.input_ids))
        changed = replies[-1]["output_ids"] != s.output_ids
        if stop_at_first_difference and changed and differences(sent[: len(replies)], replies):
            break
    return replies


def spill_server(model: Path, tmp: Path, page: int, env: dict[str, str] | None = None,
                 extra: tuple[str, ...] = ()) -> ServerProcess:  # fmt: skip
    args = (*SPILL_FLAGS, "--page-size", str(page), "--enable-hicache-spill",
            "--hicache-spill-dir", str(tmp / "tier"), "--hicache-spill-min-free", "0", *extra)  # fmt: skip
    return ServerProcess(model, POOL, args, log_path=tmp / "server.log", env=env or {})


def plain_reference(model: Path, tmp: Path, page: int) -> ServerProcess:
    args = (*CPU_FLAGS, "--page-size", str(page))
    return ServerProcess(
        model, REFERENCE_POOL, args, module="sglang.launch_server", log_path=tmp / "server.log"
    )


def make_transcript(model: Path, tmp: Path) -> list[Sent]:
    """The workload as the never-evicting plain sglang server (page size 1) served it (made once
    per session: conftest.py's `exactness_transcript`; test_mooncake_server.py replays it too)."""
    with plain_reference(model, tmp, 1) as ref:
        sent = Workload(SEED, lambda ids: Answer.of(generate(ref.base_url, ids, top2=True))).run(
            max(REQUESTS.values())
        )
    assert sum(len(s.input_ids) + MAX_NEW for s in sent) < REFERENCE_POOL, "the reference could evict"
    return sent


@pytest.fixture
def transcript(exactness_transcript: list[Sent]) -> list[Sent]:
    return exactness_transcript


def differences(
    sent: list[Sent], replies: list[dict[str, Any]], page: int | None = None, lost_from: int | None = None
) -> list[str]:
    """The replies not acceptable next to the reference's (`greedy.transcript_mismatches`). With
    `page` (ours spills at that page size, onto a tier that keeps everything), ours must reuse the
    reference's hit, whole pages, but for a dropped leaf; from request `lost_from` on, the tier may
    have lost what it held and ours need not."""
    served = [Served(f"#{i} {s.kind} ({len(s.input_ids)} tokens)", s.input_ids, s.reference, Answer.of(r),
                     covers=lost_from is None or i < lost_from)
              for i, (s, r) in enumerate(zip(sent, replies, strict=False))]  # fmt: skip
    return transcript_mismatches(served, page, DROPPED // page * page if page else 0)


@pytest.mark.slow  # a control: the reference's own independence of the page size
def test_reference_ignores_page_size(transcript: list[Sent], tiny_model: Path, tmp_path: Path) -> None:
    """The page-1 reference stands for the page-16 one: a never-evicting server's greedy outputs do
    not depend on its page size (but at a near-tie where page 16 recomputed a partial page)."""
    sent = transcript[: REQUESTS[16]]
    with plain_reference(tiny_model, tmp_path, 16) as ref:
        replies = replay(ref.base_url, sent)
    assert not differences(sent, replies), "\n".join(differences(sent, replies))


# page 1 is a repeat of page 16 on the same transcript (the model-based test covers page 1 in depth)
@pytest.mark.parametrize("page", [pytest.param(1, marks=pytest.mark.slow), 16])
def test_spilling_server_matches_the_never_evicting_reference(
    page: int, transcript: list[Sent], tiny_model: Path, tmp_path: Path
) -> None:
    sent = transcript[: REQUESTS[page]]
    with spill_server(tiny_model, tmp_path, page) as ours:
        replies = replay(ours.base_url, sent)
        counters = {n: counter(ours.base_url, n) for n in ("spilled_tokens", "restored_tokens",
                                                          "mismatch_extents", "corrupt_extents",
                                                          "written_ahead_tokens")}  # fmt: skip
    failures = differences(sent, replies, page)
    assert not failures, "\n".join(failures)
    assert counters["spilled_tokens"] > 0 and counters["restored_tokens"] > 0, counters
    assert counters["written_ahead_tokens"] > 0, "clean-ahead (the default) was not exercised"
    assert counters["mismatch_extents"] == 0 and counters["corrupt_extents"] == 0, counters
    from_tier = {s.kind for s, r in zip(sent, replies, strict=True) if restored(r)}
    assert {"fork", "revisit"} <= from_tier, f"only {from_tier} requests were served from the tier"
    assert restored_again(sent, replies), "no tokens were restored, spilled again and restored again"


def restored_range(reply: dict[str, Any]) -> tuple[int, int]:
    """The positions of the prompt that the tier served: [device hit, device hit + storage hit)."""
    details = reply["meta_info"].get("cached_tokens_details") or {}
    device = int(details.get("device", 0))
    return device, device + int(details.get("storage", 0))


def restored(reply: dict[str, Any]) -> int:
    lo, hi = restored_range(reply)
    return hi - lo


def restored_again(sent: list[Sent], replies: list[dict[str, Any]]) -> int:
    """Pairs of requests whose restored ranges share tokens of one path: that KV was restored,
    spilled again (or kept its clean extent) and restored a second time."""
    ranges = [(s.input_ids, *restored_range(r)) for s, r in zip(sent, replies, strict=True)]
    pairs = 0
    for i, (ids_i, lo_i, hi_i) in enumerate(ranges):
        for ids_j, lo_j, hi_j in ranges[i + 1 :]:
            pairs += max(lo_i, lo_j) < min(hi_i, hi_j, common_prefix(ids_i, ids_j))
    return pairs


LAYERWISE_REQUESTS = 32  # enough for forks and revisits served from the tier, at CI's cost
LAYERWISE_COUNTERS = ("restored_tokens", "internal_errors", "layerwise_restores", "layerwise_overlapped_restores",
                      "layerwise_failed_restores", "layerwise_retracted_requests")  # fmt: skip


def layerwise_run(model: Path, tmp: Path, sent: list[Sent], faults: dict[str, Any],
                  extra: tuple[str, ...] = ()) -> tuple[list[Any], dict[str, float]]:  # fmt: skip
    env = {"SGL_HICACHE_TEST_FAULTS": json.dumps(faults)}
    with spill_server(model, tmp, 16, env, ("--hicache-spill-layerwise", *extra)) as ours:
        replies = replay(ours.base_url, sent)
        counters = {n: counter(ours.base_url, n) for n in LAYERWISE_COUNTERS}
        with urllib.request.urlopen(ours.base_url + "/server_info", timeout=60) as r:
            state = json.loads(r.read())["internal_states"][0]["hicache_spill"]
    assert state["hook_errors"] == {} and counters["internal_errors"] == 0, (state["hook_errors"], counters)
    return replies, counters


def test_layerwise_restore_matches_the_never_evicting_reference(
    transcript: list[Sent], tiny_model: Path, tmp_path: Path
) -> None:
    """Issue 37: with layer-wise restore over a slow tier (every read paced over 0.4 s, as a slow
    disk lands its chunks), resumed prefills start once the first layer group of their restore
    landed, while later groups are still read (`layerwise_overlapped_restores`), and every answer
    is the never-evicting reference's."""
    sent = transcript[:LAYERWISE_REQUESTS]
    replies, counters = layerwise_run(tiny_model, tmp_path, sent, {"latency_s": 0.4})
    failures = differences(sent, replies, 16)
    assert not failures, "\n".join(failures)
    assert counters["layerwise_overlapped_restores"] > 0, counters
    assert counters["layerwise_failed_restores"] == 0, counters


@pytest.mark.slow  # the fault path of the test above on a real server (the model-based test covers it in CI)
@pytest.mark.parametrize("chunked", [(), ("--chunked-prefill-size", "32")], ids=["whole", "chunked"])
def test_layerwise_restores_failing_late_are_retracted_and_recomputed(
    transcript: list[Sent], tiny_model: Path, tmp_path: Path, chunked: tuple[str, ...]
) -> None:
    """Issue 37: half of the loads fail after their first layer group landed (a late corrupt
    chunk), often after the prefill started: those requests are retracted and recomputed, and
    every answer is still the reference's (hits may be lost: `lost_from=0`). Also with chunked
    prefill (32 tokens a chunk): a retracted request may be the one whose first chunk ran."""
    sent = transcript[: REQUESTS[16]]
    faults = {"latency_s": 0.6, "late_fault_rate": 0.5, "late_fault_share": 0.5}
    replies, counters = layerwise_run(tiny_model, tmp_path, sent, faults, chunked)
    failures = differences(sent, replies, 16, lost_from=0)
    assert not failures, "\n".join(failures)
    assert counters["layerwise_retracted_requests"] > 0, counters


@pytest.mark.slow  # the control of the test above: it can fail (run by make test-slow)
def test_wrong_kv_from_the_tier_changes_outputs(
    transcript: list[Sent], tiny_model: Path, tmp_path: Path
) -> None:
    """Sensitivity: with a tier serving flipped bytes the differential test must fail."""
    faults = {"SGL_HICACHE_TEST_FAULTS": json.dumps({"silent_corrupt_rate": 1.0})}
    sent = transcript[: REQUESTS[1]]
    with spill_server(tiny_model, tmp_path, 1, faults) as ours:
        replies = replay(ours.base_url, sent, stop_at_first_difference=True)
        restored = counter(ours.base_url, "restored_tokens")
    assert restored > 0
    assert differences(sent, replies), "wrong KV restored from the tier went unnoticed"
