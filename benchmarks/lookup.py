"""Cross-server lookup cost: latency and file system calls per prompt (tier/path_lookup.py).

    python -m benchmarks.lookup [--quick] [--dir DIR] [--prompts 64] [--tokens 4096]

Writer A stores conversations of `--tokens` tokens as extents of 128-1024 tokens (turns) with
their aliases (page size 16, alias every 64 tokens); reader B, another tier object on the same
directory that indexed none of them, looks up each conversation plus 48 new tokens from scratch
(hit: the whole history found and verified) and prompts nobody wrote (miss). Baseline measured in
the same run: opening and verifying one extent header by its key (what a local restore's first
step costs). Payloads are one page: a lookup reads headers only. Warm page cache (the files were
just written); a cold NVMe-oF volume adds one read latency per verified extent.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import emit, log
from sgl_hicache.config import MiB, TierConfig
from sgl_hicache.tier import KVDtype, KVLayout, Namespace, open_tier
from sgl_hicache.tier.base import Tier
from sgl_hicache.tier.file.load import open_extent
from sgl_hicache.tier.keys import ExtentKey, PathHasher, chain_key
from sgl_hicache.tier.path_lookup import alias_marks
from sgl_hicache.tier.results import LookupRequest, LookupResult

NS = Namespace("bench-lookup", KVLayout(2, 2, 64, KVDtype.BF16, 16))
PAGE = NS.layout.page_size


def write_conversation(tier: Tier, rng: random.Random, n_tokens: int) -> tuple[np.ndarray, int]:
    """One conversation stored as turn-sized extents; returns (its tokens, extents written)."""
    tokens = np.array([rng.randrange(1, 50_000) for _ in range(n_tokens)], dtype=np.int64)
    hasher, start, count = PathHasher(NS.id), 0, 0
    payload = np.zeros(4096, dtype=np.uint8)
    while start < n_tokens:
        n = min(n_tokens - start, rng.randrange(128, 1025, PAGE))
        part = tokens[start : start + n]
        parent = hasher.key()
        key = chain_key(NS.id, parent, part)
        tier.submit_store(key, payload, part, parent, aliases=alias_marks(hasher, start, part, PAGE))
        hasher.update(part)
        start, count = start + n, count + 1
    return tokens, count


def look(tier: Tier, tokens: np.ndarray) -> tuple[LookupResult, float]:
    t0 = time.perf_counter()
    tier.submit_lookup(LookupRequest(tokens.astype(np.uint32), 0))
    while not (done := tier.lookups_finished()):
        time.sleep(0.0001)
    return done[0], time.perf_counter() - t0


def verify_header(tier: Tier, key: ExtentKey) -> float:
    """Seconds to open and verify one extent's header by its key (the baseline)."""
    t0 = time.perf_counter()
    ext = open_extent(tier._paths.extent(key), NS.id, key, False, tier._seal)  # type: ignore[attr-defined]
    elapsed = time.perf_counter() - t0
    os.close(ext.fd)
    return elapsed


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("out/bench_lookup"))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--quick", action="store_true", help="16 prompts of 2048 tokens")
    args = ap.parse_args(argv)
    prompts, n_tokens = (16, 2048) if args.quick else (args.prompts, args.tokens)
    shutil.rmtree(args.dir, ignore_errors=True)
    cfg = TierConfig(directory=args.dir, capacity_bytes=1024 * MiB, min_free_bytes=0)
    rng = random.Random(0)
    with open_tier(cfg, NS) as writer, open_tier(cfg, NS) as reader:
        convs, extents = [], 0
        for _ in range(prompts):
            tokens, n = write_conversation(writer, rng, n_tokens)
            convs.append(tokens)
            extents += n
        done = 0
        while done < extents:
            done += sum(c.ok for c in writer.get_finished())
            time.sleep(0.01)
        log(f"{prompts} conversations of {n_tokens} tokens in {extents} extents")
        hits = [look(reader, np.concatenate([t, np.arange(48) + 60_000])) for t in convs]
        misses = [look(reader, np.array([rng.randrange(1, 50_000) for _ in range(n_tokens)])) for _ in convs]
        header_s = [verify_header(reader, seg.key) for r, _ in hits for seg in r.segments]
    found = [r.end for r, _ in hits]
    assert all(f >= n_tokens // 64 * 64 - 64 for f in found), f"a lookup fell short: {found}"
    hit_ms = [s * 1e3 for _, s in hits]
    emit({
        "prompts": prompts, "prompt_tokens": n_tokens + 48, "extents_per_prompt": extents / prompts,
        "hit_tokens_found_mean": statistics.mean(found),
        "hit_latency_ms_p50": pct(hit_ms, 0.5), "hit_latency_ms_p90": pct(hit_ms, 0.9),
        "hit_fs_calls_mean": statistics.mean(r.fs_calls for r, _ in hits),
        "hit_fs_calls_max": max(r.fs_calls for r, _ in hits),
        "miss_latency_ms_p50": pct([s * 1e3 for _, s in misses], 0.5),
        "miss_fs_calls_mean": statistics.mean(r.fs_calls for r, _ in misses),
        "baseline_header_verify_ms_p50": pct([s * 1e3 for s in header_s], 0.5),
        "refused": sum(r.refused for r, _ in hits + misses),
    })  # fmt: skip


if __name__ == "__main__":
    main()
