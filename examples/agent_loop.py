"""An agent whose context grows by tool results, against any OpenAI-compatible server.

Each step sends the whole context (system prompt, task, every tool call and its result so far) and
asks the model for the next action; a local "tool" then returns a long result (a slice of a file
you choose, default this script's own source), which joins the context. The context's prefix is
the same at every step, so a cache serves it; while the agent waits for its tool (`--tool-s`),
other work may evict it, and sgl_hicache brings it back from the tier. Prints per step the TTFT,
the prompt and the cached tokens.

    python examples/agent_loop.py --base-url http://127.0.0.1:30000 --steps 6 --tool-s 1.0

With `--pin-ttl S` (an sgl_hicache server), the agent pins its fixed context (system prompt and
task, `--system-file` makes it long) for S seconds before each step (`POST /hicache/pin`): while
the tool runs, eviction then spills that context rather than dropping it and the tier keeps it
until the pin ends, so every step finds it. A pin over the server's pin budget is refused (409,
with the reason), and the agent goes on without it.

Run the server with `--enable-cache-report` (cached tokens are reported only then) and pass its
`--api-key` here (or set OPENAI_API_KEY).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

from client_errors import BASE_URL_HELP, run, server_root
from openai import OpenAI

SYSTEM = "You are an agent. Read each tool result, then name the next tool call in one short line."


def tool_result(source: str, step: int, chars: int) -> str:
    """What the tool returns at `step`: the next `chars` characters of `source`."""
    start = (step * chars) % max(1, len(source) - chars)
    return source[start : start + chars]


def step(
    client: OpenAI, model: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[str, int, int, float]:
    """(the model's action, prompt tokens, cached tokens, TTFT ms) for one streamed step."""
    t0, ttft, parts, usage = time.perf_counter(), None, [], None
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    cached = int(getattr(details, "cached_tokens", 0) or 0)
    prompt = int(usage.prompt_tokens) if usage else 0
    return "".join(parts), prompt, cached, (ttft or time.perf_counter() - t0) * 1e3


def pin(base_url: str, messages: list[dict[str, str]], ttl_s: float, api_key: str) -> str:
    """Pin `messages` (a prefix of every step's prompt) for `ttl_s` seconds; what the server said."""
    body = json.dumps({"messages": messages, "ttl_s": ttl_s}).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"}
    req = urllib.request.Request(base_url + "/hicache/pin", body, headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return f"pinned {json.loads(r.read())['prompt_tokens']} tokens for {ttl_s:g} s"
    except urllib.error.HTTPError as e:  # 409: over the pin budget; 503: hints off or busy
        if e.code in (401, 403):  # a refused key: the agent's requests would be refused too
            raise
        try:
            reason = json.loads(e.read() or b"{}").get("error", "")
        except (ValueError, AttributeError):
            reason = e.reason
        return f"not pinned ({e.code}): {reason}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True, help=BASE_URL_HELP)
    p.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY", "none"), help="the server's --api-key"
    )
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--tool-s", type=float, default=1.0, help="how long each tool call takes, seconds")
    p.add_argument("--tool-chars", type=int, default=2000, help="the size of each tool result, characters")
    p.add_argument("--source", type=Path, default=Path(__file__), help="the file the tool reads from")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--pin-ttl", type=float, default=0.0, help="pin the fixed context for this long (0: no pin)"
    )
    p.add_argument("--system-file", type=Path, help="a long system prompt (default: a one-line one)")
    args = p.parse_args(argv)
    args.base_url = server_root(args.base_url)
    return run("agent_loop", args.base_url, lambda: agent(args))


def agent(args: argparse.Namespace) -> int:
    client = OpenAI(base_url=args.base_url + "/v1", api_key=args.api_key)
    model = client.models.list().data[0].id
    source = args.source.read_text(errors="replace")
    system = args.system_file.read_text(errors="replace") if args.system_file else SYSTEM
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": f"Task: summarise the file {args.source.name}, part by part."}]  # fmt: skip
    fixed = list(messages)
    print(f"{'step':>4} {'prompt':>7} {'cached':>7} {'TTFT ms':>9}  action", flush=True)
    rows = []
    for k in range(args.steps):
        if args.pin_ttl > 0:  # renewed at every step, so it lasts while the agent does
            print(f"     {pin(args.base_url, fixed, args.pin_ttl, args.api_key)}", flush=True)
        action, prompt, cached, ttft = step(client, model, messages, args.max_tokens)
        rows.append((prompt, cached, ttft))
        print(f"{k + 1:>4} {prompt:>7} {cached:>7} {ttft:>9.1f}  {' '.join(action.split())[:60]}", flush=True)
        messages.append({"role": "assistant", "content": action})
        time.sleep(args.tool_s)  # the tool runs; meanwhile other work may evict this context
        messages.append(
            {"role": "user", "content": "Tool result:\n" + tool_result(source, k, args.tool_chars)}
        )
    later = rows[1:]
    if later and not any(r[1] for r in later):
        print("no cached tokens reported: run the server with --enable-cache-report", flush=True)
    prompt = sum(r[0] for r in later)
    print(
        json.dumps(
            {
                "steps": len(rows),
                "cached_share_after_first": sum(r[1] for r in later) / prompt if prompt else 0.0,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
