"""One benchmark run: each system in turn on the same model, shape and workloads.

Systems run one after another (this machine cannot host three servers side by side), each on a
fresh server and an empty tier directory, with the same token ids. Within a system the workloads
run back to back on one server; their token ids differ (salted), so one workload's KV never serves
another's requests.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from sgl_hicache.bench import drive, pagecache, systems, trace
from sgl_hicache.bench.client import Result
from sgl_hicache.bench.probe import Sampler, delta, dir_bytes, scrape
from sgl_hicache.bench.spec import BenchSpec, SpecError
from sgl_hicache.bench.workload import Request


@dataclass
class SystemOutcome:
    results: dict[str, list[Result]] = field(default_factory=dict)  # per workload
    wall_s: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # /metrics deltas per workload
    rss_peak_mb: float = 0.0
    tier_bytes: int = 0  # on disk at the end of the run
    page_cache: set[str] = field(default_factory=set)  # how the page cache was dropped


def resolve_model(name: str, cache_dir: Path) -> Path:
    """A generated model size (built once into `cache_dir`) or an existing model directory."""
    from sgl_hicache.modelgen.generate import SIZES, generate_model

    if name in SIZES:
        out = cache_dir / f"model-{name}"
        stamp = out / "sgl_hicache_model.json"
        if not (stamp.exists() and json.loads(stamp.read_text()) == {"size": name, "seed": 0}):
            generate_model(out, name, seed=0)
        return out
    path = Path(name)
    if not (path / "config.json").is_file():
        raise SpecError(
            f"model {name!r} is neither a generated size ({', '.join(SIZES)}) nor a model directory"
        )
    return path


def vocab_size(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def trace_requests(spec: BenchSpec, vocab: int) -> list[Request]:
    return [] if spec.trace is None else trace.to_requests(trace.load(spec.trace), spec.trace, vocab)


def run_system(
    name: str, spec: BenchSpec, model: Path, workdir: Path, replay: list[Request]
) -> SystemOutcome:
    tokens = sum(m.concurrency * (m.context_tokens() + m.question_tokens) for m in spec.multiturn)
    tokens += sum(len(r.input_ids) + r.output_tokens for r in replay)
    system = systems.build(name, spec.shape, model, workdir, workload_tokens=tokens)
    outcome = SystemOutcome()
    vocab = vocab_size(model)
    tiers = [d for d in (system.tier_dir,) if d is not None]

    def drop() -> None:
        if spec.drop_page_cache:
            outcome.page_cache.add(pagecache.drop(tiers))

    n = sum(m.concurrency * m.rounds for m in spec.multiturn) + len(replay)
    with (
        system.server(model, workdir / f"{name}.log") as server,
        Sampler(server.proc.pid if server.proc else 0) as rss,
        tqdm(total=n, desc=f"{name:>9}", file=sys.stderr, unit="req") as bar,
    ):
        for salt, mt in enumerate(spec.multiturn, 1):
            _record(outcome, server.base_url, drive.multiturn(server.base_url, mt, vocab, salt, drop, bar))
        if replay:
            _record(outcome, server.base_url, drive.replay(server.base_url, replay, drop, bar))
        outcome.tier_bytes = dir_bytes(system.tier_dir)
    outcome.rss_peak_mb = rss.peak_rss_mb
    if system.tier_dir is not None:
        shutil.rmtree(system.tier_dir, ignore_errors=True)
    return outcome


def _record(outcome: SystemOutcome, base_url: str, work: Coroutine[Any, Any, drive.Driven]) -> None:
    before = scrape(base_url)  # `work` starts only below
    driven = asyncio.run(work)
    outcome.metrics[driven.workload] = delta(scrape(base_url), before)
    outcome.results[driven.workload] = driven.results
    outcome.wall_s[driven.workload] = driven.wall_s
