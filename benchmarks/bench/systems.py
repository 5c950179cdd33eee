"""The systems a run compares, as server command lines over the same `Shape`.

(a) `recompute`: `python -m sglang.launch_server` with sglang's default cache: evicted KV is gone.
(b) `hicache-*`: the same server with `--enable-hierarchical-cache`: a host-memory L2 and the `file`
    L3 backend (on a GPU also `nixl`) in a directory on the disk under test, in each configuration
    of `spec.HICACHE_CONFIGS` (prefetch policy `wait_complete` or `timeout`, the latter at sglang's
    default timeouts or tuned to the disk; host pool at sglang's default ratio or device + the run's
    host budget; `buffer_only` host memory). On CPU it needs
    `--hicache-io-backend direct --hicache-mem-layout layer_first` (`page_first_direct` with
    sglang's `mooncake` L3, the layout sglang gives that backend) and our compatibility patches
    (`sgl_hicache_cpu.hicache_cpu_compat`, switched on in sglang's processes by an env var).
(b') `lmcache-*`: the same server with `--enable-lmcache`, beside its own LMCache daemon
    (`lmcache_process.LMCacheServer`), in each configuration of `spec.LMCACHE_CONFIGS`: its L1 the
    run's host budget, its disk tier (`fs`, or `fs_native` capped at ours' tier capacity) in a
    directory on the same disk as ours'.
(c) `ours`: `python -m sgl_hicache.launch_server --enable-hicache-spill` with the tier in a
    directory on the same disk and its host staging bounded by the same host budget.
(d) `resident`: a reference, not a competitor: sglang's default cache with a device pool large
    enough to hold the whole workload, so every reusable prefix is a device hit. It is the best any
    cache could do on this machine; `ttft_vs_resident` says how close ours comes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.bench.disk_speed import tuned_timeouts
from benchmarks.bench.grpc_server import GrpcServer
from benchmarks.bench.lmcache_process import ENV as LMCACHE_ENV
from benchmarks.bench.lmcache_process import L2, DaemonSpec, LMCacheServer, not_installed
from benchmarks.bench.server_process import ServerProcess, device_flags
from benchmarks.bench.spec import HICACHE, LMCACHE, OURS_FLAGS, HiCacheConfig, HostPool, Shape, SpecError
from sgl_hicache.config import MiB, MooncakeConfig, TierConfig

COMMON_FLAGS = ("--enable-metrics", "--enable-cache-report")
HICACHE_COMPAT_ENV = {"SGL_HICACHE_CPU_HICACHE_COMPAT": "1"}


@dataclass(frozen=True)
class System:
    name: str
    module: str
    flags: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    tier_dir: Path | None  # where it keeps KV on disk, if anywhere
    pool_tokens: int  # its device KV pool (--max-total-tokens)
    lmcache: DaemonSpec | None = None  # the LMCache daemon each of its servers runs beside

    def server(self, model: Path, log_path: Path, cpus: tuple[int, ...] | None = None,
               grpc: bool = False) -> ServerProcess:  # fmt: skip
        """A server of this system, not started; on `cpus` only if given (`ServerProcess`); in
        sglang's gRPC mode with its KV events published if `grpc` (`GrpcServer`); with its own
        LMCache daemon (started and stopped with it) if the system has one (`LMCacheServer`)."""
        if self.lmcache is not None:
            if grpc:
                raise ValueError(f"{self.name}: an LMCache server in gRPC mode is not supported here")
            return LMCacheServer(model, self.pool_tokens, self.flags, module=self.module, log_path=log_path,
                                 env=dict(self.env), cpus=cpus, daemon_spec=self.lmcache)  # fmt: skip
        kind = GrpcServer if grpc else ServerProcess
        return kind(model, self.pool_tokens, self.flags, module=self.module, log_path=log_path,
                    env=dict(self.env), cpus=cpus)  # fmt: skip


def kv_bytes_per_token(model: Path) -> int:
    """Bytes of K and V per token over all layers, from the model's config (bf16/fp16 KV)."""
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    return int(cfg["num_hidden_layers"]) * 2 * int(kv_heads) * int(head_dim) * 2


