"""`--servers 2`: two servers behind sglang's router (smg), in two families of configurations.

Each configuration runs two servers of one system (the run's `Shape`, so each has the device pool
and host budget a single server of `--servers 1` has) behind `smg`, on the multi-turn workloads
only (a trace's sessions would not move between servers in a known way).

**Sharing** (`Dispatch.ALTERNATE`): smg's `round_robin`, and the driver dispatches each round's
turns one after another in `drive.send_order` (the next one once the router has picked a server for
the last: sent at once, they would reach its round robin in any order; a smoke run kept half the
turns where they were), so the router puts every resumed turn on the other server than the
conversation's previous turn: the history it needs is on the other server, or on the tier. The
per-tier hit rates and the lookup counters show what was reused from where.

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
- `ours-mooncake`: `ours-shared` with the tier on a Mooncake Store (`--hicache-spill-backend
  mooncake`): a master on loopback started for the run, each server a client contributing
  `MOONCAKE_SEGMENT` of DRAM (`bench/mooncake_process.py`). The store is DRAM: the page-cache drops
  at the rounds' barriers touch only the directories of the others, so this compares a DRAM store
  over TCP loopback with files read cold from the disk.
- `ours-mooncake-by-group`: `ours-mooncake` reading a restore's chunks a call a layer group (the
  Mooncake config's `"load_calls": "by_group"`, as a layer-wise restore reads them) instead of in
  one call (`merged`, the default): the switch measured side by side (issue 40).
- `ours-mooncake-local`: `ours-mooncake` asking the master for the writer's own segment first (the
  Mooncake config's `"placement": "local"`) instead of leaving placement to it (`any`, the default:
  its random choice over both servers' segments): a server reads what it spilled itself by a memory
  copy, and what the other spilled always over TCP (issue 40).
- `ours-shared-sticky`, `ours-mooncake-sticky`, `ours-mooncake-local-sticky`: those three with each
  conversation kept on one server (`Dispatch.STICKY`: every round's turns sent in the same order, so
  the round robin gives each conversation the server of its previous turns, as a cache-aware router
  aims to): a server restores what it spilled itself, the case `placement` local is for.
- `hicache-mooncake`: `hicache-shared` with sglang's own `mooncake` L3 backend on such a store (the
  peer a Mooncake user would compare with): its own master, started the same way, each server a
  client contributing the same `MOONCAKE_SEGMENT`, over TCP on loopback. sglang gives that backend
  the `page_first_direct` host layout, whose copies are CUDA kernels; on CPU they are the CPU
  profile's torch versions (`sgl_hicache_cpu.page_first_direct`, installed with HiCache's other CPU
  patches). `mooncake_vs_hicache_mooncake` in the final line is ours on Mooncake against it.
- `ours-mooncake-standalone`, `ours-mooncake-standalone-sticky`, `hicache-mooncake-standalone`:
  `ours-mooncake`, `ours-mooncake-sticky` and `hicache-mooncake` in Mooncake's standalone mode: one
  real client (`mooncake_client`, `MooncakeRealClient`) started after the master holds both
  servers' `MOONCAKE_SEGMENT`s in one segment and talks to the master, and each server joins the
  store through it (`setup_dummy`: ours' `"real_client"`, sglang's `standalone_storage` and
  `client_server_address`), its staging (HiCache's host pool) shared memory the real client maps:
  a load is one call on loopback and a memory copy by the real client, whichever server wrote the
  object. The real client is not pinned to either server's CPUs, like the router: it does the copies
  the transfer engine threads of both servers did before (`mooncake_standalone_vs_*` in the final
  line). `hicache-mooncake-standalone` is skipped for now (`UNAVAILABLE`: sglang 0.5.23 registers
  its host pool in halves, which Mooncake 0.3.13's standalone client refuses).
- `lmcache-shared`: two sglang servers with `--enable-lmcache` on one LMCache daemon (LMCache's way
  to share: its multiprocess server is built to serve several engines), in the configuration
  `STRONGEST_LMCACHE` (`lmcache-disk`: L1 + an `fs` disk tier in one directory), its L1 both
  servers' host budgets together (ours-shared stages in two budgets too). The daemon is started for
  the run, unpinned like the router (`bench/lmcache_process.py`).

**Routing** (`Dispatch.SHUFFLED`: each round's turns sent one after another in a random order drawn
from the workload and the round, the same for the three, as clients' turns would arrive): two of
our servers, each on its own tier directory with our default policy, behind three routers:

- `route-round-robin`: smg's `round_robin`;
- `route-approx-tree`: smg's `cache_aware` over HTTP workers: its approximate radix tree of the
  requests it routed (the token ids as text), blind to what a server evicted or spilled;
- `route-kv-events`: smg's `cache_aware` over servers in sglang's gRPC mode (`GrpcServer`), routing by
  the index it builds from the KV events each server publishes; ours announces spilled pages as
  host blocks (`--hicache-spill-kv-events-medium cpu_pinned`), so a resumed turn goes to the server
  that holds its history, resident or spilled (docs/OPERATIONS.md, "Tier-aware routing");
- `route-round-robin-grpc`: the control for the front end: the same gRPC servers behind smg's
  `round_robin`. Over gRPC workers smg itself is the server's front end (it streams and
  detokenizes), over HTTP ones a proxy, so `route-kv-events` against `route-round-robin` mixes the
  routing with the transport; against this one it does not. The answers from smg over gRPC name
  no split of cached tokens by tier: those hit rates are total only (`Result.cached` None).

Both `cache_aware` routers poll their workers' load each second and run with smg's worker overload
protection off (`CACHE_AWARE_FLAGS`): its
KV-usage ceiling reads sglang's token usage, which counts a pool full of cached prefixes as used,
and would veto the matched server on every warm pool. `route-approx-tree-protected` is the
approximate tree with smg's defaults (protection on: a server at 0.8 KV usage or 8 waiting requests
leaves the routing), in case that is its stronger setting.

Each server runs, from its start, on its own share of the CPUs this process may use (`server_cpus`:
half of them each, contiguous; `OMP_NUM_THREADS` the share's size), as each instance of a deployment
has its own GPUs; the router and the driver are not pinned. Unpinned, each server's OpenMP threads
use every CPU and two servers fight over them: on 2 CPUs, one repeat of the multi-turn workload took
plain sglang's two servers 215 s unpinned and 14 s with one CPU each (a one-off diagnosis: README), and the systems suffered
unequally (sglang's idle scheduler spins, HiCache's yields the CPU), so the comparison measured the
oversubscription, not the caches. With a single CPU both servers share it. The final line names each
server's CPUs (`server_cpus`; null where the CPU profile is not installed: a GPU box, not pinned).

Configurations (all, or those `--configs` names) run one after another, `repeats` times in
interleaved order (`run.schedule`), each run on fresh servers, a fresh router, empty tier
directories, a fresh Mooncake master (and real client) and a fresh LMCache daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any, NamedTuple

from tqdm import tqdm

from benchmarks.bench import aggregate, drive, pagecache, report, run, systems
from benchmarks.bench.cluster_line import LOOKUP_COUNTERS, final_line, lookup_counters
from benchmarks.bench.drive import Dispatch
from benchmarks.bench.grpc_server import GrpcServer
from benchmarks.bench.lmcache_process import LMCacheDaemon, lmcache_flags
from benchmarks.bench.mooncake_process import MooncakeMaster, MooncakeRealClient
from benchmarks.bench.probe import delta, dir_bytes, scrape
from benchmarks.bench.router_process import RouterProcess
from benchmarks.bench.server_process import ServerProcess, install_reaper
from benchmarks.bench.spec import BenchSpec, Shape, SpecError
from sgl_hicache.config import MiB, MooncakeConfig

SERVERS = 2
STRONGEST_HICACHE = "hicache-wait-r2"
"""The HiCache configuration of `spec.HICACHE_CONFIGS` that `hicache-shared` runs: `wait_complete`
with sglang's default host ratio (the lowest resumed-turn TTFT of the single-server benchmark)."""

