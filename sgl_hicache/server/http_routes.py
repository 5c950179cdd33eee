"""`POST /hicache/prefetch`: the client resume hint (see `hints.py`).

Body: `{"messages": [...]}` (the conversation so far, tokenized with the model's chat template, no
generation prompt: the next turn's prompt starts with exactly these tokens) or `{"input_ids": [...]}`;
optional `"cache_salt"` and `"extra_key"` select the tenant, as on sglang's own endpoints.
Answer, at once: `{"prompt_tokens": n, "prefetch_tokens": m}`, m being the tokens whose reads the
hint started (or that were already on their way); 400 for a bad body, 503 if the scheduler did not
answer in time.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

ROUTE = "/hicache/prefetch"


def add_prefetch_route(app: Any) -> None:
    """Idempotent: registers the route on sglang's FastAPI app once."""
    if any(getattr(r, "path", None) == ROUTE for r in app.routes):
        return
    app.add_api_route(ROUTE, prefetch_endpoint, methods=["POST"])


async def prefetch_endpoint(request: Request) -> JSONResponse:
    from sglang.srt.entrypoints.http_server import get_global_state

    from sgl_hicache.server.hints import send_hint

    manager = get_global_state().tokenizer_manager
    try:
        body = await request.json()
        ids = hint_token_ids(body, manager.tokenizer)
    except (ValueError, TypeError, KeyError) as e:
        return JSONResponse({"error": f"bad prefetch hint: {e}"}, status_code=400)
    reply = await asyncio.to_thread(
        send_hint, manager.server_args.port, ids, body.get("extra_key"), body.get("cache_salt")
    )
    return JSONResponse({"prompt_tokens": len(ids), **reply}, status_code=503 if "error" in reply else 200)


def hint_token_ids(body: dict[str, Any], tokenizer: Any) -> list[int]:
    if "input_ids" in body:
        ids = body["input_ids"]
    elif "messages" in body:
        out = tokenizer.apply_chat_template(body["messages"], tokenize=True, add_generation_prompt=False)
        ids = out if isinstance(out, list) else out["input_ids"]
    else:
        raise ValueError("give 'messages' or 'input_ids'")
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise ValueError("token ids must be a list of integers")
    return ids
