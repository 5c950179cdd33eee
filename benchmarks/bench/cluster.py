"""`--servers 2`: two servers behind sglang's router, four ways of giving them a disk tier.

Each configuration runs two servers of one system (the run's `Shape`, so each has the device pool
and host budget a single server of `--servers 1` has) behind `smg` with `--policy round_robin`, on
the multi-turn workloads only (a trace's sessions would not move between servers in a known way).
The driver dispatches each round's turns one after another in `drive.send_order` (the next one
once the router has picked a server for the last: sent at once, they would reach its round robin in
any order; a smoke run kept half the turns where they were), so the router puts every resumed turn
on the other server than the conversation's previous turn: the history it needs is on the other
server, or on the tier. The per-tier hit rates and the lookup counters show what was reused from where.

Each server runs, from its start, on its own share of the CPUs this process may use (`server_cpus`:
half of them each, contiguous; `OMP_NUM_THREADS` the share's size), as each instance of a deployment
has its own GPUs; the router and the driver are not pinned. Unpinned, each server's OpenMP threads
use every CPU and two servers fight over them: on 2 CPUs, one repeat of the multi-turn workload took
plain sglang's two servers 215 s unpinned and 14 s with one CPU each (a one-off diagnosis: README), and the systems suffered
unequally (sglang's idle scheduler spins, HiCache's yields the CPU), so the comparison measured the
oversubscription, not the caches. With a single CPU both servers share it. The final line names each
server's CPUs (`server_cpus`; null where the CPU profile is not installed: a GPU box, not pinned).

- `ours-shared`: two of our servers on one tier directory, writing through
  (`--hicache-spill-write-policy write_through`, what servers sharing a tier behind a router should
  run): a turn finds the history the other server cached by cross-server lookup, evicted or not
  (docs/DESIGN.md, "Sharing a tier").
- `ours-shared-write-back`: the same with our default policy, writing only on eviction: a moved
  turn finds only the part of its history the other server has evicted (what write-through buys).
- `ours-separate`: two of our servers writing through, each on its own tier directory: the baseline
  without sharing.
- `hicache-shared`: two sglang HiCache servers with the `file` L3 backend in one directory
  (HiCache's way to share), in its strongest configuration of the single-server benchmark
  (`STRONGEST_HICACHE`: `wait_complete`, sglang's default host ratio).

Configurations run one after another, `repeats` times in interleaved order (`run.schedule`), each
run on fresh servers, a fresh router and empty tier directories.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Coroutine
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

from tqdm import tqdm

from benchmarks.bench import aggregate, drive, pagecache, report, run, systems
from benchmarks.bench.client import Result
from benchmarks.bench.probe import delta, dir_bytes, scrape, total
from benchmarks.bench.router_process import RouterProcess
from benchmarks.bench.server_process import ServerProcess
from benchmarks.bench.spec import BenchSpec
from benchmarks.bench.summary import NAN, Figures, ratio

SERVERS = 2
STRONGEST_HICACHE = "hicache-wait-r2"
"""The HiCache configuration of `spec.HICACHE_CONFIGS` that `hicache-shared` runs: `wait_complete`
with sglang's default host ratio (the lowest resumed-turn TTFT of the single-server benchmark)."""

LOOKUP_COUNTERS = ("lookups", "lookup_fs_calls", "lookup_found_tokens", "lookup_attached_tokens",
                   "lookup_refused", "lookup_stale", "lookups_waited")  # fmt: skip
"""Our cross-server lookup counters (`sglang:hicache_spill_<name>_total` on `/metrics`)."""


@dataclass(frozen=True)
class ClusterConfig:
    name: str
    system: str  # a system of `systems.build`, run on each server
    shared: bool  # both servers on one tier directory (else one each)
    flags: tuple[str, ...] = ()  # added to the system's command line


WRITE_THROUGH = ("--hicache-spill-write-policy", "write_through")


CONFIGS = (
    ClusterConfig("ours-shared", "ours", shared=True, flags=WRITE_THROUGH),
    ClusterConfig("ours-shared-write-back", "ours", shared=True),
    ClusterConfig("ours-separate", "ours", shared=False, flags=WRITE_THROUGH),
    ClusterConfig("hicache-shared", STRONGEST_HICACHE, shared=True),
)
BY_NAME = {c.name: c for c in CONFIGS}


class ClusterOutcome(NamedTuple):
    outcome: run.SystemOutcome  # the /metrics deltas summed over the servers
    by_server: tuple[dict[str, float], ...]  # each server's lookup counters, summed over workloads


def server_cpus() -> tuple[tuple[int, ...] | None, ...]:
    """Each server's CPUs: `cpu_shares` of those this process may use (with fewer CPUs than
    servers, servers share them); None each (not pinned) where the CPU profile, which splits them,
    is not installed (a GPU box: the servers' work is on their devices)."""
    try:
        from sgl_hicache_cpu.cpu_tp_env import cpu_shares
    except ModuleNotFoundError as e:
        if e.name not in ("sgl_hicache_cpu", "sgl_hicache_cpu.cpu_tp_env"):
            raise
        return (None,) * SERVERS
    return cpu_shares(os.sched_getaffinity(0), SERVERS)


