"""Two servers on one tier directory behind sglang's router: a conversation's next turn lands on the
other server, which restores the history the first one spilled (cross-server reuse, no restart).

    python examples/cluster.py [--model tiny] [--workdir DIR] [--mooncake]   (`make demo-cluster`)

Starts servers A and B (the patched server on CPU, spill on, a 1024-token device pool each, one
shared tier directory) and the router (smg, round robin) in front; turn 1 goes through the router
to one server (X); its answer to turn 2 while the history is resident is the reference (asked of X
directly); other users' prompts then push the conversation out of X's pool (spilled to the tier);
another user talks to Y (so Y, like any serving server, holds the system prompt all chats share);
turn 2 goes through the router, which sends it to the other server (Y), which has never seen the
conversation: Y finds X's extents by lookup, restores them (cached tokens) and gives the same answer.
With `--mooncake` (`make demo-cluster CLUSTER_FLAGS=--mooncake`) the servers share a Mooncake Store
instead (one master on loopback, each server a client; the tier directory holds only the secret they
share). Everything is stopped on exit, Ctrl-C or SIGTERM. Exit code 1 if Y restored nothing or
answered otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shutil
import sys
import tempfile
from pathlib import Path

from client_errors import run
from multi_turn_chat import (
    HEADER,
    POOL_TOKENS,
    QUESTIONS,
    Chat,
    chat_turn,
    demo_model,
    other_prompt,
    spill_stats,
    use_checkout,
)
from openai import OpenAI


def run_cluster(workdir: Path, model_name: str, mooncake: bool = False) -> int:
    from benchmarks.bench.mooncake_process import MooncakeMaster
    from benchmarks.bench.server_process import CPU_FLAGS

    model = demo_model(model_name, workdir)
    tier = workdir / "tier"
    shutil.rmtree(tier, ignore_errors=True)
    flags = [*CPU_FLAGS, "--enable-cache-report", "--enable-metrics", "--enable-hicache-spill", "--hicache-spill-dir", str(tier),
             "--hicache-spill-capacity", "1G", "--hicache-spill-min-free", "0"]  # fmt: skip
    print(f"starting servers A and B ({model_name}, {POOL_TOKENS}-token pools, one tier: "
          f"{'a Mooncake Store' if mooncake else tier}) and the router (smg, round robin); logs in {workdir}",
          flush=True)  # fmt: skip
    with contextlib.ExitStack() as stack:
        if mooncake:  # one master on loopback; each server joins it as a client with a 256M segment
            cfg = stack.enter_context(MooncakeMaster(workdir)).config(segment_bytes=256 << 20)
            settings = {k: v for k, v in dataclasses.asdict(cfg).items() if v}
            flags += [
                "--hicache-spill-backend",
                "mooncake",
                "--hicache-spill-mooncake-config",
                json.dumps(settings),
            ]
        return serve_cluster(model, flags, workdir)


def serve_cluster(model: Path, flags: list[str], workdir: Path) -> int:
    from benchmarks.bench.router_process import RouterProcess
    from benchmarks.bench.server_process import ServerProcess

    with (
        ServerProcess(model, POOL_TOKENS, flags, log_path=workdir / "a.log") as a,
        ServerProcess(model, POOL_TOKENS, flags, log_path=workdir / "b.log") as b,
        RouterProcess([a.base_url, b.base_url], log_path=workdir / "router.log") as router,
    ):
        names = {a.base_url: "A", b.base_url: "B"}
        print(f"A {a.base_url}, B {b.base_url}, router {router.base_url}", flush=True)
        return converse(router.base_url, names)


def converse(router_url: str, names: dict[str, str]) -> int:
    chat = Chat(router_url, "chat")
    print(HEADER, flush=True)
    before = {url: prompt_tokens(url) for url in names}
    first = chat.ask(QUESTIONS[0])
    # the server whose prompt-token count grew by turn 1's (health checks add a token or so)
    x = next(url for url in names if prompt_tokens(url) - before[url] >= first.prompt_tokens)
    y = next(url for url in names if url != x)
    print(f"  turn 1 was served by {names[x]}; the router's next request goes to {names[y]}", flush=True)
    question = QUESTIONS[3]
    messages = [*chat.messages, {"role": "user", "content": question}]
    reference = chat_turn(OpenAI(base_url=x + "/v1", api_key="none"), chat.model, messages, chat.max_tokens)[
        0
    ]
    print(f"  reference: {names[x]} answers turn 2 with the history resident (never evicted)", flush=True)
    for k in range(1, 4):
        Chat(x, f"U{k}", max_tokens=8, show_text=False).ask(other_prompt(k))
    print(f"  ... other users pushed the conversation out of {names[x]}'s pool: spilled to the shared tier "
          f"({spill_stats(x)['spilled_tokens']:.0f} tokens) ...", flush=True)  # fmt: skip
    # Another user on Y: Y now holds the system prompt every chat starts with, as any serving server
    # does. (X never spilled it: its other users keep it resident. A lookup continues from where the
    # asking server's own tree ends, so that part must be Y's own.)
    Chat(y, "U4", max_tokens=8, show_text=False).ask(other_prompt(4))
    turn = chat.ask(question)
    stats = spill_stats(y)
    same = turn.reply == reference
    print(f"turn 2 on {names[y]}: {turn.cached_tokens} of {turn.prompt_tokens} prompt tokens cached; "
          f"{stats['lookup_attached_tokens']:.0f} found by lookup in {names[x]}'s extents, "
          f"{stats['restored_tokens']:.0f} restored; same answer as the never-evicted reference: "
          f"{'yes' if same else 'NO'}", flush=True)  # fmt: skip
    lookups = {k: v for k, v in stats.items() if k.startswith("lookup")}
    print(f"{names[y]}'s lookup counters: {lookups}", flush=True)
    return 0 if same and turn.cached_tokens > 0 and stats["lookup_attached_tokens"] > 0 else 1


def prompt_tokens(url: str) -> float:
    """sglang's `sglang:prompt_tokens_total` of a server (its /metrics)."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("sglang:prompt_tokens_total"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workdir", type=Path, help="tier, logs and the tiny model (default: a temp dir)")
    parser.add_argument(
        "--model", choices=("smollm2", "tiny"), default="smollm2",
        help="SmolLM2-135M-Instruct (real answers) or the random-weight tiny model (fast)",
    )  # fmt: skip
    parser.add_argument("--mooncake", action="store_true",
                        help="share a Mooncake Store (a master on loopback) instead of the tier directory")  # fmt: skip
    args = parser.parse_args(argv)
    return run("demo-cluster", None, lambda: start_and_converse(args))


def start_and_converse(args: argparse.Namespace) -> int:
    use_checkout()  # the servers, the router and the master are run by the checkout's benchmarks/
    from benchmarks.modelgen import ModelBuildError

    try:
        if args.workdir:
            args.workdir.mkdir(parents=True, exist_ok=True)
            return run_cluster(args.workdir.resolve(), args.model, args.mooncake)
        with tempfile.TemporaryDirectory(prefix="sgl_hicache_cluster_") as d:
            return run_cluster(Path(d), args.model, args.mooncake)
    except ModelBuildError as e:
        print(f"demo-cluster: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
