"""Warm a conversation before its next turn: `POST /hicache/prefetch` while the user is typing.

    python examples/resume_hint.py --base-url http://127.0.0.1:30000

A chat client knows a conversation is about to resume (the user opened it, or started typing) seconds
before the next message is sent. Sending the conversation so far as a hint starts reading its spilled
KV from the tier at once; when the next turn arrives, its restore finds the reads done.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from typing import Any

from client_errors import BASE_URL_HELP, run, server_root
from openai import OpenAI


def hint(base_url: str, messages: list[dict[str, str]], cache_salt: str | None = None,
         api_key: str = "none") -> dict[str, Any]:  # fmt: skip
    body: dict[str, Any] = {"messages": messages}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"}
    req = urllib.request.Request(base_url + "/hicache/prefetch", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def warm_then_ask(base_url: str, history: list[dict[str, str]], question: str, api_key: str = "none") -> str:
    reply = hint(
        base_url, history, api_key=api_key
    )  # returns at once; the reads of the spilled history have started
    print(f"hint: {reply['prompt_tokens']} tokens of history, accepted: {reply['accepted']}")
    time.sleep(0.5)  # ... the user is typing ...
    client = OpenAI(base_url=base_url + "/v1", api_key=api_key)
    model = client.models.list().data[0].id
    messages = [*history, {"role": "user", "content": question}]
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    details = out.usage.prompt_tokens_details if out.usage else None
    print(
        f"next turn: {out.usage.prompt_tokens if out.usage else '?'} prompt tokens, {getattr(details, 'cached_tokens', 0)} cached"
    )
    return out.choices[0].message.content or ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", required=True, help=BASE_URL_HELP)
    parser.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY", "none"), help="the server's --api-key"
    )
    args = parser.parse_args(argv)
    history = [
        {"role": "user", "content": "Let us plan a long trip by train."},
        {"role": "assistant", "content": "Gladly. Where would you like to go?"},
    ]

    def talk() -> int:
        warm_then_ask(server_root(args.base_url), history, "Through the mountains, in winter.", args.api_key)
        return 0

    return run("resume_hint", args.base_url, talk)


if __name__ == "__main__":
    sys.exit(main())
