"""What every example shares about its server: the one form of `--base-url` (the server's root,
`http://127.0.0.1:30000`; a trailing `/v1` is dropped, so the OpenAI form works too), and how an
example ends when the server refuses it: one line on stderr and exit code 1, not a traceback
(a wrong key: 401; a conversation longer than the model's context: sglang's 400 and its reason;
a server that cannot be reached).

    return run("my_example", args.base_url, lambda: talk(server_root(args.base_url), args.api_key))
"""

from __future__ import annotations

import json
import sys
import urllib.error
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import openai

BASE_URL_HELP = "the server's root, e.g. http://127.0.0.1:30000 (a trailing /v1 is dropped)"
ADMIN_ROUTES = ("/hicache/drop", "/hicache/purge")  # sglang's admin level: its --admin-api-key if set
CLIENT_ERRORS = (openai.APIError, urllib.error.URLError, ConnectionError)


def server_root(url: str) -> str:
    """`http://host:port` for `http://host:port`, `.../`, `.../v1` or `.../v1/`."""
    root = url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def run(prog: str, base_url: str | None, body: Callable[[], int]) -> int:
    """`body()`, or 1 after one line on stderr if the server at `base_url` refused it or could not
    be reached."""
    try:
        return body()
    except CLIENT_ERRORS as e:
        print(f"{prog}: error: {one_line(e, base_url)}", file=sys.stderr, flush=True)
        return 1


def one_line(e: BaseException, base_url: str | None = None) -> str:
    """What went wrong with a request, in one line of at most 400 characters."""
    status, where, reason = _status_of(e)
    if status is None:
        text = f"cannot reach the server at {base_url or where or '?'}: {reason}"
    elif status in (401, 403):
        key = "--admin-api-key" if where.endswith(ADMIN_ROUTES) else "--api-key (or set OPENAI_API_KEY)"
        text = f"{where} answered {status} ({reason or 'Unauthorized'}): the server takes another key: pass its {key}"
    else:
        text = f"{where} answered {status}: {reason}"
    return " ".join(text.split())[:400]


def _status_of(e: BaseException) -> tuple[int | None, str, str]:
    """(HTTP status or None if there was no answer, "METHOD /path" or the URL, the server's reason)."""
    if isinstance(e, openai.APIStatusError):
        request = e.response.request
        return e.response.status_code, f"{request.method} {request.url.path}", _reason(e.body, e.message)
    if isinstance(e, openai.APIError):  # no answer: connection refused, timeout
        url = getattr(getattr(e, "request", None), "url", "")
        return None, str(url), str(e.__cause__ or e)
    if isinstance(e, urllib.error.HTTPError):
        try:
            body: Any = json.loads(e.read() or b"{}")
        except ValueError:
            body = None
        return e.code, f"POST {urlsplit(e.url).path}", _reason(body, e.reason)
    if isinstance(e, urllib.error.URLError):
        reason = e.reason.strerror if isinstance(e.reason, OSError) and e.reason.strerror else e.reason
        return None, "", str(reason)
    return None, "", str(e)


def _reason(body: Any, fallback: Any) -> str:
    """The server's reason: sglang's `{"message": ...}` (OpenAI routes) or `{"error": ...}` (its key
    check, our hint routes), OpenAI's `{"error": {"message": ...}}` (the openai client passes on
    what is under "error"), else `fallback`."""
    if isinstance(body, str) and body:
        return body
    if isinstance(body, dict):
        error = body.get("error")
        found = body.get("message") or (error.get("message") if isinstance(error, dict) else error)
        if found:
            return str(found)
    return str(fallback or "")
