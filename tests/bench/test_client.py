"""The streaming client against a stand-in `/generate` (aiohttp.web): timing, cumulative output
ids, cached tokens by tier, and every failure recorded instead of raised."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from benchmarks.bench.client import Result, generate, new_session
from benchmarks.bench.workload import Request
from tests.bench.standin_http import serving

REQ = Request("k", group=0, round=1, input_ids=(5, 6, 7), output_tokens=3, resumed=True)


def _chunk(ids: list[int], finish: Any = None, details: Any = None) -> bytes:
    meta = {"cached_tokens": 2, "cached_tokens_details": details, "finish_reason": finish}
    return b"data: " + json.dumps({"output_ids": ids, "meta_info": meta}).encode() + b"\n\n"


async def _serve(chunks: list[bytes], status: int = 200) -> Result:
    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["input_ids"] == [5, 6, 7] and body["stream"] is True
        if status != 200:
            return web.Response(status=status, text="boom")
        resp = web.StreamResponse()
        await resp.prepare(request)
        for c in chunks:
            await resp.write(c)
            await asyncio.sleep(0.01)
        return resp

    async with serving(handler) as url, new_session() as session:
        return await generate(session, url, REQ, "w", 0.0)


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
