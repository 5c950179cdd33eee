"""The benchmark's HTTP client: one streamed `/generate` request with token ids, timed.

Ours rather than sglang's `bench_serving`: the workloads are closed-loop (a turn's prompt contains
the previous answer's output ids) and need per-request cached-token details by tier, which
`bench_serving` does not return. Requests use greedy sampling with `ignore_eos`, so every system
generates exactly the requested number of tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from benchmarks.bench.workload import Request

TIERS = ("device", "host", "storage")
ROUTED_HEADER = "x-smg-routed-worker-id"  # smg 1.13 names the worker's URL in every response


@dataclass
class Result:
    """What one request measured. `error` is None on success."""

    key: str
    workload: str
    round: int
    resumed: bool
    prompt_tokens: int
    sent_s: float = 0.0  # since the workload (multi-turn: its round) started
    done_s: float = float("nan")  # when its answer ended or it failed, on `sent_s`'s clock
    ttft_ms: float = float("nan")
    latency_ms: float = float("nan")
    itl_ms: list[float] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # sglang's `cached_tokens`: prompt tokens not computed
    cached: dict[str, int] | None = field(default_factory=lambda: dict.fromkeys(TIERS, 0))  # by tier
    # (None: the answer named no split by tier, and the system has several: smg over gRPC workers)
    error: str | None = None
    repeat: int = 0  # which of the run's repeats
    server: str | None = None  # behind smg: the worker it routed the request to (`ROUTED_HEADER`)
    prefix_tokens: int = 0  # `Request.prefix_tokens`: of the prompt, what a cache could hold
    follows: str | None = None  # `Request.follows`: the key of the request whose prefix it reuses


async def generate(session: aiohttp.ClientSession, base_url: str, request: Request, workload: str, t0: float,
                   dispatched: asyncio.Event | None = None, model: str | None = None) -> Result:  # fmt: skip
    """Send `request`, stream the answer, and time it. Never raises for server or network faults:
    they are recorded in `Result.error`. `dispatched` is set once the response headers arrived (a
    router has picked the server and the server took the request) or the request failed before.
    `model`: the model the request names (smg over gRPC workers needs it; sglang's own `/generate`
    takes none). `Result.sent_s` and `Result.done_s` are seconds since `t0`."""
    try:
        result = await _generate(session, base_url, request, workload, t0, dispatched, model)
        result.done_s = time.perf_counter() - t0
        return result
    finally:
        if dispatched is not None:
            dispatched.set()


async def _generate(session: aiohttp.ClientSession, base_url: str, request: Request, workload: str, t0: float,
                    dispatched: asyncio.Event | None, model: str | None) -> Result:  # fmt: skip
    result = Result(request.key, workload, request.round, request.resumed, len(request.input_ids),
                    prefix_tokens=request.prefix_tokens, follows=request.follows)  # fmt: skip
    body: dict[str, Any] = {} if model is None else {"model": model}
    body |= {
        "input_ids": list(request.input_ids),
        "stream": True,
        "sampling_params": {"max_new_tokens": request.output_tokens, "temperature": 0, "ignore_eos": True},
    }
    start = time.perf_counter()
    result.sent_s = start - t0
    try:
        async with session.post(base_url + "/generate", json=body) as response:
            if dispatched is not None:
                dispatched.set()
            result.server = response.headers.get(ROUTED_HEADER)
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            await _consume(response, result, start)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
    if result.error is None and len(result.output_ids) != request.output_tokens:
        result.error = f"got {len(result.output_ids)} output tokens, asked for {request.output_tokens}"
    return result


async def _consume(response: aiohttp.ClientResponse, result: Result, start: float) -> None:
    last = start
    async for raw in response.content:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        chunk: dict[str, Any] = json.loads(line.removeprefix("data:"))
        if "error" in chunk:
            result.error = str(chunk["error"])[:200]
            return
        now = time.perf_counter()
        meta = chunk.get("meta_info") or {}
        got = len(result.output_ids)
        if not _take_ids(chunk.get("output_ids") or [], meta.get("completion_tokens"), result):
            return
        new = len(result.output_ids) - got
        if new > 0:
            if got == 0:
                result.ttft_ms = (now - start) * 1e3
            else:
                result.itl_ms += [(now - last) * 1e3 / new] * new
            last = now
        _cached(meta, result)
        finish = meta.get("finish_reason") or {}
        if isinstance(finish, dict) and finish.get("type") == "abort":
            result.error = f"aborted: {str(finish.get('message'))[:200]}"
            return
    result.latency_ms = (time.perf_counter() - start) * 1e3


def _take_ids(ids: list[int], count: object, result: Result) -> bool:
    """Take a chunk's `output_ids` into `result`: every id so far (sglang's HTTP stream), or only
    the new ones (smg's stream over gRPC workers, whose last chunk repeats the last id), told apart
    by `completion_tokens` (ids so far) where the chunk has it. False (and `result.error`) for a
    chunk that is neither."""
    if not isinstance(count, int) or isinstance(count, bool):
        if len(ids) > len(result.output_ids):  # no count: cumulative, as sglang streams
            result.output_ids = list(ids)
        return True
    new = count - len(result.output_ids)
    if new < 0 or (new == 0 and ids and ids[-1:] != result.output_ids[-1:]):
        result.error = f"a stream chunk of {count} tokens after {len(result.output_ids)}: {ids[-1:]} repeated"
        return False
    if new == 0:
        return True  # nothing new: a closing chunk (smg's repeats the last id)
    if len(ids) == count:
        result.output_ids = list(ids)
    elif len(ids) == new:
        result.output_ids += ids
    else:
        result.error = f"a stream chunk of {len(ids)} ids at {count} tokens after {len(result.output_ids)}"
        return False
    return True


def _cached(meta: dict[str, Any], result: Result) -> None:
    result.cached_tokens = int(meta.get("cached_tokens") or 0)
    details = meta.get("cached_tokens_details")
    if isinstance(details, dict):
        result.cached = {t: int(details.get(t) or 0) for t in TIERS}
    elif meta.get("cached_tokens"):  # no per-tier details: sglang reports only device hits then
        result.cached = {"device": int(meta["cached_tokens"]), "host": 0, "storage": 0}


def new_session(timeout_s: float = 1800.0) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        connector=aiohttp.TCPConnector(limit=0),
    )
