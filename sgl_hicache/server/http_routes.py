"""`POST /hicache/prefetch`: the client resume hint (see `hints.py`), and the retention hints
`POST /hicache/pin` (the same body plus `"ttl_s"`), `/hicache/drop` (the same body) and
`/hicache/purge` (`{"cache_salt": "..."}` only): cache/retention.py says what each does.

Body: `{"messages": [...]}` (the conversation so far, checked and normalized as sglang's
`/v1/chat/completions` takes messages, OpenAI text parts included (`hint_messages.py`), then tokenized
with the model's chat template, no generation prompt: the next turn's prompt starts with exactly
these tokens) or `{"input_ids": [...]}`, not both; optional `"cache_salt"` and `"extra_key"`
(strings) select the tenant, as on sglang's own endpoints. Any other key is refused (`KEYS`): a
typo such as `cache_slat` must not make a drop act on the default tenant.
Answer, at once: `{"accepted": true, "prompt_tokens": n}` (a purge: `{"accepted": true}`; why not
more: `hints.py`). Errors are one JSON line `{"error": "..."}`: 400 for a bad body (not JSON, a key the
route does not take, both `messages` and `input_ids`, ids not integers in [0, vocab size), empty or
longer than the context, keys not short strings, messages sglang would refuse or with non-text
parts, a chat template that refuses the messages, a pin without a `ttl_s` in (0, 7 days], a purge without a
salt or with anything else), 409 for a pin the scheduler refuses (over the pin budget, spill
off), 413 for a body over `MAX_BODY_BYTES`, 503 when hints are off, too many are in flight or the
scheduler did not answer in time.

Keys: with sglang's `--api-key` / `--admin-api-key`, the routes that delete data for good (`drop`,
`purge`: `ADMIN_KINDS`) are at sglang's admin level, marked exactly as sglang's own `/flush_cache`
(`AuthLevel.ADMIN_OPTIONAL`: with an admin key set only that key, else the api key, else open); the
others (`prefetch`, `pin`) at its normal level, as `/generate` (the api key where one is set).
sglang's middleware checks the key before any of our code runs (401, or 403).

Everything that costs CPU (JSON parsing, the chat template) runs off the event loop, and at most
`MAX_IN_FLIGHT` hints are handled at a time: the others get 503 at once.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from sgl_hicache.server.hint_messages import chat_messages
from sgl_hicache.server.hints import RUNTIME_DIR_ENV, Hint, HintError, HintLimits, check_hint, send_hint

ROUTE = "/hicache/prefetch"
ROUTES = {ROUTE: "prefetch", "/hicache/pin": "pin", "/hicache/drop": "drop", "/hicache/purge": "purge"}
MAX_BODY_BYTES = 4 << 20
_CONVERSATION = frozenset({"messages", "input_ids", "cache_salt", "extra_key"})
KEYS = {"prefetch": _CONVERSATION, "pin": _CONVERSATION | {"ttl_s"}, "drop": _CONVERSATION,
        "purge": frozenset({"cache_salt"})}  # fmt: skip
MAX_IN_FLIGHT = 32
ADMIN_KINDS = frozenset({"drop", "purge"})  # they delete data other clients may need: admin level


class BodyTooLarge(Exception):
    pass


def add_prefetch_route(app: Any) -> None:
    """Idempotent: registers the hint routes (`ROUTES`) on sglang's FastAPI app once; they share
    one bound on hints in flight. `ADMIN_KINDS` get sglang's admin level, as `/flush_cache`."""
    from sglang.srt.utils.auth import AuthLevel, auth_level

    if any(getattr(r, "path", None) == ROUTE for r in app.routes):
        return
    slots = asyncio.Semaphore(MAX_IN_FLIGHT)
    for path, kind in ROUTES.items():
        endpoint = _endpoint(slots, kind)
        if kind in ADMIN_KINDS:
            endpoint = auth_level(AuthLevel.ADMIN_OPTIONAL)(endpoint)
        app.add_api_route(path, endpoint, methods=["POST"])


def _endpoint(slots: asyncio.Semaphore, kind: str) -> Any:
    async def hint_endpoint(request: Request) -> JSONResponse:
        if slots.locked():
            return error(503, "too many resume hints in flight; try again later")
        async with slots:
            return await answer_hint(request, kind)

    return hint_endpoint


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": " ".join(message.split())[:300]}, status_code=status)


async def answer_hint(request: Request, kind: str = "prefetch") -> JSONResponse:
    from sglang.srt.entrypoints.http_server import get_global_state

    runtime_dir = os.environ.get(RUNTIME_DIR_ENV)
    if not runtime_dir:
        return error(503, "resume hints are off: start the server with python -m sgl_hicache.launch_server")
    state = get_global_state()
    manager, content_format = state.tokenizer_manager, state.template_manager.jinja_template_content_format
    limits = HintLimits(int(manager.model_config.vocab_size), int(manager.context_len))
    try:
        data = await read_body(request, MAX_BODY_BYTES)
        hint = await asyncio.to_thread(parse_hint, data, manager.tokenizer, limits, kind, content_format)
    except BodyTooLarge as e:
        return error(413, str(e))
    except HintError as e:
        return error(400, str(e))
    reply = await asyncio.to_thread(send_hint, runtime_dir, hint)
    if "error" in reply:
        status = reply.get("status")
        return error(status if status in (400, 409, 500) else 503, str(reply["error"]))
    if kind == "purge":
        return JSONResponse({"accepted": True})
    return JSONResponse({"accepted": True, "prompt_tokens": len(hint.ids)})


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (BodyTooLarge) as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and (len(declared) > 12 or int(declared) > limit):
        raise BodyTooLarge(f"the body is over {limit} bytes")
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise BodyTooLarge(f"the body is over {limit} bytes")
    return bytes(data)


def parse_hint(data: bytes, tokenizer: Any, limits: HintLimits, kind: str = "prefetch",
               content_format: str | None = "string") -> Hint:  # fmt: skip
    """The checked `kind` hint of a request body (blocking: JSON and chat template); HintError if bad.
    `content_format`: sglang's for the model's chat template (`hint_messages.chat_messages`)."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise HintError(f"the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise HintError("the body must be a JSON object")
    unknown = set(body) - KEYS.get(kind, frozenset())
    if unknown:
        names = ", ".join(repr(k) for k in sorted(unknown))[:80]
        raise HintError(
            f"a {kind} hint does not take {names} (it takes {', '.join(sorted(KEYS.get(kind, ())))})"
        )
    if kind == "purge":  # no conversation: everything of the salt
        return check_hint(None, None, body.get("cache_salt"), limits, kind)
    ids = hint_token_ids(body, tokenizer, content_format)
    return check_hint(ids, body.get("extra_key"), body.get("cache_salt"), limits, kind, body.get("ttl_s"))


def hint_token_ids(body: dict[str, Any], tokenizer: Any, content_format: str | None) -> Any:
    """The unchecked token ids of a body: its `input_ids`, or its `messages` through the chat template."""
    if ("input_ids" in body) == ("messages" in body):
        raise HintError("give 'messages' or 'input_ids', not both")
    if "input_ids" in body:
        return body["input_ids"]
    messages = chat_messages(body["messages"], content_format)
    if tokenizer is None:
        raise HintError("'messages' need a server with a tokenizer: give 'input_ids'")
    try:
        out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
        return out if isinstance(out, list) else out["input_ids"]
    except Exception as e:  # the template is code run on client data: any failure is a bad body
        raise HintError(f"the chat template refused these messages ({type(e).__name__})") from None