def build(name: str, shape: Shape, model: Path, workdir: Path, *, tier_capacity_mb: int | None = None,
          workload_tokens: int = 0, mooncake: MooncakeConfig | None = None) -> System:  # fmt: skip
    """`tier_capacity_mb` bounds ours' tier (default: the tier's own default budget);
    `workload_tokens` (every prompt and output token of the run) sizes the resident pool;
    `mooncake` puts ours' tier on that Mooncake Store (the directory then holds only the secret
    that seals its headers) instead of in the directory, and a HiCache system's L3 on it (sglang's
    `mooncake` backend; the directory then unused)."""
    base = (*device_flags(shape.device), *COMMON_FLAGS, "--page-size", str(shape.page_size),
            "--chunked-prefill-size", str(shape.chunked_prefill))  # fmt: skip
    if name == "recompute":
        return System(name, "sglang.launch_server", base, (), None, shape.pool_tokens)
    if name == "resident":
        pool = max(shape.pool_tokens, workload_tokens + shape.pool_tokens)
        return System(name, "sglang.launch_server", base, (), None, pool)
    tier = workdir / f"tier-{name}"
    if name in HICACHE:
        config = HICACHE[name]
        if config.backend == "nixl" and (why := nixl_unavailable(shape)) is not None:
            raise SpecError(f"{name}: {why}")
        compat = tuple(HICACHE_COMPAT_ENV.items()) if shape.device == "cpu" else ()
        env = compat if mooncake is not None else (*compat, (STORAGE_DIR_ENV[config.backend], str(tier)))
        hicache = (*base, *hicache_flags(config, shape, model, mooncake))
        return System(name, "sglang.launch_server", hicache, env, tier, shape.pool_tokens)
    if name in LMCACHE:
        if mooncake is not None:
            raise ValueError(f"{name}: LMCache keeps its KV in its own daemon, not on a Mooncake Store")
        return _lmcache(name, base, tier, shape, tier_capacity_mb)
    if name in OURS_FLAGS:
        flags: tuple[str, ...] = (*base, "--enable-hicache-spill", "--hicache-spill-dir", str(tier),
                 "--hicache-spill-staging", f"{shape.host_budget_mb}M", *OURS_FLAGS[name])  # fmt: skip
        if tier_capacity_mb is not None:
            flags += ("--hicache-spill-capacity", f"{tier_capacity_mb}M")
        if mooncake is not None:
            defaults = dataclasses.asdict(MooncakeConfig())
            settings = {k: v for k, v in dataclasses.asdict(mooncake).items() if v != defaults[k]}
            flags += (
                "--hicache-spill-backend",
                "mooncake",
                "--hicache-spill-mooncake-config",
                json.dumps(settings),
            )
        return System(name, "sgl_hicache.launch_server", flags, (), tier, shape.pool_tokens)
    raise ValueError(f"unknown system {name!r}")


def _lmcache(
    name: str, base: tuple[str, ...], tier: Path, shape: Shape, tier_capacity_mb: int | None
) -> System:
    """An LMCache configuration at ours' memory: L1 = the host budget; a capped disk tier at ours'
    tier capacity (`tier_capacity_mb`, else the tier's default budget). SpecError for a chunk that is
    not a multiple of the page size (sglang's connector refuses it at start)."""
    config = LMCACHE[name]
    if (why := not_installed()) is not None:
        raise SpecError(f"{name}: {why}")
    if config.chunk_size % shape.page_size:
        raise SpecError(f"{name}: its chunk of {config.chunk_size} tokens is not a multiple of the page size "
                        f"{shape.page_size}")  # fmt: skip
    capacity_mb = tier_capacity_mb if tier_capacity_mb is not None else TierConfig().capacity_bytes // MiB
    disk = config.l2 is not L2.NONE
    daemon = DaemonSpec(l1_mb=shape.host_budget_mb, chunk_size=config.chunk_size, l2=config.l2,
                        l2_dir=tier if disk else None,
                        l2_capacity_mb=capacity_mb if config.l2 is L2.FS_NATIVE else None,
                        l2_store_policy=config.l2_store_policy)  # fmt: skip
    return System(name, "sglang.launch_server", base, tuple(LMCACHE_ENV.items()), tier if disk else None,
                  shape.pool_tokens, lmcache=daemon)  # fmt: skip


STORAGE_DIR_ENV = {
    "file": "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR",
    "nixl": "SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR",
}
"""Where each L3 backend of sglang keeps its files (an environment variable of the server)."""


def nixl_unavailable(shape: Shape) -> str | None:
    """Why HiCache's `nixl` L3 cannot run here, in one line, or None: it needs the `nixl` package
    and a GPU (`--device cuda`, with CUDA visible)."""
    if importlib.util.find_spec("nixl") is None:
        return "the nixl package is not installed here (HiCache's nixl L3 needs it, and a GPU)"
    if shape.device != "cuda":
        return "HiCache's nixl L3 runs on a GPU: give --device cuda"
    import torch

    if not torch.cuda.is_available():
        return "HiCache's nixl L3 runs on a GPU, and CUDA sees none here"
    return None