STRONGEST_LMCACHE = "lmcache-disk"
"""The LMCache configuration of `spec.LMCACHE_CONFIGS` that `lmcache-shared` runs: L1 and a disk tier
at LMCache's defaults; by the hit counts of docs/RESULTS.md ("LMCache at its strongest") no other
configuration served clearly more (by timings its best is not measured yet)."""

MOONCAKE_SEGMENT = 1024 * MiB
"""The DRAM each server contributes to the Mooncake Store of the `mooncake` configurations: more
than a run of the default workloads writes (its `spilled_bytes`), so the master never evicts, as
the others' tier directories (64 GiB by default) never fill."""


class Router(Enum):
    ROUND_ROBIN = "smg round_robin"
    APPROX_TREE = "smg cache_aware (approximate tree, HTTP workers)"
    APPROX_TREE_PROTECTED = "smg cache_aware (approximate tree, HTTP workers, worker overload protection on)"
    KV_EVENTS = "smg cache_aware (KV events, gRPC workers)"
    ROUND_ROBIN_GRPC = "smg round_robin (gRPC workers)"

    @property
    def grpc(self) -> bool:
        """Whether its workers are servers in sglang's gRPC mode."""
        return self in (Router.KV_EVENTS, Router.ROUND_ROBIN_GRPC)


