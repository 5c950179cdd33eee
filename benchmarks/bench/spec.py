"""What one benchmark run measures: the fixed workload shape, the workloads and the gate.

Every system in a run gets the same `Shape` (model, device pool, host-memory budget, page size), so
the only difference between them is the cache. `--quick` and the full run are two presets of the
same dataclasses; the CLI overrides single fields.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.bench.lmcache_process import L2

if TYPE_CHECKING:  # agents.py builds on this module (SpecError, Shape)
    from benchmarks.bench.agents import Agents


class SpecError(ValueError):
    """A benchmark setting that cannot work; the message is one line for the user."""


class HostPool(Enum):
    """How a HiCache configuration sizes its host pool."""

    DEFAULT = "default"  # sglang's default --hicache-ratio for the memory mode (passed explicitly,
    # so sglang's host-memory auto-sizing cannot shrink it)
    # The device pool + the run's host budget (the bound of our staging). In `cache` mode HiCache's
    # host pool holds a copy of every device-resident node and evicts only nodes already gone from the
    # device, so only host - device is extra cache: a host pool of the budget alone (about the device
    # pool) found 576 of 8,192 tokens (docs/RESULTS.md); this one gives HiCache the budget as extra cache.
    BUDGET = "budget"


SGLANG_DEFAULT_PREFETCH_POLICY = "timeout"  # --hicache-storage-prefetch-policy's default in sglang 0.5.23


@dataclass(frozen=True)
class HiCacheConfig:
    """One configuration of sglang HiCache (host-memory L2 + an L3 backend) that a run measures."""

    name: str
    prefetch_policy: str  # --hicache-storage-prefetch-policy
    host: HostPool
    memory_mode: str = "cache"  # --hicache-host-memory-mode (sglang's default: cache)
    # `timeout` only: its prefetch timeouts tuned to the disk's measured read speed
    # (`disk_speed.tuned_timeouts`), not sglang's defaults (1 s + 0.25 s per 1024 tokens)
    tuned_timeout: bool = False
    backend: str = "file"  # --hicache-storage-backend: `file`, or `nixl` (GPU only, `nixl` installed)

    def __post_init__(self) -> None:
        if self.tuned_timeout and self.prefetch_policy != "timeout":
            raise ValueError(f"{self.name}: tuned timeouts are for the timeout prefetch policy")

    @property
    def default_ratio(self) -> float:
        return 1.2 if self.memory_mode == "buffer_only" else 2.0

    @property
    def label(self) -> str:
        """What it is, in words, for the final line: which of its settings are sglang's defaults."""
        policy = self.prefetch_policy + (
            " (sglang's default)" if self.prefetch_policy == SGLANG_DEFAULT_PREFETCH_POLICY else ""
        )
        if self.prefetch_policy == "timeout":
            policy += (
                " with its timeouts tuned to the disk's measured read speed"
                if self.tuned_timeout
                else " at sglang's default timeouts"
            )
        host = (
            f"host pool {self.default_ratio:g} x device (sglang's default ratio)"
            if self.host is HostPool.DEFAULT
            else "host pool = device + the host budget"
        )
        return f"prefetch {policy}, {self.memory_mode} mode, {host}, {self.backend} L3"

    def cache_tokens(self, host_tokens: int, pool_tokens: int) -> int:
        """Of a host pool of `host_tokens`, what can hold KV that is not on the device (a history to
        restore): in `cache` mode the host pool also holds a copy of every device-resident node, so a
        full device pool leaves host - device; `buffer_only` is staging only, all of it."""
        return host_tokens if self.memory_mode == "buffer_only" else host_tokens - pool_tokens


HICACHE_CONFIGS = (
    HiCacheConfig("hicache-wait-r2", "wait_complete", HostPool.DEFAULT),
    HiCacheConfig("hicache-timeout-r2", "timeout", HostPool.DEFAULT),  # sglang's defaults
    HiCacheConfig("hicache-wait-budget", "wait_complete", HostPool.BUDGET),
    HiCacheConfig("hicache-timeout-budget", "timeout", HostPool.BUDGET),
    HiCacheConfig("hicache-timeout-tuned", "timeout", HostPool.BUDGET, tuned_timeout=True),
    HiCacheConfig("hicache-buffer", "wait_complete", HostPool.DEFAULT, memory_mode="buffer_only"),
    HiCacheConfig("hicache-nixl", "wait_complete", HostPool.DEFAULT, backend="nixl"),
)
"""Every HiCache configuration that can be named; the gate judges ours against the best of those
run, per workload and figure (`summary.best_of`). `timeout` is sglang's default prefetch policy, at
its default timeouts (`-r2`, `-budget`) or tuned to the disk (`-tuned`, `disk_speed`); `-budget`:
host pool = device pool + the run's host budget (`HostPool.BUDGET`); `hicache-nixl`: the `nixl` L3
backend, refused in one line without the `nixl` package or a GPU (`systems.nixl_unavailable`)."""
HICACHE = {c.name: c for c in HICACHE_CONFIGS}


