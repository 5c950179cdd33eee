"""One benchmark run: each system, `repeats` times, on the same model, shape and workloads.

Systems run one after another (this machine cannot host several servers side by side), each run on
a fresh server and an empty tier directory, with the same token ids. The order is interleaved
(`schedule`): every repeat is one pass over all systems, and each pass starts at another system, so
no system always runs first (cold machine) or last. Within a run the workloads go back to back on
one server; their token ids differ (salted), so one workload's KV never serves another's requests.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.bench import drive, pagecache, systems, trace
from benchmarks.bench.agents import send_order
from benchmarks.bench.aggregate import Measured
from benchmarks.bench.client import Result
from benchmarks.bench.disk_writes import WriteMeter
from benchmarks.bench.lmcache_process import LMCacheServer
from benchmarks.bench.probe import Sampler, delta, dir_bytes, scrape
from benchmarks.bench.server_process import ServerProcess
from benchmarks.bench.spec import BenchSpec, SpecError
from benchmarks.bench.summary import NAN, summarize
from benchmarks.bench.workload import Request


@dataclass
class SystemOutcome:
    results: dict[str, list[Result]] = field(default_factory=dict)  # per workload
    wall_s: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # /metrics deltas per workload
    written: dict[str, float] = field(
        default_factory=dict
    )  # bytes written to disk per workload (NaN: unknown)
    rss_peak_mb: float = 0.0
    tier_bytes: int = 0  # on disk at the end of the run
    page_cache: set[str] = field(default_factory=set)  # how the page cache was dropped


def schedule(systems: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, system) in run order: pass `r` runs every system, rotated to start at system
    `r * len(systems) // repeats`, so the starting positions spread over the list."""
    order = []
    for r in range(repeats):
        k = r * len(systems) // repeats
        order += [(r, s) for s in (*systems[k:], *systems[:k])]
    return order


def resolve_model(name: str, cache_dir: Path) -> Path:
    """`smollm2` (built once into the shared model cache), a generated size (built once into
    `cache_dir`) or an existing model directory."""
    from benchmarks.modelgen import ModelBuildError, build_smollm2, default_model_dir
    from benchmarks.modelgen.generate import SIZES, generate_model

    if name == "smollm2":
        try:
            return build_smollm2(default_model_dir())
        except ModelBuildError as e:
            raise SpecError(str(e)) from None

    if name in SIZES:
        out = cache_dir / f"model-{name}"
        stamp = out / "sgl_hicache_model.json"
        if not (stamp.exists() and json.loads(stamp.read_text()) == {"size": name, "seed": 0}):
            generate_model(out, name, seed=0)
        return out
    path = Path(name)
    if not (path / "config.json").is_file():
        raise SpecError(
            f"model {name!r} is neither smollm2, a generated size ({', '.join(SIZES)}) nor a model directory"
        )
    return path


