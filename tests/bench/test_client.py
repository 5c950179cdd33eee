"""The streaming client against a stand-in `/generate` (aiohttp.web): timing, cumulative output
ids (sglang's stream) and new ones only (smg's over gRPC workers), cached tokens by tier, the model
named, and every failure recorded instead of raised."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from benchmarks.bench.client import Result, generate, new_session
from benchmarks.bench.workload import Request
from tests.bench.standin_http import serving

REQ = Request("k", group=0, round=1, input_ids=(5, 6, 7), output_tokens=3, resumed=True)


def _chunk(ids: list[int], finish: Any = None, details: Any = None, count: int | None = None) -> bytes:
    meta = {"cached_tokens": 2, "cached_tokens_details": details, "finish_reason": finish}
    meta |= {} if count is None else {"completion_tokens": count}
    return b"data: " + json.dumps({"output_ids": ids, "meta_info": meta}).encode() + b"\n\n"


async def _serve(chunks: list[bytes], status: int = 200, model: str | None = None) -> Result:
    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["input_ids"] == [5, 6, 7] and body["stream"] is True
        assert body.get("model") == model
        if status != 200:
            return web.Response(status=status, text="boom")
        resp = web.StreamResponse()
        await resp.prepare(request)
        for c in chunks:
            await resp.write(c)
            await asyncio.sleep(0.01)
        return resp

    async with serving(handler) as url, new_session() as session:
        return await generate(session, url, REQ, "w", 0.0, model=model)


def test_streamed_answer_is_timed_and_counted() -> None:
    details = {"device": 1, "host": 0, "storage": 1, "storage_backend": "x"}
    r = asyncio.run(
        _serve([_chunk([9]), _chunk([9, 8, 7], {"type": "length"}, details), b"data: [DONE]\n\n"])
    )
    assert r.error is None and r.output_ids == [9, 8, 7]
    assert r.ttft_ms > 0 and r.latency_ms >= r.ttft_ms and len(r.itl_ms) == 2
    assert r.cached_tokens == 2 and r.cached == {"device": 1, "host": 0, "storage": 1}
    assert r.resumed and r.prompt_tokens == 3


def test_failures_are_recorded() -> None:
    aborted = asyncio.run(_serve([_chunk([9], {"type": "abort", "message": "too long"})]))
    assert aborted.error == "aborted: too long"
    short = asyncio.run(_serve([_chunk([9, 8], {"type": "length"})]))
    assert short.error == "got 2 output tokens, asked for 3"
    assert asyncio.run(_serve([], status=500)).error == "HTTP 500: boom"
    broken = asyncio.run(_serve([b'data: {"error": "scheduler died"}\n\n']))
    assert broken.error == "scheduler died"


def test_cumulative_and_incremental_streams_give_the_same_ids() -> None:
    """sglang streams every id so far; smg over gRPC workers only the new ones, its closing chunk
    repeating the last; `completion_tokens` tells them apart."""
    cumulative = [
        _chunk([9], count=1),
        _chunk([9, 8], count=2),
        _chunk([9, 8, 7], {"type": "length"}, count=3),
    ]
    new_only = [_chunk([9], count=1), _chunk([8], count=2), _chunk([7], count=3),
                _chunk([7], {"type": "length"}, count=3), b"data: [DONE]\n\n"]  # fmt: skip
    for chunks in (cumulative, new_only):
        r = asyncio.run(_serve(chunks, model="m"))
        assert r.error is None and r.output_ids == [9, 8, 7] and len(r.itl_ms) == 2
    two_at_once = asyncio.run(_serve([_chunk([9], count=1), _chunk([8, 7], count=3)]))
    assert two_at_once.output_ids == [9, 8, 7] and len(two_at_once.itl_ms) == 2
    neither = asyncio.run(_serve([_chunk([9], count=1), _chunk([8, 7, 6, 5], count=3)]))
    assert neither.error == "a stream chunk of 4 ids at 3 tokens after 1"
    backwards = asyncio.run(_serve([_chunk([9], count=1), _chunk([8], count=2), _chunk([8], count=1)]))
    assert backwards.error == "a stream chunk of 1 tokens after 2: [8] repeated"
    wrong_repeat = asyncio.run(_serve([_chunk([9], count=1), _chunk([8], count=2), _chunk([6], count=2)]))
    assert wrong_repeat.error == "a stream chunk of 2 tokens after 2: [6] repeated"