def run_config(config: ClusterConfig, spec: BenchSpec, model: Path, out: Path, repeat: int,
               cpus: tuple[tuple[int, ...] | None, ...]) -> ClusterOutcome:  # fmt: skip
    """One run of one configuration: two fresh servers (server k on `cpus[k]`) and a router, every
    multi-turn workload; the page cache of the tier directories is dropped at the rounds' barriers
    (clock stopped)."""
    servers = [systems.build(config.system, spec.shape, model, _root(out, config, k)) for k in range(SERVERS)]
    servers = [replace(s, flags=(*s.flags, *config.flags)) for s in servers]
    tiers = sorted({s.tier_dir for s in servers if s.tier_dir is not None})
    outcome, vocab = run.SystemOutcome(), run.vocab_size(model)
    by_server: list[dict[str, float]] = [{} for _ in servers]

    def drop() -> None:
        if spec.drop_page_cache:
            outcome.page_cache.add(pagecache.drop(tiers))

    n = sum(m.concurrency * m.rounds for m in spec.multiturn)
    with contextlib.ExitStack() as stack:
        logs = [out / run.log_name(f"{config.name}-s{k}", repeat) for k in range(SERVERS)]
        procs = [stack.enter_context(s.server(model, log, share))
                 for s, log, share in zip(servers, logs, cpus, strict=True)]  # fmt: skip
        log = out / run.log_name(f"{config.name}-router", repeat)
        router = stack.enter_context(RouterProcess([p.base_url for p in procs], log_path=log))
        bar = stack.enter_context(
            tqdm(total=n, desc=f"{config.name:>22} r{repeat}", file=sys.stderr, unit="req")
        )
        for salt, mt in enumerate(spec.multiturn, 1):
            work = drive.multiturn(router.base_url, mt, vocab, salt, drop, bar, alternate=True)
            _record(outcome, by_server, procs, work)
        outcome.tier_bytes = sum(dir_bytes(t) for t in tiers)
    for t in tiers:
        shutil.rmtree(t, ignore_errors=True)
    for results in outcome.results.values():
        for r in results:
            r.repeat = repeat
    return ClusterOutcome(outcome, tuple(by_server))


def _root(out: Path, config: ClusterConfig, server: int) -> Path:
    """Where `systems.build` puts server `server`'s tier (`<root>/tier-<system>`)."""
    root = out / config.name if config.shared else out / config.name / f"s{server}"
    root.mkdir(parents=True, exist_ok=True)
    return root


def _record(outcome: run.SystemOutcome, by_server: list[dict[str, float]], procs: list[ServerProcess],
            work: Coroutine[Any, Any, drive.Driven]) -> None:  # fmt: skip
    before = [scrape(p.base_url) for p in procs]  # `work` starts only below
    driven = asyncio.run(work)
    moved = [delta(scrape(p.base_url), b) for p, b in zip(procs, before, strict=True)]
    summed: dict[str, float] = {}
    for m, counters in zip(moved, by_server, strict=True):
        for k, v in m.items():
            summed[k] = summed.get(k, 0.0) + v
        for name, v in lookup_counters(m).items():
            counters[name] = counters.get(name, 0.0) + v
    outcome.metrics[driven.workload] = summed
    outcome.results[driven.workload] = driven.results
    outcome.wall_s[driven.workload] = driven.wall_s


def lookup_counters(metrics: dict[str, float]) -> dict[str, float]:
    """Our cross-server lookup counters in `/metrics` samples (0 for a server without them)."""
    return {name: total(metrics, f"sglang:hicache_spill_{name}_total") for name in LOOKUP_COUNTERS}


PAIRS = {"separate": "ours-separate", "write_back": "ours-shared-write-back", "hicache": "hicache-shared"}
"""The final line's ratios: `ours-shared` over each of these (resumed-turn TTFT p50, throughput)."""
RATIO_KEYS = tuple(f"{fig}_shared_vs_{base}" for base in PAIRS for fig in ("ttft", "throughput"))
TIER_FIGURES = {"total": "hit_rate", "device": "hit_rate_device", "host": "hit_rate_host",
                "storage": "hit_rate_storage"}  # fmt: skip