@dataclass(frozen=True)
class LMCacheConfig:
    """One configuration of LMCache (its multiprocess daemon beside sglang's `--enable-lmcache`) that
    a run measures, at the memory ours gets: its L1 is the run's host budget, its disk tier (if any)
    a directory on the same disk as ours' tier."""

    name: str
    l2: L2  # L2.NONE: L1 only; FS: `fs`, unbounded; FS_NATIVE: `fs_native` capped at ours' tier capacity
    chunk_size: int = 256  # LMCache's default; it stores and finds whole chunks only
    l2_store_policy: str = "default"  # `skip_l1`: a chunk leaves L1 once on disk (`DaemonSpec`)

    @property
    def label(self) -> str:
        """What it is, in words, for the final line."""
        disk = {L2.NONE: "no disk tier", L2.FS: "fs disk tier (unbounded)",
                L2.FS_NATIVE: "fs_native disk tier capped at ours' tier capacity (LRU)"}[self.l2]  # fmt: skip
        if self.l2 is not L2.NONE:
            disk += f", L2 store policy {self.l2_store_policy}"
        default = " (LMCache's default)" if self.chunk_size == 256 else ""
        return f"L1 = the host budget, {disk}, chunk {self.chunk_size}{default}"


LMCACHE_CONFIGS = (
    LMCacheConfig("lmcache-disk", L2.FS),
    LMCacheConfig("lmcache-disk-c64", L2.FS, chunk_size=64),
    LMCacheConfig("lmcache-disk-skip-l1", L2.FS, l2_store_policy="skip_l1"),
    LMCacheConfig("lmcache-fs-native", L2.FS_NATIVE),
)
"""The LMCache configurations a user would pick, each with L1 = the host budget and a disk tier on
the same disk as ours' (docs/RESULTS.md, "LMCache at its strongest", has the hit counts that chose
them): LMCache's defaults (chunk 256, `--l2-store-policy default`, `--l2-prefetch-policy default`)
with its `fs` tier; chunk 64, which also stores and finds a prompt's last partial 256-token stretch;
`--l2-store-policy skip_l1`, which keeps L1 free for loads from disk (with `default` a full L1
refuses them); and `fs_native` capped at ours' tier capacity (the same disk budget). L1 alone served
fewer tokens than the same L1 with a disk tier in every pairing (dominated, dropped);
`--l2-prefetch-policy retain` and `--eviction-trigger-watermark 0.5` moved the counts no more than
two runs of one configuration differ (not offered). The run reports the best of them per workload
and figure (`summary.best_of`)."""
LMCACHE = {c.name: c for c in LMCACHE_CONFIGS}

OURS_FLAGS = {
    "ours": (),
    "ours-reused": ("--hicache-spill-admission", "reused"),
    "ours-layerwise": ("--hicache-spill-layerwise",),
    "ours-nohold": ("--hicache-spill-extra-config", '{"admission_hold": 0}'),
    "ours-reserve": ("--hicache-spill-extra-config", '{"restore_reserve": true}'),
    "ours-keepreads": ("--hicache-spill-extra-config", '{"take_back_reads": false}'),
    "ours-ordered": (
        "--hicache-spill-extra-config",
        '{"restores_in_order": true, "restores_take_back": true}',
    ),
    "ours-restore-takeback": ("--hicache-spill-extra-config", '{"restores_take_back": true}'),
}
"""Ours and its variants, by the flags they add to ours' defaults: `ours-reused` writes only reused,
hinted, pinned or long nodes to the tier (issue 37's admission rule, measured against the default on
`agents`); `ours-layerwise` starts a resumed prefill before its restore has landed (issue 37:
admitted once the first layer group is read, not after every read: on `agents` a deferred
admission waits for the forward then running); `ours-nohold` never holds a first admission attempt
for its reads in flight (`admission_hold` 0: every such request deferred a round, as before the
hold), the control for measuring the hold; `ours-reserve` keeps eviction spills from the room in
staging a restore waiting for it needs (`restore_reserve` true; off by default, measured no
better: docs/RESULTS.md); `ours-keepreads` drops an eviction's victim when staging is full rather
than take back prefetched reads landed for queued requests (`take_back_reads` false: the control for
measuring it); `ours-ordered` lets no queued restore start a read while another waits for room in
staging, and a waiting restore take back prefetched reads (`restores_in_order` and
`restores_take_back` true; both off by default, measured worse on `agents`: docs/RESULTS.md);
`ours-restore-takeback` has the take-back alone (`restores_take_back` true)."""

