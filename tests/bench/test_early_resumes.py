"""Resumed turns sent before their conversation's previous turn finished (`summary.early_sources`):
which turns arrive early, the split of each group by where its prefix came from, what the trace and
the replay record for it, and the figures it adds to the final line."""

from __future__ import annotations

import asyncio
import json
import math

from aiohttp import web
from tqdm import tqdm

from benchmarks.bench import drive, report, trace
from benchmarks.bench.aggregate import Measured
from benchmarks.bench.client import Result
from benchmarks.bench.spec import Trace
from benchmarks.bench.summary import EARLY_COUNTS, arrived_early, early_sources, summarize
from benchmarks.bench.workload import Request
from tests.bench.standin_http import serving


def turn(key: str, sent: float, done: float, follows: str | None = None, *, prefix: int = 400,
         device: int = 0, host: int = 0, storage: int = 0, error: str | None = None) -> Result:  # fmt: skip
    """A turn sent at `sent` and finished at `done` (seconds since t0); resumed where it `follows` one."""
    r = Result(key, "w", 1, follows is not None, prompt_tokens=prefix + 50, output_ids=[1], sent_s=sent,
               done_s=done, prefix_tokens=prefix if follows else 0, follows=follows, error=error,
               cached_tokens=device + host + storage)  # fmt: skip
    r.cached = {"device": device, "host": host, "storage": storage}
    return r


def test_a_turn_sent_before_the_turn_it_follows_finished_arrived_early() -> None:
    rs = [turn("a0", 0.0, 2.0), turn("a1", 1.0, 3.0, "a0"), turn("a2", 3.5, 4.0, "a1"),
          turn("a3", 4.0, 5.0, "a2"), turn("b1", 0.5, 1.0, "gone"), turn("c1", 9.0, 9.5, "c0")]  # fmt: skip
    done = {r.key: r.done_s for r in rs} | {"c0": math.nan}
    assert arrived_early(rs[1], done), "sent at 1.0 s, the turn it follows ended at 2.0 s"
    assert not arrived_early(rs[2], done), "sent at 3.5 s, after its previous turn ended at 3.0 s"
    assert not arrived_early(rs[3], done), "sent the instant its previous turn ended"
    assert not arrived_early(rs[0], done), "a first turn follows nothing"
    assert not arrived_early(rs[4], done), "the turn it follows is not among the results"
    assert not arrived_early(rs[5], done), "the turn it follows has no known end"


def test_early_and_late_turns_are_each_split_by_where_their_prefix_came_from() -> None:
    rs = [
        *(turn(k, 0.0, 5.0) for k in ("a0", "b0")),
        turn("c0", 0.0, 1.0, error="HTTP 500"),
        turn("a1", 1.0, 6.0, "a0"),  # early, recomputed
        turn("b1", 2.0, 7.0, "b0", device=64),  # early, recomputed (most of the prefix missing)
        turn("c1", 0.5, 4.0, "c0", device=400),  # early (its previous turn failed later), resident
        turn("a2", 6.5, 7.0, "a1", device=100, storage=300),  # late, restored from disk
        turn("b2", 7.5, 8.0, "b1", host=400),  # late, restored from host memory
        turn("c2", 4.0, 5.0, "c1", device=400),  # late (sent as its previous turn ended), resident
        turn("a3", 6.9, 8.0, "a2", error="HTTP 500"),  # early, but failed: not counted
    ]
    assert early_sources(rs) == {
        "early_resumes": 3, "early_resident": 1, "early_restored": 0, "early_recomputed": 2,
        "late_resumes": 3, "late_resident": 1, "late_restored": 2, "late_recomputed": 0,
    }  # fmt: skip
    f = summarize(rs, 1.0, {})
    assert (f.early_resumes, f.early_recomputed, f.late_restored) == (3, 2, 2)
    assert f.early_resumes + f.late_resumes == f.resumed
    for s in ("resident", "restored", "recomputed"):
        assert getattr(f, f"early_{s}") + getattr(f, f"late_{s}") == getattr(f, f"resumed_{s}")
    line = report.per_system({"w": {"ours": f}})["w"]["ours"]
    assert {k: line[k] for k in EARLY_COUNTS} == early_sources(rs)
    json.dumps(f.to_json(), allow_nan=False)