def execute(spec: BenchSpec) -> int:
    """Every configuration, `spec.repeats` times interleaved; writes the run's files like the
    single-server benchmark and prints the final JSON line. Exit status 0."""
    out = (spec.out_dir / time.strftime("run-%Y%m%d-%H%M%S")).resolve()  # servers get absolute paths
    out.mkdir(parents=True, exist_ok=True)
    model = run.resolve_model(spec.shape.model, spec.out_dir)
    order = run.schedule([c.name for c in CONFIGS], spec.repeats)
    cpus = server_cpus()
    runs: dict[str, list[run.SystemOutcome]] = {}
    lookups: dict[str, list[tuple[dict[str, float], ...]]] = {}
    for repeat, name in order:
        done = run_config(BY_NAME[name], spec, model, out, repeat, cpus)
        runs.setdefault(name, []).append(done.outcome)
        lookups.setdefault(name, []).append(done.by_server)
    measured = run.measured(runs)
    figures = aggregate.medians(measured)
    extra = {"out_dir": str(spec.out_dir), "model": spec.shape.model, "repeats": spec.repeats,
             "order": [f"{n}/r{r}" for r, n in order], "shape": asdict(spec.shape),
             "server_cpus": [None if c is None else list(c) for c in cpus],
             "tier_mb": {n: max(o.tier_bytes for o in os_) / 2**20 for n, os_ in runs.items()}}  # fmt: skip
    requests = {n: [r for rs in by.values() for r in rs] for n, by in run.results(runs).items()}
    line = final_line(figures, _lookup_totals(lookups), extra, requests)
    report.write(out, run.results(runs), figures, line, run.metrics(runs), measured)
    print(json.dumps(line, sort_keys=True), flush=True)
    return 0


def _lookup_totals(
    lookups: dict[str, list[tuple[dict[str, float], ...]]],
) -> dict[str, list[dict[str, float]]]:
    """Per configuration of ours, each server's lookup counters summed over repeats."""
    out: dict[str, list[dict[str, float]]] = {}
    for name, repeats in lookups.items():
        if BY_NAME[name].system == "ours":
            out[name] = [
                {c: sum(r[k].get(c, 0.0) for r in repeats) for c in LOOKUP_COUNTERS} for k in range(SERVERS)
            ]
    return out


def final_line(workloads: dict[str, dict[str, Figures]], lookups: dict[str, list[dict[str, float]]],
               extra: dict[str, Any], moved: dict[str, list[Result]] | None = None) -> dict[str, Any]:  # fmt: skip
    """The headline is the first workload: each configuration's figures (medians over repeats),
    `ours-shared` over the others (`RATIO_KEYS`), every workload's ratios, our lookup counters
    (summed over the servers, repeats and workloads; and per server) and, from `moved` (each
    configuration's requests), the share of resumed turns the router moved to the other server, over
    all repeats and per repeat."""
    moved = moved or {}
    head = next(iter(workloads), None)
    figures = workloads.get(head, {}) if head else {}
    line: dict[str, Any] = {
        "servers": SERVERS,
        "router": "smg round_robin",
        "hicache_config": STRONGEST_HICACHE,
        "headline_workload": head,
        "ttft_resume_p50_ms": {c: f.ttft_resume_p50_ms for c, f in figures.items()},
        "throughput_tok_s": {c: f.throughput_tok_s for c, f in figures.items()},
        "hit_rate": {c: {t: getattr(f, k) for t, k in TIER_FIGURES.items()} for c, f in figures.items()},
        **ratios(figures),
        "workloads": {w: ratios(fs) for w, fs in workloads.items()},
        "lookup_counters_total": {c: {k: sum(s[k] for s in by) for k in LOOKUP_COUNTERS} for c, by in lookups.items()},
        "lookup_counters_by_server": {c: {k: [s[k] for s in by] for k in LOOKUP_COUNTERS} for c, by in lookups.items()},
        "errors": sum(f.errors for fs in workloads.values() for f in fs.values()),
        "moved_rate": {c: moved_rate(rs) for c, rs in moved.items()},
        "moved_rate_by_repeat": {c: moved_rate_by_repeat(rs) for c, rs in moved.items()},
        **extra,
    }  # fmt: skip
    return report.clean(line)  # type: ignore[no-any-return]


def moved_rate(results: list[Result]) -> float:
    """Of the resumed turns whose server and previous turn's server are known (`Result.server`),
    the share served by the other server; NaN if none is known."""
    last: dict[tuple[int, str], str | None] = {}
    moved = known = 0
    for r in sorted(results, key=lambda r: (r.repeat, r.round)):
        conversation = (r.repeat, r.key.rsplit("r", 1)[0])  # keys are c<conversation>r<round>
        before = last.get(conversation)
        if r.resumed and r.server and before:
            known += 1
            moved += r.server != before
        last[conversation] = r.server
    return moved / known if known else NAN


def moved_rate_by_repeat(results: list[Result]) -> list[float]:
    """`moved_rate` of each repeat, in repeat order (a repeat whose router did not alternate shows)."""
    repeats = sorted({r.repeat for r in results})
    return [moved_rate([r for r in results if r.repeat == k]) for k in repeats]


def ratios(figures: dict[str, Figures]) -> dict[str, float]:
    """`ours-shared` over `PAIRS`: resumed-turn TTFT p50 and throughput; NaN where unmeasured."""
    shared = figures.get("ours-shared")
    out = {}
    for base, name in PAIRS.items():
        other = figures.get(name)
        for fig, attr in (("ttft", "ttft_resume_p50_ms"), ("throughput", "throughput_tok_s")):
            out[f"{fig}_shared_vs_{base}"] = (
                NAN if shared is None or other is None else ratio(getattr(shared, attr), getattr(other, attr))
            )
    return out
