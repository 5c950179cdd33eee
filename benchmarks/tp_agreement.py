"""What the TP agreement costs (issue 14): the MIN collectives ranks take on local I/O outcomes.

Two measurements in one run:

  1. the collective alone: two processes in a gloo group (what sglang's `tp_cache_group` is on
     CPU and, for the cache, on GPU servers too) all-reduce MIN an int64 vector of the sizes the
     cache sends (1 flag; 8 victims of one evict); median and p90 microseconds per call;
  2. a `--tp-size 2` CPU server with spill on a small pool, serving multi-turn conversations whose
     history is evicted (spilled) and resumed (restored) by concurrent clients: how many collectives
     the cache took (`/server_info` → `tp_agreement`), per request, their total time, and that time
     as a share of the workload's wall time.

On CPU the forward dominates everything, so the share is small here by construction; the absolute
cost per collective (1.) is what carries over to a GPU deployment, where it is paid at most three
times per scheduling round that touches the tier (an evict, a restore's readiness, its verdict).

    python -m benchmarks.tp_agreement [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.bench.server_process import CPU_FLAGS, ServerProcess
from benchmarks.harness import emit, log
from benchmarks.modelgen import generate_model

POOL = 1024
PROMPT = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, port: int, sizes: list[int], calls: int, out: Any) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    result = {}
    for size in sizes:
        t = torch.zeros(size, dtype=torch.int64)
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            times.append(time.perf_counter() - t0)
        times.sort()
        result[size] = (statistics.median(times) * 1e6, times[int(0.9 * len(times))] * 1e6)
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def collective_alone(calls: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port, sizes = _free_port(), [1, 8]
    procs = [ctx.Process(target=_rank, args=(r, port, sizes, calls, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    result = out.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    figures = {}
    for size, (p50, p90) in result.items():
        figures[f"gloo_min_{size}x_int64_us_p50"] = p50
        figures[f"gloo_min_{size}x_int64_us_p90"] = p90
    return figures


def generate(base: str, ids: list[int], n: int = 8) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}}
    req = urllib.request.Request(
        base + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def tokens(seed: int, n: int = PROMPT) -> list[int]:
    return [(i * 7919 + seed * 104729) % 900 + 50 for i in range(n)]


def conversation(base: str, seed: int, turns: int) -> int:
    """A conversation whose history other conversations evict between its turns: requests sent."""
    history = tokens(seed)
    for turn in range(turns):
        out = generate(base, history)
        history = history + out["output_ids"] + tokens(seed * 100 + turn, 40)
    return turns


def tp_agreement(base: str) -> dict[str, Any]:
    with urllib.request.urlopen(base + "/server_info", timeout=60) as r:
        state = json.loads(r.read())["internal_states"][0]["hicache_spill"]
    return state["tp_agreement"] | {"restored": state["counters"].get("restored_tokens", 0),
                                    "spilled": state["counters"].get("spilled_tokens", 0)}  # fmt: skip


def server_workload(model: Path, tier: Path, clients: int, turns: int) -> dict[str, float]:
    args = (*CPU_FLAGS, "--tp-size", "2", "--enable-hicache-spill", "--hicache-spill-dir", str(tier),
            "--hicache-spill-min-free", "0")  # fmt: skip
    with ServerProcess(model, POOL, args, log_path=tier.parent / "server.log") as server:
        before = tp_agreement(server.base_url)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            requests = sum(pool.map(lambda s: conversation(server.base_url, s, turns), range(1, clients + 1)))
        wall = time.perf_counter() - t0
        after = tp_agreement(server.base_url)
    calls = after["collectives"] - before["collectives"]
    seconds = after["seconds"] - before["seconds"]
    return {
        "requests": requests,
        "collectives": calls,
        "collectives_per_request": calls / requests,
        "agreement_seconds": seconds,
        "mean_collective_us": seconds / calls * 1e6 if calls else 0.0,
        "workload_wall_s": wall,
        "agreement_share_of_wall": seconds / wall,
        "spilled_tokens": after["spilled"],
        "restored_tokens": after["restored"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer calls, clients and turns")
    args = parser.parse_args(argv)
    calls, clients, turns = (500, 3, 3) if args.quick else (5000, 4, 6)
    log(f"gloo all-reduce MIN, 2 processes, {calls} calls per size ...")
    figures: dict[str, Any] = collective_alone(calls)
    with tempfile.TemporaryDirectory(prefix="tp_agreement_") as tmp:
        model = generate_model(Path(tmp) / "tiny", "tiny", seed=0)
        log(f"TP=2 server with spill, {clients} clients x {turns} turns ...")
        figures |= server_workload(model, Path(tmp) / "tier", clients, turns)
    figures["cpu_count"] = os.cpu_count()
    emit(figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
