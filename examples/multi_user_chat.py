"""Many users chatting at once with long, growing histories, against any OpenAI-compatible server.

Each user thinks between turns (`--think-s`), so the server's device pool fills with other users'
conversations and evicts theirs; with sgl_hicache the evicted history comes back from the tier as
cached tokens. With `--hint`, each user sends a resume hint (`POST /hicache/prefetch`) while
thinking, so the history is read back before the next turn arrives. Prints a row per turn (TTFT,
prompt and cached tokens) and, at the end, the median TTFT and the cached share of resumed turns.

    python examples/multi_user_chat.py --base-url http://127.0.0.1:30000 --users 8 --turns 4 --hint

Run the server with `--enable-cache-report` (cached tokens are reported only then) and pass its
`--api-key` here (or set OPENAI_API_KEY).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from client_errors import BASE_URL_HELP, run, server_root
from openai import OpenAI

TOPICS = ["a garden", "a trip to Lisbon", "a birthday party", "a small bakery", "a mountain hike",
          "a chess club", "a kitchen remodel", "a podcast"]  # fmt: skip
WORDS = [
    "plan",
    "budget",
    "people",
    "time",
    "place",
    "food",
    "music",
    "weather",
    "list",
    "notes",
    "ideas",
    "tools",
]


@dataclass
class User:
    name: str
    topic: str
    messages: list[dict[str, str]] = field(default_factory=list)
    rows: list[tuple[int, int, int, float]] = field(default_factory=list)  # turn, prompt, cached, ttft ms


def question(rng: random.Random, user: User, words: int) -> str:
    detail = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"About {user.topic}: please help with the next step. Details: {detail}."


def turn(client: OpenAI, model: str, user: User, text: str, max_tokens: int) -> tuple[int, int, float]:
    """One streamed turn: (prompt tokens, cached tokens, TTFT ms)."""
    user.messages.append({"role": "user", "content": text})
    t0, ttft, parts, usage = time.perf_counter(), None, [], None
    stream = client.chat.completions.create(
        model=model, messages=user.messages, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    user.messages.append({"role": "assistant", "content": "".join(parts)})
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    cached = int(getattr(details, "cached_tokens", 0) or 0)
    return (int(usage.prompt_tokens) if usage else 0), cached, ((ttft or time.perf_counter() - t0) * 1e3)


def hint(base_url: str, api_key: str, messages: list[dict[str, str]]) -> None:
    """Ask the server to read this conversation's spilled KV back before its next turn."""
    body = json.dumps({"messages": messages}).encode()
    req = urllib.request.Request(base_url + "/hicache/prefetch", body, method="POST",
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {api_key}"})  # fmt: skip
    try:
        urllib.request.urlopen(req, timeout=10).close()
    except OSError as e:  # a server without sgl_hicache: hints are only an optimisation
        print(f"hint not taken ({e}); go on without", flush=True)


def run_user(args: argparse.Namespace, client: OpenAI, model: str, user: User, seed: int,
             lock: threading.Lock) -> None:  # fmt: skip
    rng = random.Random(seed)
    user.messages.append({"role": "system", "content": f"You help {user.name} plan {user.topic}."})
    for k in range(args.turns):
        if k:
            time.sleep(args.think_s * (0.5 + rng.random()))
            if args.hint:
                hint(args.base_url, args.api_key, user.messages)
        prompt, cached, ttft = turn(
            client, model, user, question(rng, user, args.question_words), args.max_tokens
        )
        user.rows.append((k + 1, prompt, cached, ttft))
        with lock:
            print(f"{user.name:>8} {k + 1:>4} {prompt:>7} {cached:>7} {ttft:>9.1f}", flush=True)


def summary(users: list[User]) -> dict[str, float]:
    resumed = [row for u in users for row in u.rows if row[0] > 1]
    prompt = sum(r[1] for r in resumed)
    return {"resumed_turns": len(resumed),
            "resumed_ttft_p50_ms": statistics.median(r[3] for r in resumed) if resumed else 0.0,
            "resumed_cached_share": sum(r[2] for r in resumed) / prompt if prompt else 0.0}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True, help=BASE_URL_HELP)
    p.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY", "none"), help="the server's --api-key"
    )
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--think-s", type=float, default=2.0, help="mean pause between a user's turns, seconds")
    p.add_argument(
        "--question-words", type=int, default=120, help="how much each question adds to the history"
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--hint", action="store_true", help="send a resume hint while each user thinks")
    args = p.parse_args(argv)
    args.base_url = server_root(args.base_url)
    return run("multi_user_chat", args.base_url, lambda: chat(args))


def chat(args: argparse.Namespace) -> int:
    client = OpenAI(base_url=args.base_url + "/v1", api_key=args.api_key)
    model = client.models.list().data[0].id
    users = [User(f"user{i}", TOPICS[i % len(TOPICS)]) for i in range(args.users)]
    print(f"{'user':>8} {'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT ms':>9}", flush=True)
    lock = threading.Lock()
    with ThreadPoolExecutor(max_workers=max(1, args.users)) as pool:
        runs = [pool.submit(run_user, args, client, model, u, i, lock) for i, u in enumerate(users)]
    for done in runs:
        done.result()  # a user's error (a refused key, a context too long) ends the example here
    figures = summary(users)
    if figures["resumed_turns"] and not any(r[2] for u in users for r in u.rows):
        print("no cached tokens reported: run the server with --enable-cache-report", flush=True)
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