class Store(Enum):
    DIRECTORY = "directory"  # a tier directory per server, or one shared
    MOONCAKE = "mooncake"  # a Mooncake Store: one master, each server a client
    LMCACHE = "lmcache"  # one LMCache daemon (and its disk tier directory), each server a client


@dataclass(frozen=True)
class ClusterConfig:
    name: str
    system: str  # a system of `systems.build`, run on each server
    shared: bool  # both servers on one tier directory (else one each); on Mooncake: one store; LMCache: one daemon
    flags: tuple[str, ...] = ()  # added to the system's command line
    store: Store = Store.DIRECTORY
    mooncake: tuple[tuple[str, Any], ...] = ()  # on Mooncake: settings over the store's (`MooncakeConfig`)
    standalone: bool = False  # on Mooncake: the servers join through one real client (`MooncakeRealClient`)
    router: Router = Router.ROUND_ROBIN
    dispatch: Dispatch = Dispatch.ALTERNATE  # how a round's turns are sent (`drive.send_order`)


WRITE_THROUGH = ("--hicache-spill-write-policy", "write_through")
EVENTS_MEDIUM = ("--hicache-spill-kv-events-medium", "cpu_pinned")
# smg's cache_aware sends a request that matches no worker's prefix well enough (a new conversation)
# to the least loaded worker, ties to the first in its list; it reads a worker's load from its load
# monitor (sglang's /v1/loads), polled every 10 s by default, not from the requests it has in
# flight. A round of this workload lasts a few seconds, so with the default every new conversation
# found both loads equal and went to the first server (21 of 24 requests in a --quick run); polled
# each second they split 12/12 (docs/RESULTS.md, "Routing"). A user would poll as often.
CACHE_AWARE_FLAGS = ("--disable-worker-overload-protection", "--load-monitor-interval", "1")