def test_closed_loop_turns_follow_nothing_so_none_arrives_early() -> None:
    """Multi-turn and agents send a turn once its previous turn was answered: no `follows`."""
    first = turn("c0r0", 0.0, 5.0)
    again = Result("c0r1", "w", 1, True, 450, output_ids=[1], sent_s=0.0, done_s=1.0, prefix_tokens=400)
    again.cached = {"device": 0, "host": 400, "storage": 0}
    assert early_sources([first, again]) == {
        "early_resumes": 0, "early_resident": 0, "early_restored": 0, "early_recomputed": 0,
        "late_resumes": 1, "late_resident": 0, "late_restored": 1, "late_recomputed": 0,
    }  # fmt: skip


def test_over_repeats_the_early_counts_add_up() -> None:
    one = [turn("a0", 0.0, 2.0), turn("a1", 1.0, 3.0, "a0"), turn("a2", 3.5, 4.0, "a1", storage=400)]
    m = Measured((summarize(one, 1.0, {}), summarize(one, 1.0, {}))).median
    assert (m.early_resumes, m.early_recomputed, m.late_resumes, m.late_restored) == (2, 2, 2, 2)


def test_a_trace_request_follows_the_latest_request_that_sent_its_prefix() -> None:
    recs = [trace.TraceRecord(0, 1536, 4, (1, 2, 3)), trace.TraceRecord(1, 1536, 4, (1, 7, 8)),
            trace.TraceRecord(2, 2048, 4, (1, 2, 3, 4)), trace.TraceRecord(3, 2560, 4, (1, 2, 3, 4, 5)),
            trace.TraceRecord(4, 2048, 4, (1, 7, 8, 9)), trace.TraceRecord(5, 2048, 4, (1, 2, 3, 4))]  # fmt: skip
    reqs = trace.to_requests(recs, Trace(token_scale=1 / 32), 1024)
    assert [r.follows for r in reqs] == [None, "t0", "t0", "t2", "t1", "t3"], (
        "t1 shares only the system block of t0; t5 re-sends what t2 and t3 sent, t3 last"
    )
    assert [r.resumed for r in reqs] == [False, False, True, True, True, True]


def test_the_replay_records_send_and_end_on_one_clock() -> None:
    """Open loop, against a stand-in that answers after 0.4 s: a turn sent 0.1 s after the one it
    follows arrives early; one sent 1.0 s after does not."""

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        await asyncio.sleep(0.4)
        resp = web.StreamResponse()
        await resp.prepare(request)
        meta = {"cached_tokens": 0, "cached_tokens_details": {"device": 0, "host": 0, "storage": 0}}
        await resp.write(b"data: " + json.dumps({"output_ids": [1], "meta_info": meta}).encode() + b"\n\n")
        assert body["sampling_params"]["max_new_tokens"] == 1
        return resp

    reqs = [Request("t0", 0, 0, (100, 101), 1, False),
            Request("t1", 0, 1, (100, 101, 102), 1, True, at_s=0.1, prefix_tokens=2, follows="t0"),
            Request("t2", 0, 2, (100, 101, 102, 103), 1, True, at_s=1.0, prefix_tokens=3, follows="t1")]  # fmt: skip

    async def replay() -> drive.Driven:
        async with serving(handler) as url:
            return await drive.replay(url, reqs, lambda: None, tqdm(disable=True))

    rs = asyncio.run(replay()).results
    assert all(r.error is None for r in rs)
    assert [r.follows for r in rs] == [None, "t0", "t1"]
    assert all(r.sent_s + 0.35 <= r.done_s for r in rs), [(r.sent_s, r.done_s) for r in rs]
    f = early_sources(rs)
    assert [f[k] for k in ("early_resumes", "early_recomputed", "late_resumes", "late_recomputed")] == [1] * 4
