"""A chat app that deletes a conversation's cached KV when the user deletes the conversation.

    python examples/chat_delete.py --base-url http://127.0.0.1:30000

Each conversation gets its own `cache_salt` (here a random id; an app would use its conversation
id): its KV is then cached apart from every other conversation's, and deleting the conversation is
one `POST /hicache/purge {"cache_salt": ...}`, which removes everything of that salt from the
server's device, staging and tier (every extent of it in the tier directory, in every namespace,
checkable with `sgl-hicache fsck DIR --cache-salt SALT`). Without a salt of its own,
`--forget drop` sends the conversation itself to `POST /hicache/drop` instead: its own part goes,
not what other conversations share (a system prompt). A server that shares the tier directory
keeps its device copy until it evicts it (docs/OPERATIONS.md, "Retention hints").

A server started with `--admin-api-key` takes only that key on `/hicache/purge` and `/hicache/drop`
(as on sglang's `/flush_cache`): pass it with `--admin-api-key` (default: the `--api-key`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
import uuid
from typing import Any

from client_errors import BASE_URL_HELP, run, server_root
from openai import OpenAI


def post(base_url: str, route: str, body: dict[str, Any], api_key: str) -> tuple[int, dict[str, Any]]:
    """(HTTP status, JSON answer) of one hint; a refused key (401, 403) raises HTTPError."""
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"}
    req = urllib.request.Request(base_url + route, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            raise
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {"error": e.reason}


def chat(client: OpenAI, model: str, messages: list[dict[str, str]], salt: str | None) -> tuple[str, int]:
    """One turn: (the answer, cached prompt tokens)."""
    extra = {"cache_salt": salt} if salt else {}
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                         extra_body=extra)  # fmt: skip
    details = out.usage.prompt_tokens_details if out.usage else None
    return out.choices[0].message.content or "", int(getattr(details, "cached_tokens", 0) or 0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True, help=BASE_URL_HELP)
    p.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY", "none"), help="the server's --api-key"
    )
    p.add_argument("--admin-api-key", default=None,
                   help="the server's --admin-api-key, for the purge or drop (default: --api-key)")  # fmt: skip
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--forget", choices=("purge", "drop"), default="purge",
                   help="purge the conversation's own salt (default), or drop the conversation")  # fmt: skip
    args = p.parse_args(argv)
    return run("chat_delete", args.base_url, lambda: chat_then_forget(args))


def chat_then_forget(args: argparse.Namespace) -> int:
    base = server_root(args.base_url)
    client = OpenAI(base_url=base + "/v1", api_key=args.api_key)
    model = client.models.list().data[0].id
    salt = f"conversation-{uuid.uuid4().hex}" if args.forget == "purge" else None
    messages = [{"role": "system", "content": "You are a concise assistant."}]
    for turn in range(args.turns):
        messages.append({"role": "user", "content": f"Question {turn + 1}: name one more prime number."})
        answer, cached = chat(client, model, messages, salt)
        messages.append({"role": "assistant", "content": answer})
        print(f"turn {turn + 1}: {cached} cached tokens", flush=True)
    # The user deletes the conversation: its KV goes with it.
    admin_key = args.admin_api_key or args.api_key
    if salt is not None:
        status, reply = post(base, "/hicache/purge", {"cache_salt": salt}, admin_key)
    else:
        status, reply = post(base, "/hicache/drop", {"messages": messages}, admin_key)
    print(json.dumps({"forget": args.forget, "status": status, **reply}), flush=True)
    return 0 if status == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