SHUFFLED = Dispatch.SHUFFLED
CONFIGS = (
    ClusterConfig("ours-shared", "ours", shared=True, flags=WRITE_THROUGH),
    ClusterConfig("ours-shared-write-back", "ours", shared=True),
    ClusterConfig("ours-separate", "ours", shared=False, flags=WRITE_THROUGH),
    ClusterConfig("hicache-shared", STRONGEST_HICACHE, shared=True),
    ClusterConfig("ours-mooncake", "ours", shared=True, flags=WRITE_THROUGH, store=Store.MOONCAKE),
    ClusterConfig("ours-mooncake-by-group", "ours", shared=True, flags=WRITE_THROUGH, store=Store.MOONCAKE,
                  mooncake=(("load_calls", "by_group"),)),
    ClusterConfig("ours-mooncake-local", "ours", shared=True, flags=WRITE_THROUGH, store=Store.MOONCAKE,
                  mooncake=(("placement", "local"),)),
    ClusterConfig("ours-shared-sticky", "ours", shared=True, flags=WRITE_THROUGH, dispatch=Dispatch.STICKY),
    ClusterConfig("ours-mooncake-sticky", "ours", shared=True, flags=WRITE_THROUGH, store=Store.MOONCAKE,
                  dispatch=Dispatch.STICKY),
    ClusterConfig("ours-mooncake-local-sticky", "ours", shared=True, flags=WRITE_THROUGH, store=Store.MOONCAKE,
                  mooncake=(("placement", "local"),), dispatch=Dispatch.STICKY),
    ClusterConfig("hicache-mooncake", STRONGEST_HICACHE, shared=True, store=Store.MOONCAKE),
    ClusterConfig("ours-mooncake-standalone", "ours", shared=True, flags=WRITE_THROUGH, store=Store.MOONCAKE,
                  standalone=True),
    ClusterConfig("ours-mooncake-standalone-sticky", "ours", shared=True, flags=WRITE_THROUGH,
                  store=Store.MOONCAKE, standalone=True, dispatch=Dispatch.STICKY),
    ClusterConfig("hicache-mooncake-standalone", STRONGEST_HICACHE, shared=True, store=Store.MOONCAKE,
                  standalone=True),
    ClusterConfig("lmcache-shared", STRONGEST_LMCACHE, shared=True, store=Store.LMCACHE),
    ClusterConfig("route-round-robin", "ours", shared=False, dispatch=SHUFFLED),
    ClusterConfig("route-approx-tree", "ours", shared=False, router=Router.APPROX_TREE, dispatch=SHUFFLED),
    ClusterConfig("route-approx-tree-protected", "ours", shared=False, router=Router.APPROX_TREE_PROTECTED,
                  dispatch=SHUFFLED),
    ClusterConfig("route-kv-events", "ours", shared=False, flags=EVENTS_MEDIUM, router=Router.KV_EVENTS,
                  dispatch=SHUFFLED),
    ClusterConfig("route-round-robin-grpc", "ours", shared=False, flags=EVENTS_MEDIUM,
                  router=Router.ROUND_ROBIN_GRPC, dispatch=SHUFFLED),
)  # fmt: skip
BY_NAME = {c.name: c for c in CONFIGS}

UNAVAILABLE_ON_CPU: dict[str, str] = {}
"""Configurations that cannot run with `--device cpu`, and why (none now: `hicache-mooncake`, the
last, runs on the CPU profile's page_first_direct copies)."""


UNAVAILABLE: dict[str, str] = {
    "hicache-mooncake-standalone": "sglang 0.5.23's mooncake L3 registers an MHA host pool's K and V halves "
    "apart, and Mooncake 0.3.13's standalone client registers only whole allocations (its servers fail "
    "at start: register_buffer -1)",
}
"""Configurations that cannot run with the installed sglang and Mooncake on any device, and why
(tests/bench/test_mooncake_real_client.py checks the Mooncake side of the reason)."""


def unavailable(config: ClusterConfig, shape: Shape) -> str | None:
    """Why `config` cannot run in this shape, or None."""
    if config.name in UNAVAILABLE:
        return UNAVAILABLE[config.name]
    return UNAVAILABLE_ON_CPU.get(config.name) if shape.device == "cpu" else None