def vocab_size(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


@dataclass(frozen=True)
class Replay:
    """One trace's requests, replayed as the workload `name`."""

    name: str
    requests: list[Request]


def trace_requests(spec: BenchSpec, vocab: int) -> list[Replay]:
    return [Replay(t.name, trace.to_requests(trace.load(t), t, vocab)) for t in spec.traces]


def history_tokens(spec: BenchSpec, replays: list[Replay]) -> int:
    """The longest history a request of the run resumes: a conversation's whole, an agent's context
    before its last turn, a trace request's prefix sent before."""
    agents = (
        max((max(spec.agents.plan(i)) for i in range(spec.agents.count)), default=0) if spec.agents else 0
    )
    return max([agents, *(m.context_tokens() for m in spec.multiturn),
                *(r.prefix_tokens for replay in replays for r in replay.requests)])  # fmt: skip


def run_system(
    name: str, spec: BenchSpec, model: Path, workdir: Path, replays: list[Replay], repeat: int = 0
) -> SystemOutcome:
    """One run of one system: a fresh server, every workload, results tagged with `repeat`; the
    page cache is dropped at the workloads' barriers, outside their timed windows."""
    tokens = sum(m.concurrency * (m.context_tokens() + m.question_tokens) for m in spec.multiturn)
    tokens += sum(len(r.input_ids) + r.output_tokens for replay in replays for r in replay.requests)
    tokens += spec.agents.total_tokens() if spec.agents else 0
    system = systems.build(name, spec.shape, model, workdir, workload_tokens=tokens)
    outcome = SystemOutcome()
    vocab = vocab_size(model)
    tiers = [d for d in (system.tier_dir,) if d is not None]

    def drop() -> None:
        if spec.drop_page_cache:
            outcome.page_cache.add(pagecache.drop(tiers))

    def evict() -> None:  # inside a timed window: clean pages only
        if spec.drop_page_cache:
            pagecache.drop(tiers, write_back=False)

    n = sum(m.concurrency * m.rounds for m in spec.multiturn) + sum(len(r.requests) for r in replays)
    n += len(send_order(spec.agents)) if spec.agents else 0
    with (
        system.server(model, workdir / log_name(name, repeat)) as server,
        Sampler(server.proc.pid if server.proc else 0, also=_daemons(server)) as rss,
        tqdm(total=n, desc=f"{name:>22} r{repeat}", file=sys.stderr, unit="req") as bar,
    ):
        meter = WriteMeter(lambda: _processes(server))
        for salt, mt in enumerate(spec.multiturn, 1):
            work = drive.multiturn(server.base_url, mt, vocab, salt, drop, bar)
            _record(outcome, server.base_url, work, meter)
        if spec.agents is not None:
            _record(
                outcome,
                server.base_url,
                drive.agents(server.base_url, spec.agents, vocab, 1, drop, bar),
                meter,
            )
        for replay in replays:
            work = drive.replay(server.base_url, replay.requests, drop, bar, evict, replay.name)
            _record(outcome, server.base_url, work, meter)
        outcome.tier_bytes = dir_bytes(system.tier_dir)
    outcome.rss_peak_mb = rss.peak_rss_mb
    if system.tier_dir is not None:
        shutil.rmtree(system.tier_dir, ignore_errors=True)
    for results in outcome.results.values():
        for r in results:
            r.repeat = repeat
    return outcome


def _processes(server: ServerProcess) -> tuple[int, ...]:
    """The roots of the process trees whose disk writes are the system's: the server's and its daemons'."""
    return ((server.proc.pid,) if server.proc is not None else ()) + _daemons(server)


def _daemons(server: ServerProcess) -> tuple[int, ...]:
    """The processes beside `server` whose memory is its cache's: an LMCache server's daemon (its L1)."""
    daemon = server.daemon if isinstance(server, LMCacheServer) else None
    return (daemon.proc.pid,) if daemon is not None and daemon.proc is not None else ()


def measured(
    runs: dict[str, list[SystemOutcome]], kv_bytes_per_token: int = 0
) -> dict[str, dict[str, Measured]]:
    """Per workload and system, the figures of every repeat (`kv_bytes_per_token`: the model's, for
    the bytes restored; 0: not known)."""
    out: dict[str, dict[str, Measured]] = {}
    for name, outcomes in runs.items():
        for w in outcomes[0].results:
            per_repeat = tuple(summarize(o.results[w], o.wall_s[w], o.metrics[w], o.written.get(w, NAN),
                                         kv_bytes_per_token) for o in outcomes)  # fmt: skip
            out.setdefault(w, {})[name] = Measured(per_repeat)
    return out


def results(runs: dict[str, list[SystemOutcome]]) -> dict[str, dict[str, list[Result]]]:
    out: dict[str, dict[str, list[Result]]] = {}
    for name, outcomes in runs.items():
        for o in outcomes:
            for w, rs in o.results.items():
                out.setdefault(name, {}).setdefault(w, []).extend(rs)
    return out


def metrics(runs: dict[str, list[SystemOutcome]]) -> dict[str, dict[str, dict[str, float]]]:
    """How each `/metrics` series moved per system and workload, summed over repeats."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, outcomes in runs.items():
        for o in outcomes:
            for w, moved in o.metrics.items():
                acc = out.setdefault(name, {}).setdefault(w, {})
                for k, v in moved.items():
                    acc[k] = acc.get(k, 0.0) + v
    return out


def log_name(system: str, repeat: int) -> str:
    return f"{system}-r{repeat}.log"


def _record(outcome: SystemOutcome, base_url: str, work: Coroutine[Any, Any, drive.Driven],
            meter: WriteMeter | None = None) -> None:  # fmt: skip
    """Run `work` (a workload on the server at `base_url`) and keep what it measured, with how
    `/metrics` moved and (given a `meter`) the bytes the system wrote to disk meanwhile. A server
    that died (a peer's scheduler can raise) fails its requests, which count as errors; its metrics
    are then left out, the run goes on."""
    before = _scrape_alive(base_url)  # `work` starts only below
    if meter is not None:
        meter.start()
    driven = asyncio.run(work)
    outcome.written[driven.workload] = meter.stop() if meter is not None else NAN
    after = _scrape_alive(base_url)
    if after is None:
        print(
            f"bench: {base_url} does not answer after {driven.workload} (its server died?)", file=sys.stderr
        )
    outcome.metrics[driven.workload] = {} if before is None or after is None else delta(after, before)
    outcome.results[driven.workload] = driven.results
    outcome.wall_s[driven.workload] = driven.wall_s


def _scrape_alive(base_url: str) -> dict[str, float] | None:
    """`/metrics`, or None when nothing answers there (connection refused or reset)."""
    try:
        return scrape(base_url)
    except OSError:  # urllib's URLError included
        return None
