"""The config itself: `TierConfig` (the extent store) and `SpillConfig` (the root), frozen and
validated on construction."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from sgl_hicache.config.enums import (
    Compression,
    Fsync,
    KvEventsMedium,
    PrefetchPolicy,
    SpillAdmission,
    SpillBackend,
    WritePolicy,
)
from sgl_hicache.config.errors import require
from sgl_hicache.config.fields import build, option, to_plain, tuning
from sgl_hicache.config.mooncake import MooncakeConfig
from sgl_hicache.config.units import Bare, GiB, MiB


@dataclass(frozen=True)
class TierConfig:
    """The extent store (`sgl_hicache.tier`): a directory, or a Mooncake Store."""

    backend: SpillBackend = option(
        SpillBackend.FILE,
        "where spilled extents go: file (the directory below) or mooncake (a Mooncake Store; "
        "settings in --hicache-spill-mooncake-config or Mooncake's MOONCAKE_* variables)",
        "--hicache-spill-backend",
    )
    mooncake: MooncakeConfig = option(
        MooncakeConfig(),
        'with the mooncake backend, one JSON object: master ("host:port"), metadata_server, protocol, '
        "device_name, local_hostname, global_segment_size, local_buffer_size, ssd_offload_path, "
        "load_calls, placement; unset ones from MOONCAKE_*",
        "--hicache-spill-mooncake-config",
    )
    directory: Path = option(
        Path("/var/tmp/sgl_hicache"),
        "directory of the spill tier (a mounted NVMe/NVMe-oF volume)",
        "--hicache-spill-dir",
    )
    capacity_bytes: int = option(
        64 * GiB,
        "byte budget of the tier directory, shared by every server using it; GB if no unit, or e.g. 2T",
        "--hicache-spill-capacity",
        bare=Bare.GB,
    )
    min_free_bytes: int = option(
        1 * GiB,
        "keep at least this much free space on the volume; GB if no unit, or e.g. 512M",
        "--hicache-spill-min-free",
        bare=Bare.GB,
    )
    io_threads: int = tuning(8, "parallel I/O threads (reads go first; at most N-1 writes at once)")
    chunk_bytes: int = tuning(
        4 * MiB, "large extents are read in parallel chunks of this size (a unit is required)", "chunk_size",
        bare=Bare.REFUSED,
    )  # fmt: skip
    direct_io: bool = tuning(True, "use O_DIRECT where the filesystem allows it (probed once)")
    fsync: Fsync = tuning(Fsync.DATA, "durability of published extents")
    compression: Compression = tuning(Compression.NONE, "per-extent compression")
    zstd_level: int = tuning(1, "zstd level when compression is zstd (-7..22)")

    def __post_init__(self) -> None:
        object.__setattr__(self, "directory", Path(self.directory))
        require(
            self.capacity_bytes > 0, "capacity_bytes", f"capacity must be positive, got {self.capacity_bytes}"
        )
        require(
            self.min_free_bytes >= 0,
            "min_free_bytes",
            f"min free bytes must be >= 0, got {self.min_free_bytes}",
        )
        require(
            1 <= self.io_threads <= 256, "io_threads", f"io threads must be in 1..256, got {self.io_threads}"
        )
        require(
            self.chunk_bytes >= 4096 and self.chunk_bytes % 4096 == 0,
            "chunk_bytes",
            f"chunk size must be a positive multiple of 4096, got {self.chunk_bytes}",
        )
        require(
            -7 <= self.zstd_level <= 22, "zstd_level", f"zstd level must be in -7..22, got {self.zstd_level}"
        )
        require(
            self.backend is SpillBackend.FILE or bool(self.mooncake.master or self.mooncake.real_client),
            "mooncake",
            'the mooncake backend needs the master\'s address ("master" or MOONCAKE_MASTER) or a real '
            'client\'s ("real_client" or MOONCAKE_CLIENT)',
        )
        require(
            not self.mooncake.real_client or self.io_threads <= MAX_IO_THREADS_STANDALONE,
            "io_threads",
            f"with a real client io_threads must be at most {MAX_IO_THREADS_STANDALONE} (more calls in "
            f"parallel share its connections, where one timing out fails the others), got {self.io_threads}",
        )


MIN_IO_TIMEOUT_S = 10.0
MAX_IO_THREADS_STANDALONE = 128
"""The most I/O threads of a tier joined through a real client: Mooncake's client pool gives each
call a connection of its own up to 160 calls in parallel (yalantinglibs `client_reuse_limiter`)."""


@dataclass(frozen=True)
class SpillConfig:
    """Spill on eviction, restore on resume (`sgl_hicache.cache`, `sgl_hicache.prefetch`)."""

    tier: TierConfig = field(default_factory=TierConfig)
    enabled: bool = option(
        False,
        "spill evicted radix-cache subtrees to the tier instead of dropping them",
        "--enable-hicache-spill",
    )
    staging_bytes: int = option(
        256 * MiB,
        "host memory for extents in flight to and from the tier; GB if no unit, or e.g. 512M",
        "--hicache-spill-staging",
        bare=Bare.GB,
    )
    min_spill_tokens: int = tuning(16, "subtrees with fewer tokens are dropped, not spilled")
    prefetch_policy: PrefetchPolicy = option(
        PrefetchPolicy.WAIT_COMPLETE,  # chosen by benchmarks/prefetch_policy.py: see docs/DESIGN.md
        "when a resume whose reads have not landed runs: wait_complete (or wait: up to the I/O "
        "timeout), timeout, best_effort (recompute at once), as sglang's --hicache-storage-prefetch-policy",
        "--hicache-spill-prefetch-policy",
    )
    prefetch_timeout_s: float = option(
        2.0, "seconds the timeout policy waits for a restore", "--hicache-spill-prefetch-timeout"
    )
    prefetch_ttl_s: float = tuning(30.0, "seconds after which a prefetched read nobody used is released")
    pin_share: float = tuning(
        0.5,
        "share of the tier budget that pinned conversations may hold (POST /hicache/pin), below 1; 0 refuses pins",
    )
    clean_ahead: float = tuning(
        1.0,
        "write_back, a tier of our own: while idle, write the coldest unwritten KV ahead of eviction "
        "until it and the free slots make this share of the device pool; 0: off",
    )
    write_policy: WritePolicy = option(
        WritePolicy.WRITE_BACK,
        "written on eviction (write_back) or also when cached (write_through, for a shared tier)",
        "--hicache-spill-write-policy",
    )
    admission: SpillAdmission = option(
        SpillAdmission.ALL,
        "which nodes the tier is written: all, or reused (only those a later request reused, "
        "hinted, pinned or long; others are dropped on eviction)",
        "--hicache-spill-admission",
    )
    admission_min_tokens: int = option(
        0,
        "with admission reused: nodes this long are written, reused or not; 0: none for its length",
        "--hicache-spill-admission-min-tokens",
    )

    kv_events_medium: KvEventsMedium = option(
        KvEventsMedium.DISK,
        "the medium of spilled pages in KV events: disk, or cpu_pinned for a router that indexes "
        "device and host tiers only (smg 1.13's cache_aware) so that it routes to the server holding them",
        "--hicache-spill-kv-events-medium",
    )
    layer_groups: int = tuning(
        4,
        "extents are written in this many layer groups, each verified alone; 1: page-major (format v5)",
    )
    admission_hold: float = tuning(
        0.5, "a resume's first admission holds for its reads up to this share of a deferral's cost; 0: never"
    )
    restore_reserve: bool = tuning(
        False, "while a restore waits for room in staging, no store takes the room its read needs"
    )
    take_back_reads: bool = tuning(
        True,
        "a spill finding staging full takes back landed prefetches before dropping its victim",
    )
    restores_in_order: bool = tuning(
        False,
        "restores take staging in the order they began waiting for room",
    )
    restores_take_back: bool = tuning(
        False,
        "a restore waiting for room in staging takes back landed prefetches no restore asked for",
    )
    layerwise_restore: bool = option(
        False,
        "a resume's prefill starts once its first layer group landed; each layer waits for its own",
        "--hicache-spill-layerwise",
    )

    def __post_init__(self) -> None:
        require(
            self.prefetch_ttl_s > 0, "prefetch_ttl_s", f"prefetch ttl must be > 0, got {self.prefetch_ttl_s}"
        )
        require(
            0 <= self.clean_ahead <= 1,
            "clean_ahead",
            f"clean ahead must be in [0, 1], got {self.clean_ahead}",
        )
        require(  # 1 would let pins hold the whole budget: nothing else could be spilled
            0 <= self.pin_share < 1, "pin_share", f"pin share must be in [0, 1), got {self.pin_share}"
        )
        require(
            self.staging_bytes >= MiB,
            "staging_bytes",
            f"staging must be at least 1M, got {self.staging_bytes}",
        )
        require(
            self.min_spill_tokens >= 1,
            "min_spill_tokens",
            f"min spill tokens must be >= 1, got {self.min_spill_tokens}",
        )
        require(
            self.admission_min_tokens >= 0,
            "admission_min_tokens",
            f"admission min tokens must be >= 0, got {self.admission_min_tokens}",
        )
        require(
            self.prefetch_timeout_s > 0,
            "prefetch_timeout_s",
            f"prefetch timeout must be > 0, got {self.prefetch_timeout_s}",
        )
        require(
            0 <= self.admission_hold <= 1,
            "admission_hold",
            f"admission hold must be in [0, 1], got {self.admission_hold}",
        )
        require(
            1 <= self.layer_groups <= 64,
            "layer_groups",
            f"layer groups must be in 1..64, got {self.layer_groups}",
        )

    @property
    def io_timeout_s(self) -> float:
        """How long a restore waits for one read before it gives up and recomputes."""
        return max(self.prefetch_timeout_s, MIN_IO_TIMEOUT_S)

    def to_json(self) -> str:
        return json.dumps(to_plain(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SpillConfig:
        data = json.loads(text)
        return build(cls, data)