def select(names: str | None) -> tuple[ClusterConfig, ...]:
    """The configurations `--configs` names (comma-separated; None: all), in `CONFIGS` order;
    SpecError naming the known ones for an unknown or empty list."""
    if names is None:
        return CONFIGS
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in BY_NAME]
    if unknown or not wanted:
        raise SpecError(
            f"--configs: unknown {', '.join(unknown) or '(none given)'} (known: {', '.join(BY_NAME)})"
        )
    return tuple(c for c in CONFIGS if c.name in wanted)


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
    """One run of one configuration: two fresh servers (server k on `cpus[k]`, started side by side),
    a router (and a Mooncake master, or an LMCache daemon), every multi-turn workload; the page cache
    of the tier directories is dropped at the rounds' barriers (clock stopped)."""
    outcome, vocab = run.SystemOutcome(), run.vocab_size(model)
    by_server: list[dict[str, float]] = [{} for _ in range(SERVERS)]
    grpc = config.router.grpc
    n = sum(m.concurrency * m.rounds for m in spec.multiturn)
    with contextlib.ExitStack() as stack:
        mooncake = _mooncake_store(stack, config, out, repeat) if config.store is Store.MOONCAKE else None
        servers = [systems.build(config.system, spec.shape, model, _root(out, config, k), mooncake=mooncake)
                   for k in range(SERVERS)]  # fmt: skip
        servers = [replace(s, flags=(*s.flags, *config.flags)) for s in servers]
        if config.store is Store.LMCACHE:
            servers = _on_one_daemon(stack, config, servers, out, repeat)
        tiers = sorted({s.tier_dir for s in servers if s.tier_dir is not None})

        def drop() -> None:
            if spec.drop_page_cache:
                outcome.page_cache.add(pagecache.drop(tiers))

        logs = [out / run.log_name(f"{config.name}-s{k}", repeat) for k in range(SERVERS)]
        procs = [
            s.server(model, log, share, grpc=grpc) for s, log, share in zip(servers, logs, cpus, strict=True)
        ]
        stack.callback(_each, procs, lambda p: p.stop())  # whatever happens below
        _start(procs)
        log = out / run.log_name(f"{config.name}-router", repeat)
        router = stack.enter_context(_router(config, procs, spec.shape, model, log))
        bar = stack.enter_context(
            tqdm(total=n, desc=f"{config.name:>22} r{repeat}", file=sys.stderr, unit="req")
        )
        named = str(model) if grpc else None  # smg routes a gRPC worker's requests by the model they name
        for salt, mt in enumerate(spec.multiturn, 1):
            work = drive.multiturn(router.base_url, mt, vocab, salt, drop, bar, config.dispatch, named)
            _record(outcome, by_server, procs, work, split=not grpc)
        outcome.tier_bytes = sum(dir_bytes(t) for t in tiers)
    for t in tiers:
        shutil.rmtree(t, ignore_errors=True)
    for results in outcome.results.values():
        for r in results:
            r.repeat = repeat
    return ClusterOutcome(outcome, tuple(by_server))


def _mooncake_store(
    stack: contextlib.ExitStack, config: ClusterConfig, out: Path, repeat: int
) -> MooncakeConfig:
    """Start the Mooncake Store of `config` (a master; `standalone`: and a real client holding every
    server's `MOONCAKE_SEGMENT`, after it), stopped when `stack` closes (the real client first); the
    settings its servers join it with."""
    logs = out / run.log_name(f"{config.name}-mooncake", repeat).removesuffix(".log")
    logs.mkdir(parents=True, exist_ok=True)
    master = MooncakeMaster(logs)
    store = stack.enter_context(master).config(segment_bytes=MOONCAKE_SEGMENT)
    if config.standalone:  # the master, the segment and the transport are the real client's
        client = stack.enter_context(
            MooncakeRealClient(master, logs, segment_bytes=SERVERS * MOONCAKE_SEGMENT)
        )
        store = MooncakeConfig(real_client=client.address, local_buffer_size=store.local_buffer_size)
    return replace(store, **dict(config.mooncake))


def _on_one_daemon(stack: contextlib.ExitStack, config: ClusterConfig, servers: list[systems.System],
                   out: Path, repeat: int) -> list[systems.System]:  # fmt: skip
    """Start one LMCache daemon for `servers` (an LMCache system, on one tier directory), its L1 their
    host budgets together, stopped when `stack` closes; the servers as its clients (no daemon of
    their own)."""
    own = servers[0].lmcache
    if own is None or not config.shared:
        raise TypeError(
            f"{config.name}: one LMCache daemon serves servers of an LMCache system on one directory"
        )
    daemon = LMCacheDaemon(replace(own, l1_mb=own.l1_mb * len(servers)),
                           out / run.log_name(f"{config.name}-lmcache", repeat))  # fmt: skip
    stack.enter_context(daemon)
    config_file = daemon.write_config(out / f"{config.name}-r{repeat}.lmcache.yaml")
    return [replace(s, lmcache=None, flags=(*s.flags, *lmcache_flags(config_file))) for s in servers]