def hicache_flags(config: HiCacheConfig, shape: Shape, model: Path,
                  mooncake: MooncakeConfig | None = None) -> tuple[str, ...]:  # fmt: skip
    """The `--hicache-*` flags of one HiCache configuration (write policy: sglang's default,
    `write_through`), its L3 the configuration's backend, or sglang's `mooncake` backend on that
    store; a tuned `timeout` configuration's timeouts in the backend's extra config (SpecError
    without the disk's read speed)."""
    ratio = config.default_ratio if config.host is HostPool.DEFAULT else _host_ratio(shape, model)
    # On a GPU, sglang's defaults (`kernel` I/O, `page_first` layout): HiCache at its strongest there.
    # On CPU the direct copies, in the layout sglang gives a mooncake L3 (one object per page of all
    # layers) where it has one, else layer_first (the CPU profile has torch versions of both).
    layout = "page_first_direct" if mooncake is not None else "layer_first"
    cpu_only = (
        ("--hicache-io-backend", "direct", "--hicache-mem-layout", layout) if shape.device == "cpu" else ()
    )
    timeouts: dict[str, float] = {}
    if config.tuned_timeout:
        if shape.disk_read_mib_s is None:
            raise SpecError(
                f"{config.name}: its timeouts are tuned to the disk's read speed; none was given or measured"
            )
        timeouts = tuned_timeouts(kv_bytes_per_token(model), shape.disk_read_mib_s).extra_config()
    return ("--enable-hierarchical-cache", "--hicache-ratio", f"{ratio:.6f}", *cpu_only,
            *_storage_flags(config.backend, mooncake, timeouts),
            "--hicache-storage-prefetch-policy", config.prefetch_policy,
            "--hicache-host-memory-mode", config.memory_mode)  # fmt: skip


MOONCAKE_EXTRA_CONFIG = {"master": "master_server_address", "metadata_server": "metadata_server",
                         "protocol": "protocol", "device_name": "device_name", "local_hostname": "local_hostname",
                         "global_segment_size": "global_segment_size", "local_buffer_size": "local_buffer_size"}  # fmt: skip
"""`MooncakeConfig` field -> the key of sglang's `--hicache-storage-backend-extra-config` for its
`mooncake` backend (`MooncakeStoreConfig.load_from_extra_config`)."""


def _storage_flags(
    backend: str, mooncake: MooncakeConfig | None, timeouts: dict[str, float]
) -> tuple[str, ...]:
    """`--hicache-storage-backend` (`mooncake` on that store, else `backend`) and its extra config:
    the store's settings and the prefetch timeouts, where there are any. With `real_client`, sglang's
    standalone mode: its `setup_dummy` reads only the real client's address (its host pool, made by
    `MooncakeHostTensorAllocator` as for any `mooncake` L3, is the shared memory it registers); the
    master, segment and transport are the real client's, so none is given."""
    extra: dict[str, Any] = dict(timeouts)
    if mooncake is not None and mooncake.real_client:
        backend = "mooncake"
        extra |= {"standalone_storage": True, "client_server_address": mooncake.real_client}
    elif mooncake is not None:
        backend, given = "mooncake", dataclasses.asdict(mooncake)
        extra |= {key: given[name] for name, key in MOONCAKE_EXTRA_CONFIG.items() if given[name]}
    flags = ("--hicache-storage-backend", backend)
    return (*flags, "--hicache-storage-backend-extra-config", json.dumps(extra)) if extra else flags


def _host_ratio(shape: Shape, model: Path) -> float:
    """HiCache sizes its host pool as `--hicache-ratio` times the device pool (in tokens, rounded
    down to whole pages); this is the ratio that makes it the device pool + the run's host budget
    (`HostPool.BUDGET`; +0.5 token against float rounding)."""
    return (host_tokens(HostPool.BUDGET, 0.0, shape, model) + 0.5) / shape.pool_tokens


def host_tokens(host: HostPool, default_ratio: float, shape: Shape, model: Path) -> int:
    """The tokens of a HiCache host pool sized `host` (at `default_ratio` for `HostPool.DEFAULT`)."""
    if host is HostPool.DEFAULT:
        return int(default_ratio * shape.pool_tokens)
    return shape.pool_tokens + shape.host_budget_mb * 2**20 // kv_bytes_per_token(model)


def check_runnable(names: Iterable[str], shape: Shape, model: Path, workdir: Path) -> None:
    """SpecError, in one line, for the first of `names` that cannot be built here (an LMCache system
    without LMCache installed, ...), before a run starts any server."""
    for name in names:
        build(name, shape, model, workdir)


def check_hicache_holds(names: Iterable[str], shape: Shape, model: Path, history_tokens: int) -> None:
    """SpecError, in one line, for the first HiCache configuration of `names` whose host pool cannot
    hold, beside its copies of a full device pool, a history of `history_tokens` (what it is meant
    to restore: it could only recompute it, and would be measured as a cache that is not one)."""
    for name in (n for n in names if n in HICACHE):
        config = HICACHE[name]
        free = config.cache_tokens(
            host_tokens(config.host, config.default_ratio, shape, model), shape.pool_tokens
        )
        if free < history_tokens:
            raise SpecError(
                f"{name}: its host pool holds {max(free, 0)} tokens beside the device pool's copies, fewer than "
                f"the {history_tokens}-token history it is meant to restore: raise --host-budget-mb or "
                "--pool-tokens, or leave it out"
            )
