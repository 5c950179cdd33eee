"""TTFT of a resumed turn whose history was evicted: our spill + restore vs sglang's default cache.

Both servers run in this one run, side by side, with the same generated `small` model (~95M params),
the same device pool (too small to keep the history while other work runs) and the same requests:

  1. history: a prompt of L tokens (the conversation so far) is served;
  2. other work: unrelated prompts fill the pool, so the history is evicted
     (sglang's default cache drops it; ours spills it to the tier on the real disk);
  3. resume: history + a new question is served; TTFT is measured (max_new_tokens=1).

Also measured, before step 2: a turn on the same history while it is still resident in the device
pool (`ttft_resident_ms`): the best any cache can do, the floor a restore is compared with
(`resume_vs_resident`).

Reads from the tier are cold: the tier reads with O_DIRECT where the filesystem allows it (reported
as `direct_io`), so the page cache does not serve them. The final stdout line is one JSON object with
`ttft_resume_ms`, `ttft_recompute_ms` and `resume_vs_recompute` per history length.

    python -m benchmarks.resume [--quick] [--lengths 2048,8192,16384]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.bench.probe import scrape, spill_state, tree_rss_mb
from benchmarks.bench.server_process import ServerProcess, device_flags
from benchmarks.harness import emit, log
from sgl_hicache.config import SpillConfig

NEW_QUESTION = 32


POST_TIMEOUT_S = 1800.0  # a request not answered by then fails the run (a server that stopped answering)


class NoAnswer(RuntimeError):
    """A server did not answer a request in time; `naming_log` adds where its log is."""


def post(base: str, body: dict[str, Any], timeout_s: float = POST_TIMEOUT_S) -> dict[str, Any]:
    """POST `body` to `base`/generate; NoAnswer when no byte of the answer came for `timeout_s`."""
    req = urllib.request.Request(
        base + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]
    except urllib.error.URLError as e:  # a timeout while connecting or sending comes wrapped
        if not isinstance(e.reason, TimeoutError):
            raise
        raise NoAnswer(f"{base}/generate did not answer within {timeout_s:.0f} s") from e
    except TimeoutError as e:
        raise NoAnswer(f"{base}/generate did not answer within {timeout_s:.0f} s") from e


@contextlib.contextmanager
def naming_log(log_path: Path | None) -> Iterator[None]:
    """A NoAnswer from the block names the server's log, where the reason of a hang shows."""
    try:
        yield
    except NoAnswer as e:
        raise NoAnswer(f"{e}; the server's log: {log_path}") from e