def _router(config: ClusterConfig, procs: list[ServerProcess], shape: Shape, model: Path,
            log: Path) -> RouterProcess:  # fmt: skip
    """The router of `config` over `procs` (not started)."""
    if config.router is Router.ROUND_ROBIN:
        return RouterProcess([p.base_url for p in procs], log_path=log)
    if config.router is Router.APPROX_TREE:
        return RouterProcess(
            [p.base_url for p in procs], "cache_aware", log_path=log, extra_args=CACHE_AWARE_FLAGS
        )
    if config.router is Router.APPROX_TREE_PROTECTED:
        return RouterProcess([p.base_url for p in procs], "cache_aware", log_path=log)
    grpc = [p for p in procs if isinstance(p, GrpcServer)]
    if len(grpc) != len(procs):
        raise TypeError(f"{config.name}: its router takes servers in gRPC mode only")
    urls = [p.grpc_url for p in grpc]
    tokens = ("--block-size", str(shape.page_size), "--model-path", str(model))  # blocks are pages
    if config.router is Router.ROUND_ROBIN_GRPC:
        return RouterProcess(urls, log_path=log, extra_args=tokens)
    return RouterProcess(urls, "cache_aware", log_path=log, extra_args=(*tokens, *CACHE_AWARE_FLAGS))


def _root(out: Path, config: ClusterConfig, server: int) -> Path:
    """Where `systems.build` puts server `server`'s tier (`<root>/tier-<system>`)."""
    root = out / config.name if config.shared else out / config.name / f"s{server}"
    root.mkdir(parents=True, exist_ok=True)
    return root


def _record(outcome: run.SystemOutcome, by_server: list[dict[str, float]], procs: list[ServerProcess],
            work: Coroutine[Any, Any, drive.Driven], split: bool) -> None:  # fmt: skip
    """`work`'s results and the servers' `/metrics` deltas; `split` False: the answers name no
    split of cached tokens by tier (smg over gRPC workers), which the results then leave unknown."""
    before = [_scrape(p) for p in procs]  # `work` starts only below
    driven = asyncio.run(work)
    for r in driven.results if not split else ():
        r.cached = None
    moved = [delta(_scrape(p), b) for p, b in zip(procs, before, strict=True)]
    summed: dict[str, float] = {}
    for m, counters in zip(moved, by_server, strict=True):
        for k, v in m.items():
            summed[k] = summed.get(k, 0.0) + v
        for name, v in lookup_counters(m).items():
            counters[name] = counters.get(name, 0.0) + v
    outcome.metrics[driven.workload] = summed
    outcome.results[driven.workload] = driven.results
    outcome.wall_s[driven.workload] = driven.wall_s


def _each(procs: list[ServerProcess], do: Callable[[ServerProcess], object]) -> None:
    """`do` to every server at once (a stop takes seconds); the first error raised once all are done."""
    with ThreadPoolExecutor(len(procs)) as pool:
        list(pool.map(do, procs))


def _start(procs: list[ServerProcess]) -> None:
    """Start the servers side by side, each on its own CPUs. Once one fails, the others are stopped
    (a booting one then fails at once: its process is gone) and the first failure is raised."""
    install_reaper()  # from this, the main thread: the starts below run in others
    with ThreadPoolExecutor(len(procs)) as pool:
        pending = [pool.submit(p.start) for p in procs]
        failed: BaseException | None = None
        for done in as_completed(pending):
            if (e := done.exception()) is not None and failed is None:
                failed = e
                for p in procs:
                    p.stop()
    if failed is not None:
        raise failed


