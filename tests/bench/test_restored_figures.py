"""Where resumed turns found their prefix, tokens restored against recomputed, and disk bytes
written per byte restored (`summary.summarize`, folded over repeats by `aggregate`)."""

from __future__ import annotations

import math

import pytest

from benchmarks.bench import trace
from benchmarks.bench.aggregate import Measured
from benchmarks.bench.client import Result
from benchmarks.bench.spec import Trace
from benchmarks.bench.summary import source, summarize
from benchmarks.bench.workload import Conversation

KV = 1000  # KV bytes per token


def turn(key: str, prefix: int, device: int, host: int, storage: int, resumed: bool = True) -> Result:
    r = Result(key, "w", 1, resumed, prompt_tokens=prefix + 50, output_ids=[1], prefix_tokens=prefix,
               cached_tokens=device + host + storage)  # fmt: skip
    r.cached = {"device": device, "host": host, "storage": storage}
    return r


def test_a_resumed_turn_is_counted_where_most_of_its_prefix_came_from() -> None:
    assert source(turn("a", 400, 300, 0, 100)) == "resident"
    assert source(turn("b", 400, 64, 0, 336)) == "restored"
    assert source(turn("c", 400, 64, 100, 100)) == "restored", "host and disk are both lower tiers"
    assert source(turn("d", 400, 64, 0, 0)) == "recomputed"
    assert source(turn("e", 400, 200, 200, 0)) == "resident", "a tie goes to the device"
    assert source(turn("f", 0, 0, 0, 0)) is None, "nothing to reuse"
    unknown = turn("g", 400, 0, 0, 0)
    unknown.cached = None  # no split by tier in the answer (smg over gRPC)
    assert source(unknown) is None


def test_restored_and_recomputed_tokens_and_bytes_written_per_byte_restored() -> None:
    rs = [turn("first", 0, 0, 0, 0, resumed=False), turn("r", 400, 64, 0, 336), turn("h", 300, 0, 200, 0),
          turn("x", 500, 100, 0, 0), turn("d", 200, 200, 0, 0)]  # fmt: skip
    failed = turn("err", 900, 0, 0, 900)
    failed.error = "HTTP 500"
    f = summarize([*rs, failed], 1.0, {}, written_bytes=2 * 536 * KV, kv_bytes_per_token=KV)
    assert (f.resumed_resident, f.resumed_restored, f.resumed_recomputed) == (1, 2, 1)
    assert f.tokens_restored == 536  # 336 from disk + 200 from host memory; the failed request not
    assert f.tokens_recomputed == 0 + 100 + 400 + 0
    assert f.disk_write_mb == pytest.approx(2 * 536 * KV / 2**20)
    assert f.write_per_restored == pytest.approx(2.0)
    nothing = summarize([turn("d", 200, 200, 0, 0)], 1.0, {}, written_bytes=1e6, kv_bytes_per_token=KV)
    assert nothing.tokens_restored == 0 and math.isnan(nothing.write_per_restored), "nothing restored"
    assert math.isnan(summarize(rs, 1.0, {}).disk_write_mb), "not measured"


def test_over_repeats_the_turn_counts_add_up_and_the_rest_is_a_median() -> None:
    runs = tuple(
        summarize(
            [turn("r", 400, 0, 0, 400), turn("x", 400, 0, 0, 0)],
            1.0,
            {},
            written_bytes=w,
            kv_bytes_per_token=KV,
        )
        for w in (1e6, 3e6, 2e6)
    )
    m = Measured(runs).median
    assert (m.resumed_restored, m.resumed_recomputed, m.resumed_resident) == (3, 3, 0)
    assert m.tokens_restored == 400 and m.tokens_recomputed == 400
    assert m.write_per_restored == pytest.approx(2e6 / (400 * KV))


def test_each_workload_names_the_prefix_a_cache_could_hold() -> None:
    conv = Conversation.open(0, first_tokens=50, vocab=1024)
    first = conv.next_turn(question_tokens=10, output_tokens=4)
    conv.answered(first, [901, 902, 903, 904])
    assert first.prefix_tokens == 0 and conv.next_turn(10, 4).prefix_tokens == 54
    recs = [trace.TraceRecord(0, 1000, 10, (5, 6)), trace.TraceRecord(1, 1500, 10, (5, 6, 9))]
    reqs = trace.to_requests(recs, Trace(token_scale=0.25), 1024)
    assert [r.prefix_tokens for r in reqs] == [0, 256], "its two blocks of 128 tokens were sent before"