def ttft(base: str, ids: list[int]) -> tuple[float, int]:
    """Wall time of a one-token generation (prefill + first token) and the cached tokens reported."""
    t0 = time.perf_counter()
    out = post(base, {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    return (time.perf_counter() - t0) * 1e3, int(out["meta_info"]["cached_tokens"])


def seq(seed: int, n: int) -> list[int]:
    return [(i * 7919 + seed * 104729) % 8000 + 100 for i in range(n)]


def resume_once(base: str, length: int, pool: int, seed: int) -> tuple[float, int, float]:
    """(resume TTFT, its cached tokens, TTFT of a turn on the same history while still resident)."""
    history = seq(seed, length)
    ttft(base, history)
    resident_ms, _ = ttft(base, history + seq(seed + 5, NEW_QUESTION))  # the floor: a device hit
    filler = pool - 512
    for k in range(2):  # other work, twice the pool: the history cannot stay resident
        ttft(base, seq(seed * 100 + k + 1, filler))
    ms, cached = ttft(base, history + seq(seed + 7, NEW_QUESTION))
    return ms, cached, resident_ms


def spill_counters(base: str) -> dict[str, float]:
    """Our `sglang:hicache_spill_*` series by short name (`dropped_tokens_total`, ...)."""
    prefix = "sglang:hicache_spill_"
    out: dict[str, float] = {}
    for k, v in scrape(base).items():  # a family (dropped_tokens_total{reason}) is summed
        if k.startswith(prefix):
            name = k.split("{")[0].removeprefix(prefix)
            out[name] = out.get(name, 0.0) + v
    return out


def run_system(
    model: Path, pool: int, lengths: list[int], spill_dir: Path | None, workdir: Path, device: str = "cpu"
) -> dict[str, Any]:
    flags = [*device_flags(device), "--enable-metrics", "--chunked-prefill-size", "4096"]
    module = "sglang.launch_server"
    if spill_dir is not None:
        module = "sgl_hicache.launch_server"
        flags += [
            "--enable-hicache-spill",
            "--hicache-spill-dir",
            str(spill_dir),
            "--hicache-spill-min-free",
            "0",
        ]
    name = "spill" if spill_dir else "recompute"
    results: dict[str, Any] = {}
    log_path = workdir / f"{name}.log"
    with ServerProcess(model, pool, flags, module=module, log_path=log_path) as server, naming_log(log_path):
        for i, length in enumerate(lengths):
            ms, cached, resident_ms = resume_once(server.base_url, length, pool, seed=i + 1)
            results[length] = (ms, cached, resident_ms)
            log(
                f"{name:>9} L={length:>6}: resume TTFT {ms:8.1f} ms, cached {cached}; resident hit {resident_ms:8.1f} ms"
            )
        results["metrics"] = spill_counters(server.base_url) if spill_dir else {}
        results["state"] = spill_state(server.base_url) if spill_dir else {}
        results["rss_mb"] = tree_rss_mb(server.proc.pid if server.proc else 0)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2K and 8K only")
    parser.add_argument("--lengths", default="2048,8192,16384")
    parser.add_argument(
        "--dir", type=Path, default=Path("out/bench-resume"), help="work dir on the disk to measure"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the servers run")
    parser.add_argument(
        "--model-path", type=Path, default=None, help="a model dir (default: generated small)"
    )
    args = parser.parse_args(argv)
    lengths = [2048, 8192] if args.quick else [int(x) for x in args.lengths.split(",")]
    pool = max(lengths) + 4096
    args.dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="resume-", dir=args.dir)).resolve()
    try:
        from benchmarks.modelgen import generate_model

        model = args.model_path or generate_model(workdir / "model-small", "small", seed=0)
        base = run_system(model, pool, lengths, None, workdir, args.device)
        ours = run_system(model, pool, lengths, workdir / "tier", workdir, args.device)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    figures: dict[str, Any] = {
        "pool_tokens": pool,
        "model": str(args.model_path or "small"),
        "device": args.device,
    }
    for length in lengths:
        figures[f"ttft_resume_ms_{length}"] = ours[length][0]
        figures[f"ttft_recompute_ms_{length}"] = base[length][0]
        figures[f"resume_vs_recompute_{length}"] = ours[length][0] / base[length][0]
        figures[f"ttft_resident_ms_{length}"] = base[length][2]
        figures[f"resume_vs_resident_{length}"] = ours[length][0] / base[length][2]
        figures[f"cached_resume_{length}"] = ours[length][1]
        figures[f"cached_recompute_{length}"] = base[length][1]
    figures["rss_mb_recompute"] = base["rss_mb"]
    figures["rss_mb_spill"] = ours["rss_mb"]
    figures["staging_limit_mb"] = SpillConfig().staging_bytes / 2**20  # the default, used above
    figures["staging_peak_mb"] = ours["state"]["staging_peak_bytes"] / 2**20
    figures["staging_refused"] = ours["state"]["staging_refused"]
    figures["dropped_tokens"] = ours["metrics"].get("dropped_tokens_total", 0.0)
    figures["restored_bytes"] = ours["metrics"].get("restored_bytes_total", 0.0)
    figures["spilled_bytes"] = ours["metrics"].get("spilled_bytes_total", 0.0)
    emit(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