def _scrape(proc: ServerProcess) -> dict[str, float]:
    """A server's `/metrics` (a gRPC-mode server's sidecar, under an HTTP server's names)."""
    return proc.metrics() if isinstance(proc, GrpcServer) else scrape(proc.base_url)


def execute(spec: BenchSpec, configs: tuple[ClusterConfig, ...] = CONFIGS) -> int:
    """Each of `configs` that can run in `spec.shape` (the others are named in the final line's
    `skipped`, with why), `spec.repeats` times interleaved; writes the run's files like the
    single-server benchmark and prints the final JSON line. Exit status 0."""
    skipped = {c.name: why for c in configs if (why := unavailable(c, spec.shape)) is not None}
    if len(skipped) == len(configs):  # refused before the model is built (minutes on a fresh machine)
        raise SpecError(
            f"--configs: none of {', '.join(skipped)} can run here: {'; '.join(skipped.values())}"
        )
    model = run.resolve_model(spec.shape.model, spec.out_dir)
    used = {c.system for c in configs if c.name not in skipped}
    history = max(m.context_tokens() for m in spec.multiturn)
    systems.check_hicache_holds(used, spec.shape, model, history)  # before any server, as the bench
    systems.check_runnable(used, spec.shape, model, spec.out_dir)
    out = (spec.out_dir / time.strftime("run-%Y%m%d-%H%M%S")).resolve()  # servers get absolute paths
    out.mkdir(parents=True, exist_ok=True)
    order = run.schedule([c.name for c in configs if c.name not in skipped], spec.repeats)
    cpus = server_cpus()
    runs: dict[str, list[run.SystemOutcome]] = {}
    lookups: dict[str, list[tuple[dict[str, float], ...]]] = {}
    for finished, (repeat, name) in enumerate(order, 1):
        done = run_config(BY_NAME[name], spec, model, out, repeat, cpus)
        runs.setdefault(name, []).append(done.outcome)
        lookups.setdefault(name, []).append(done.by_server)
        _keep_partial(out / "partial", runs, {"runs_done": finished, "runs": len(order)})
    measured = run.measured(runs)
    figures = aggregate.medians(measured)
    extra = {"servers": SERVERS, "hicache_config": STRONGEST_HICACHE, "out_dir": str(spec.out_dir),
             "model": spec.shape.model, "repeats": spec.repeats, "order": [f"{n}/r{r}" for r, n in order],
             "shape": asdict(spec.shape), "server_cpus": [None if c is None else list(c) for c in cpus],
             "router": {n: BY_NAME[n].router.value for n in runs}, "skipped": skipped,
             "tier_mb": {n: max(o.tier_bytes for o in os_) / 2**20 for n, os_ in runs.items()
                         if BY_NAME[n].store is not Store.MOONCAKE}}  # fmt: skip
    requests = {n: [r for rs in by.values() for r in rs] for n, by in run.results(runs).items()}
    line = final_line(figures, _lookup_totals(lookups), extra, requests)
    report.write(out, run.results(runs), figures, line, run.metrics(runs), measured)
    print(json.dumps(line, sort_keys=True), flush=True)
    return 0


def _keep_partial(where: Path, runs: dict[str, list[run.SystemOutcome]], line: dict[str, Any]) -> None:
    """Every finished run's requests so far, so that a benchmark stopped midway keeps what it
    measured. A write that fails (a full disk) is said on stderr and does not stop the runs."""
    try:
        report.write(where, run.results(runs), {}, line)
    except OSError as e:
        print(f"warning: could not write {where}: {e}", file=sys.stderr, flush=True)


def _lookup_totals(
    lookups: dict[str, list[tuple[dict[str, float], ...]]],
) -> dict[str, list[dict[str, float]]]:
    """Per configuration of ours, each server's counters (`LOOKUP_COUNTERS`) summed over repeats."""
    out: dict[str, list[dict[str, float]]] = {}
    for name, repeats in lookups.items():
        if BY_NAME[name].system == "ours":
            out[name] = [
                {c: sum(r[k].get(c, 0.0) for r in repeats) for c in LOOKUP_COUNTERS} for k in range(SERVERS)
            ]
    return out
