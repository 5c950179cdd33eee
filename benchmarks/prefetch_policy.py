"""Resumed-turn TTFT under each prefetch policy (wait / timeout / best_effort), side by side.

One server per policy, in this one run, each with the generated `small` model (~95M params), the
same device pool, a tier on the real disk under --dir, and the same workload:

  setup:  each of R resuming clients has a conversation history of L tokens served;
  each round:
    push out: unrelated prompts of 1.5x the pool evict (spill) the histories to the tier;
    the page cache is dropped (the tier reads with O_DIRECT anyway, reported as `direct_io`);
    measured: F fresh clients send new prompts back to back while the R resuming clients send
    history + a new question, staggered over the window (arriving while the scheduler is busy
    with prefill or decode). Every request streams `--new-tokens` tokens; TTFT is the first chunk.

Figures per policy: resumed-turn TTFT p50/p90, fresh-request TTFT p50, throughput (generated
tokens per second of the measured windows), resumed turns that were recomputed (cached tokens short
of the history), and the server's counters: restores given up as too late (`restores_too_late`),
all restores abandoned (`restore_failures`), admissions deferred (`restore_deferrals`), tokens
unpacked before their restore's last read completed (`early_unpack_tokens`).

`--tier-latency S` wraps each tier in a FaultyTier adding S seconds to every tier operation
(SGL_HICACHE_TEST_FAULTS), to emulate a slow or remote tier; 0 (the default) measures the disk.

    python -m benchmarks.prefetch_policy [--quick] [--tier-latency 0] [--policies wait,timeout,best_effort]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.bench import pagecache
from benchmarks.bench.probe import spill_state
from benchmarks.bench.server_process import CPU_FLAGS, ServerProcess
from benchmarks.harness import emit, log

POLICIES = ("wait", "timeout", "best_effort")


@dataclass(frozen=True)
class Workload:
    history: int  # tokens of each resumed conversation
    resumers: int  # clients resuming a spilled conversation each round
    fresh_clients: int  # clients sending fresh prompts meanwhile
    fresh_len: int  # tokens of a fresh prompt
    rounds: int
    stagger_s: float  # resuming clients arrive this far apart
    question: int = 32  # new tokens of a resumed turn
    new_tokens: int = 16  # generated per request

    @property
    def pool(self) -> int:
        """Room for every resumed turn and fresh prompt of a round at once, not for the filler."""
        turn = self.history + self.question * (self.rounds + 1) + self.new_tokens
        return self.resumers * turn + self.fresh_clients * (self.fresh_len + self.new_tokens) + 1024


QUICK = Workload(history=2048, resumers=4, fresh_clients=2, fresh_len=768, rounds=2, stagger_s=0.8)
FULL = Workload(history=4096, resumers=6, fresh_clients=3, fresh_len=1024, rounds=3, stagger_s=1.0)


@dataclass(frozen=True)
class Turn:
    resumed: bool
    ttft_ms: float
    cached: int
    generated: int


def seq(seed: int, n: int) -> list[int]:
    return [(i * 7919 + seed * 104729) % 8000 + 100 for i in range(n)]


def generate(base: str, ids: list[int], new_tokens: int) -> tuple[float, int, int]:
    """Stream one generation: (TTFT ms, cached tokens, tokens generated)."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    req = urllib.request.Request(
        base + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    ttft, last = None, {}
    with urllib.request.urlopen(req, timeout=1800) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            ttft = ttft if ttft is not None else (time.perf_counter() - t0) * 1e3
            last = json.loads(line[5:])
    meta = last.get("meta_info", {})
    return ttft or 0.0, int(meta.get("cached_tokens", 0)), int(meta.get("completion_tokens", 0))