SYSTEMS = ("recompute", *HICACHE, *LMCACHE, *OURS_FLAGS, "resident")
"""Every system that can be named: (a) sglang's default cache, evicted KV is recomputed; (b) sglang
HiCache with host memory and an L3 backend, in each configuration of `HICACHE_CONFIGS`; (b') LMCache,
in each configuration of `LMCACHE_CONFIGS`; (c) sgl_hicache's spill tier (and its variants,
`OURS_FLAGS`); and a reference: sglang's default cache with a pool that holds the whole workload
(every reusable prefix a device hit)."""

DEFAULT_SYSTEMS = (
    "recompute",
    "hicache-wait-r2",
    "hicache-wait-budget",
    "lmcache-disk",
    "lmcache-disk-c64",
    "ours",
    "resident",
)
"""What a run compares unless `--systems` says otherwise: (a), (c), the reference, and the
configurations of each peer that were its strongest in the measured runs (docs/RESULTS.md), so a
user comparing sees each peer at its best without running every configuration (all 14 doubles a
run's time)."""

FAMILIES = {"hicache": tuple(HICACHE), "lmcache": tuple(LMCACHE)}
"""Each peer's configurations: the best of them is what ours is set against (`summary.best_of`)."""

GPU_ONLY = frozenset(c.name for c in HICACHE_CONFIGS if c.backend == "nixl")
"""Configurations that run on a GPU only: `hicache`/`all` in `--systems` include them with `--device
cuda` alone; named on their own anywhere else they are refused (`systems.nixl_unavailable`)."""


def expand_systems(names: str, device: str = "cpu", universe: tuple[str, ...] = SYSTEMS) -> tuple[str, ...]:
    """`--systems`: comma-separated names of `universe`; `hicache`/`lmcache` mean all of that peer's
    configurations and `all` every system, those that run on `device` (`GPU_ONLY`); in `universe`
    order."""
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    groups = {**FAMILIES, "all": universe}
    for group, members in groups.items():
        if group in wanted:
            wanted = (wanted - {group}) | {m for m in members if device == "cuda" or m not in GPU_ONLY}
    unknown = sorted(wanted - set(universe))
    if unknown or not wanted:
        what = f"unknown system(s) {unknown}" if unknown else "no system given"
        raise SpecError(f"{what}; choose from all, hicache, lmcache, {', '.join(universe)}")
    return tuple(s for s in universe if s in wanted)


DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class Shape:
    """The serving setup every system shares. The defaults (with those of `MultiTurn`, `Trace` and
    `BenchSpec.repeats`) sized the full run to about 30 minutes on a quiet 2-vCPU machine with
    SmolLM2-135M: 8 systems x 3 repeats, each a fresh server (~30 s to start and stop); the default
    systems (`DEFAULT_SYSTEMS`, 7) keep it there, `--systems all` (14) about doubles it."""

    model: str = "smollm2"  # smollm2 (SmolLM2-135M-Instruct), a generated size (tiny, small) or a directory
    pool_tokens: int = 2048  # --max-total-tokens: the device KV pool
    # Our staging bound; what the *-budget HiCache configurations add to the device pool in their
    # host pool; LMCache's L1. 96 MiB is at least sglang's default HiCache host pool for this device
    # pool (ratio 2: 4096 SmolLM2 tokens of 22.5 KiB = 90 MiB), so no system has less host memory
    # than HiCache at its default, and it holds ours' eviction bursts on this workload (at 64 MiB
    # two spills were refused for staging).
    host_budget_mb: int = 96
    # HiCache's `file` backend writes one file per page: at page size 1 that is a file per token,
    # a configuration nobody would run; 16 is served correctly by all three systems on CPU.
    page_size: int = 16
    chunked_prefill: int = 2048
    # cpu (here) or cuda (your GPU box): every system runs with sglang's defaults for that device
    device: str = "cpu"
    # The disk's cold read speed, MiB/s, that `hicache-timeout-tuned` is tuned to (`--disk-read-mib-s`,
    # else measured at the start of a run that has it: `disk_speed.measure_read_mib_s`)
    disk_read_mib_s: float | None = None

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise SpecError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.disk_read_mib_s is not None and not self.disk_read_mib_s > 0:
            raise SpecError(f"disk read speed must be > 0 MiB/s, got {self.disk_read_mib_s}")
        if self.pool_tokens < 256:
            raise SpecError(f"pool_tokens must be >= 256, got {self.pool_tokens}")
        if self.host_budget_mb < 1:
            raise SpecError(f"host_budget_mb must be >= 1, got {self.host_budget_mb}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise SpecError(f"page_size must be a power of two, got {self.page_size}")


@dataclass(frozen=True)
class MultiTurn:
    """Closed-loop multi-turn chat: `concurrency` conversations run side by side for `rounds`
    rounds; each turn is the conversation so far (previous prompts and answers) plus a new
    question. Rounds are separated by a barrier, where the page cache is dropped."""

    concurrency: int = 8
    rounds: int = 3
    first_tokens: int = 512  # the opening prompt (system prompt + first question)
    question_tokens: int = 64
    output_tokens: int = 16

    def __post_init__(self) -> None:
        for name in ("concurrency", "rounds", "first_tokens", "question_tokens", "output_tokens"):
            if getattr(self, name) < 1:
                raise SpecError(f"multi-turn {name} must be >= 1, got {getattr(self, name)}")

    @property
    def name(self) -> str:
        return f"multiturn_c{self.concurrency}"

    def context_tokens(self) -> int:
        """Tokens a conversation holds after its last round."""
        return self.first_tokens + (self.rounds - 1) * self.question_tokens + self.rounds * self.output_tokens


class Cut(Enum):
    """Which requests of a trace file a replay keeps, at most `Trace.requests` of them."""

    FIRST = "first"  # the first lines
    # whole conversations (the requests that share their first hash id), in the order of their first
    # request, each one that still fits: a conversation's later turns are what a cache serves
    CONVERSATIONS = "conversations"


@dataclass(frozen=True)
class Trace:
    """Open-loop replay of a Mooncake-format trace (a file, or one synthesized from `seed`)."""

    path: Path | None = None
    requests: int = 16  # replay at most this many (synthesized: exactly this many)
    time_scale: float = 0.5  # arrival times are multiplied by this
    token_scale: float = 0.125  # block, input and output lengths are multiplied by this
    seed: int = 0
    name: str = "trace"  # the workload's name in results
    salt: int = 0  # token ids differ between replays of different salts (of one trace, on one server)
    cut: Cut = Cut.FIRST

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise SpecError(f"trace requests must be >= 1, got {self.requests}")
        if not (self.time_scale > 0 and self.token_scale > 0):
            raise SpecError("trace time and token scales must be > 0")
        if self.path is not None and not Path(self.path).is_file():
            raise SpecError(f"trace file not found: {self.path}")


@dataclass(frozen=True)
class Compared:
    """A figure on which ours is set against the best configuration of each peer."""

    key: str  # its name in the final line: `<key>_vs_best_<peer>`, `best_<peer>_config_<key>`
    field: str  # the `summary.Figures` field
    higher_is_better: bool
    label: str  # in words, for a failed gate's reason


COMPARED = (
    Compared("ttft", "ttft_resume_p50_ms", False, "resumed TTFT p50"),
    Compared("throughput", "throughput_tok_s", True, "throughput"),
)
"""Every figure compared with the peers; the first is the one `best_<peer>_config` names the best
configuration at. Another figure of `Figures` is compared by adding it here."""
COMPARED_BY_KEY = {c.key: c for c in COMPARED}


@dataclass(frozen=True)
class Target:
    """Ours' `figure` over the best configuration of each peer: at most `bound` for a figure where
    lower is better, at least `bound` where higher is."""

    figure: str  # a key of COMPARED
    bound: float

    def __post_init__(self) -> None:
        if self.figure not in COMPARED_BY_KEY or not self.bound > 0:
            raise ValueError(
                f"a target is a figure of {sorted(COMPARED_BY_KEY)} and a bound > 0, got {self.figure!r}, {self.bound}"
            )

    @property
    def compared(self) -> Compared:
        return COMPARED_BY_KEY[self.figure]

    def met(self, ratio: float) -> bool:
        """NaN (not measured) never meets a target."""
        if math.isnan(ratio):
            return False
        return ratio >= self.bound if self.compared.higher_is_better else ratio <= self.bound

    def __str__(self) -> str:
        return f"{'>=' if self.compared.higher_is_better else '<='} {self.bound:.2f}"


ISSUE_36_TARGETS = (
    ("agents*", (Target("throughput", 1.3), Target("ttft", 0.7))),
    ("*saturated*", (Target("throughput", 1.2),)),
)
"""Issue 36's targets, by workload name (a glob): agent loops, and a trace replayed saturated (a
workload whose name says `saturated`). `long_history` prints its own (`LONG_HISTORY_TARGETS`)."""

LONG_HISTORY_TARGETS = {("kvheavy", 16384): Target("ttft", 0.6)}
"""Issue 36: ours' resumed TTFT at 16K tokens of `kvheavy` at most 0.6 x the best of every peer."""


@dataclass(frozen=True)
class Gate:
    """Pass/fail thresholds of `--gate`: per workload, each figure of ours against the best
    configuration of each peer that ran (medians over repeats; `summary.best_of`), and every system
    error-free. A workload takes the targets of the first glob of `targets` its name matches, else
    `default` (the multi-turn chat and the arrival-bound trace)."""

    targets: tuple[tuple[str, tuple[Target, ...]], ...] = ISSUE_36_TARGETS
    default: tuple[Target, ...] = (Target("ttft", 0.75), Target("throughput", 1.0))
    max_errors: int = 0

    def for_workload(self, name: str) -> tuple[Target, ...]:
        return next((t for glob, t in self.targets if fnmatch.fnmatchcase(name, glob)), self.default)


@dataclass(frozen=True)
class Soak:
    """`--soak MINUTES`: multi-turn load on ours for that long, sampling RSS and tier bytes."""

    minutes: float = 0.0
    load: MultiTurn = field(default_factory=MultiTurn)  # one cycle; repeated with new conversations
    rss_growth_mb: float = 256.0  # allowed RSS growth from the end of warm-up to the end
    tier_capacity_mb: int = 512  # ours runs with this tier capacity; the tier may never exceed it
    sample_s: float = 5.0


@dataclass(frozen=True)
class BenchSpec:
    shape: Shape = field(default_factory=Shape)
    multiturn: tuple[MultiTurn, ...] = (MultiTurn(concurrency=8),)
    traces: tuple[Trace, ...] = (Trace(),)  # replayed in this order, after the multi-turn workloads
    agents: Agents | None = None  # the agent loops (`bench/agents.py`), after the multi-turn workloads
    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    gate: Gate | None = None
    soak: Soak | None = None
    out_dir: Path = Path("out/bench")
    drop_page_cache: bool = True
    repeats: int = 3  # each system runs this many times, in interleaved order (run.schedule)
    # The host budget is still to be sized to hold as much KV as the device pool, once the model is
    # known (`workloads.fit_host`): the agents workload without --host-budget-mb
    host_budget_fits_pool: bool = False
    workload: str = "chat"  # its name (`workloads.WORKLOADS`)

    def __post_init__(self) -> None:
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if unknown or not self.systems:
            raise SpecError(f"unknown system(s) {unknown}; choose from {', '.join(SYSTEMS)}")
        if self.repeats < 1:
            raise SpecError(f"repeats must be >= 1, got {self.repeats}")
        for name in (s for s in self.systems if s in LMCACHE):
            if LMCACHE[name].chunk_size % self.shape.page_size:
                raise SpecError(f"{name}: its chunk of {LMCACHE[name].chunk_size} tokens is not a multiple of "
                                f"the page size {self.shape.page_size}")  # fmt: skip
        if not self.multiturn and not self.traces and self.agents is None and self.soak is None:
            raise SpecError("nothing to run: no multi-turn workload, no trace, no agents and no soak")


def quick(spec: BenchSpec) -> BenchSpec:
    """The `--quick` preset: one repeat, the first multi-turn workload, at most 12 requests of a trace
    cut at its first lines (a trace cut in whole conversations and the agents come in their own quick
    sizes: `workloads`)."""
    traces = tuple(replace(t, requests=min(t.requests, 12)) if t.cut is Cut.FIRST else t for t in spec.traces)
    return replace(spec, multiturn=spec.multiturn[:1], traces=traces, repeats=1)