def push_out(base: str, w: Workload, seed: int) -> None:
    """Unrelated prompts of 1.5x the pool, 2048 tokens each: every history is evicted (spilled)."""
    for k in range(-(-w.pool * 3 // 2 // 2048)):
        generate(base, seq(seed * 1000 + k, 2048), 1)


def measured_round(base: str, w: Workload, histories: list[list[int]], rnd: int) -> tuple[list[Turn], float]:
    """One measured window; returns its turns and its wall time. Histories grow by the question."""
    turns: list[Turn] = []
    lock, done = threading.Lock(), threading.Event()

    def resume(i: int) -> None:
        time.sleep(i * w.stagger_s)
        ids = histories[i] + seq(5000 + rnd * 100 + i, w.question)
        ms, cached, gen = generate(base, ids, w.new_tokens)
        histories[i] = ids
        with lock:
            turns.append(Turn(True, ms, cached, gen))

    def fresh(c: int) -> None:
        k = 0
        while not done.is_set():
            ms, cached, gen = generate(base, seq(90000 + rnd * 1000 + c * 100 + k, w.fresh_len), w.new_tokens)
            with lock:
                turns.append(Turn(False, ms, cached, gen))
            k += 1

    resumers = [threading.Thread(target=resume, args=(i,)) for i in range(w.resumers)]
    others = [threading.Thread(target=fresh, args=(c,)) for c in range(w.fresh_clients)]
    t0 = time.perf_counter()
    for t in [*others, *resumers]:
        t.start()
    for t in resumers:
        t.join()
    done.set()
    for t in others:
        t.join()
    return turns, time.perf_counter() - t0


def run_policy(model: Path, policy: str, w: Workload, workdir: Path, latency_s: float) -> dict[str, Any]:
    flags = [*CPU_FLAGS, "--chunked-prefill-size", "4096", "--enable-hicache-spill",
             "--hicache-spill-dir", str(workdir / f"tier-{policy}"), "--hicache-spill-min-free", "0",
             "--hicache-spill-prefetch-policy", policy]  # fmt: skip
    env = {"SGL_HICACHE_TEST_FAULTS": json.dumps({"latency_s": latency_s})} if latency_s else {}
    turns: list[Turn] = []
    window, dropped = 0.0, True
    with ServerProcess(model, w.pool, flags, log_path=workdir / f"{policy}.log", env=env) as server:
        base = server.base_url
        histories = [seq(i + 1, w.history) for i in range(w.resumers)]
        for ids in histories:
            generate(base, ids, 1)
        for rnd in range(w.rounds):
            push_out(base, w, seed=rnd + 1)
            dropped &= pagecache.drop([workdir]) == "drop_caches"
            got, seconds = measured_round(base, w, histories, rnd)
            turns += got
            window += seconds
            log(f"{policy:>11} round {rnd}: {summary(got)}")
        state = spill_state(base)
    return {"turns": turns, "window_s": window, "state": state, "dropped_page_cache": dropped}


def summary(turns: list[Turn]) -> str:
    res = sorted(t.ttft_ms for t in turns if t.resumed)
    return f"resumed TTFT {', '.join(f'{x:.0f}' for x in res)} ms; cached {[t.cached for t in turns if t.resumed]}"


def p(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if q < 1 else values[-1]


def figures(policy: str, r: dict[str, Any], w: Workload) -> dict[str, Any]:
    resumed = [t for t in r["turns"] if t.resumed]
    fresh = [t for t in r["turns"] if not t.resumed]
    counters = r["state"]["counters"]
    return {
        f"{policy}_resume_ttft_p50_ms": statistics.median(t.ttft_ms for t in resumed),
        f"{policy}_resume_ttft_p90_ms": p([t.ttft_ms for t in resumed], 0.9),
        f"{policy}_fresh_ttft_p50_ms": statistics.median(t.ttft_ms for t in fresh) if fresh else float("nan"),
        f"{policy}_throughput_tok_s": sum(t.generated for t in r["turns"]) / r["window_s"],
        f"{policy}_resumes": len(resumed),
        f"{policy}_resumes_recomputed": sum(t.cached < w.history for t in resumed),
        f"{policy}_restores_too_late": int(counters["restores_too_late"]),
        f"{policy}_restores_abandoned": int(counters["restore_failures"]),
        f"{policy}_restore_deferrals": int(counters["restore_deferrals"]),
        f"{policy}_early_unpack_tokens": r["state"].get("early_unpack", {}).get("tokens", 0),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="2K histories, 4 resuming + 2 fresh clients, 2 rounds"
    )
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--tier-latency", type=float, default=0.0, help="seconds added to tier operations")
    parser.add_argument(
        "--dir", type=Path, default=Path("out/bench-prefetch"), help="work dir on the disk to measure"
    )
    args = parser.parse_args(argv)
    w = QUICK if args.quick else FULL
    policies = args.policies.split(",")
    args.dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="prefetch-", dir=args.dir)).resolve()
    results: dict[str, Any] = {}
    try:
        from benchmarks.modelgen import generate_model

        model = generate_model(workdir / "model-small", "small", seed=0)
        for policy in policies:
            results[policy] = run_policy(model, policy, w, workdir, args.tier_latency)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out: dict[str, Any] = {"model": "small", "pool_tokens": w.pool, "history_tokens": w.history,
                           "resumers": w.resumers, "fresh_clients": w.fresh_clients, "rounds": w.rounds,
                           "tier_latency_s": args.tier_latency}  # fmt: skip
    for policy in policies:
        out.update(figures(policy, results[policy], w))
    first = results[policies[0]]
    out["direct_io"] = bool(first["state"]["tier"]["direct_io"])
    out["dropped_page_cache"] = all(r["dropped_page_cache"] for r in results.values())
    emit(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
