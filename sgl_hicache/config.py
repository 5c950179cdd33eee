"""Configuration: one chain of frozen dataclasses, validated on construction.

`SpillConfig` is the root. Every field that a user may set carries its help in its metadata: a
top-level flag (`option(...)`) or a key of the one JSON flag `--hicache-spill-extra-config`
(`tuning(...)`, the knobs few need); `sgl_hicache.server.flags` derives the argparse options and the
typed `SGL_HICACHE_*` environment overrides from these fields, so a new setting is one new field.
Sizes follow sglang's unit: a bare number is GB (`--hicache-size 200` is 200 GB), or, where that
would mislead, needs a unit (`Bare`).

The config reaches sglang's spawned scheduler processes explicitly: `to_json()` in the launcher,
`from_json()` in the scheduler (see `sgl_hicache.server.handoff`). Nothing is kept in module globals.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(?:i?B)?|(B))?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "K": KiB, "M": MiB, "G": GiB, "T": TiB}


class ConfigError(ValueError):
    """A setting is invalid. The message is one line, fit to show a user as is; `field` names the
    offending dataclass field when one is to blame (flags use it to name the flag)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def _require(cond: bool, field: str | None, message: str) -> None:
    if not cond:
        raise ConfigError(message, field)


def parse_size(text: str, bare: int | None = 1) -> int:
    """Parse a byte size such as `200G`, `512MiB`, `1.5T` or `4096B` (binary units: G = 2**30). A
    number without a unit is in units of `bare` bytes (GiB: sglang's unit), or refused if `bare` is
    None."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ConfigError(f"cannot parse size {text!r} (expected e.g. 512M, 200G, 1.5T)")
    number, unit, byte = m.groups()
    scale = _SIZE_UNITS[unit.upper()] if unit else 1 if byte else bare
    if scale is None:
        raise ConfigError(f"{str(text).strip()} has no unit (give a unit, e.g. 4M)")
    return int(float(number) * scale)


def format_size(n: int) -> str:
    for unit in ("T", "G", "M", "K"):
        if n >= _SIZE_UNITS[unit] and n % _SIZE_UNITS[unit] == 0:
            return f"{n // _SIZE_UNITS[unit]}{unit}"
    return str(n)


class Fsync(enum.StrEnum):
    """When the tier makes a published extent durable.

    NONE: never (the page cache decides; a power loss may lose recent extents, never corrupt one,
    since every read verifies checksums). DATA: fdatasync each extent before its atomic rename
    (default: a crash never leaves a published-but-empty file). FULL: DATA plus an fsync of the
    directory after the rename, so the publish itself survives power loss.
    """

    NONE = "none"
    DATA = "data"
    FULL = "full"


class Compression(enum.StrEnum):
    NONE = "none"
    ZSTD = "zstd"


class PrefetchPolicy(enum.StrEnum):
    """When a request whose prefix runs into spilled KV becomes schedulable (the names are those of
    sglang's `--hicache-storage-prefetch-policy`; our former `wait` is accepted for WAIT_COMPLETE).

    Restores are all or nothing: a request either gets its whole spilled prefix back or recomputes it.
    WAIT_COMPLETE: only after its reads landed or failed (bounded by the tier's I/O timeout,
    max(`prefetch_timeout_s`, 10 s)). TIMEOUT: waits up to `prefetch_timeout_s`, then recomputes.
    BEST_EFFORT: at once; if the reads have not landed yet the prefix is recomputed.
    """

    WAIT_COMPLETE = "wait_complete"
    TIMEOUT = "timeout"
    BEST_EFFORT = "best_effort"

    @classmethod
    def _missing_(cls, value: object) -> PrefetchPolicy | None:
        return cls.WAIT_COMPLETE if value == "wait" else None


class WritePolicy(enum.StrEnum):
    """When KV is written to the tier (the names are those of sglang's `--hicache-write-policy`).

    WRITE_BACK: when it is evicted from the device pool (one write per eviction; KV that is never
    evicted is never written). WRITE_THROUGH: also as soon as the tree takes it (each insert writes
    the resident nodes on the request's path that have no copy on the tier yet); an eviction of such
    a node then writes nothing, and servers sharing the tier find KV that is still resident on the
    server that computed it (a router moving a conversation to another server). More tier writes
    and staging traffic in exchange; the tier's LRU budget bounds the bytes either way.
    """

    WRITE_BACK = "write_back"
    WRITE_THROUGH = "write_through"


class SpillAdmission(enum.StrEnum):
    """Which nodes the tier is written (cache/write_admission.py): an SSD wears with what is written.

    ALL: every node an eviction meets (`min_spill_tokens` aside), and ahead of eviction every node
    write-through and clean-ahead reach. REUSED: only a node that was reused (a request later than
    the one that cached it matched it: its hit count is 2 or more, as HiCache's
    `write_through_selective` counts them), is on the path of a resume hint, is pinned, has at least
    `admission_min_tokens` tokens, already has its copy on the tier, or holds spilled children
    (dropping it would drop them). Any other node an eviction meets is dropped, as sglang's plain
    cache drops it (recomputed if needed again), and write-through and clean-ahead skip it.
    """

    ALL = "all"
    REUSED = "reused"


class KvEventsMedium(enum.StrEnum):
    """The medium a spilled node's pages are announced under in KV cache events (cache/events.py).

    DISK: the truthful name (our tier is a directory or a store, not host memory). CPU_PINNED: for a
    router that indexes only the device and host tiers (smg 1.13 routes on `GPU` and `CPU_PINNED`
    blocks and leaves `DISK` ones out), so that it routes a conversation to the server holding its
    spilled history; as for sglang's host tier, a hit there restores without recompute."""

    DISK = "disk"
    CPU_PINNED = "cpu_pinned"


class Bare(enum.Enum):
    """What a size setting makes of a number given without a unit."""

    GB = GiB  # gigabytes, sglang's unit (`--hicache-size 200` is 200 GB); binary, as all our units
    REFUSED = None  # refused with a hint: no unit would read naturally (a chunk of 4: bytes? MiB?)


def option(default: Any, help: str, flag: str | None = None, *, bare: Bare | None = None) -> Any:
    """A user-settable field with its own flag, `--hicache-spill-<name>` unless named (see
    server.flags). `bare`: the field is a byte size, and what a number without a unit means."""
    return field(default=default, metadata={"help": help, "flag": flag, "bare": bare})


def tuning(default: Any, help: str, key: str | None = None, *, bare: Bare | None = None) -> Any:
    """A user-settable knob few need: a key of `--hicache-spill-extra-config` (the field's name
    unless named), with its own `SGL_HICACHE_SPILL_<KEY>` variable."""
    return field(default=default, metadata={"help": help, "tuning": True, "key": key, "bare": bare})


def flag_of(f: dataclasses.Field[Any]) -> str:
    """The command-line flag of an `option` field."""
    return f.metadata["flag"] or "--hicache-spill-" + f.name.replace("_", "-")


def key_of(f: dataclasses.Field[Any]) -> str | None:
    """The `--hicache-spill-extra-config` key of a `tuning` field; None for any other field."""
    return (f.metadata["key"] or f.name) if f.metadata.get("tuning") else None


def flag_named(cls: type, name: str) -> str:
    """The flag of field `name` of config dataclass `cls` (for messages that name it)."""
    return flag_of(next(f for f in dataclasses.fields(cls) if f.name == name))


class SpillBackend(enum.StrEnum):
    """Where extents go. FILE: a directory (`tier/nvme.py`; shared by the servers mounting it).
    MOONCAKE: a Mooncake Store (`tier/mooncake.py`): one master, every server a client contributing
    DRAM, the master owning placement and eviction; the directory then holds only `.secret`."""

    FILE = "file"
    MOONCAKE = "mooncake"


_MOONCAKE_ENV = {  # field -> Mooncake's own variable (the names sglang's `mooncake` L3 backend reads)
    "master": "MOONCAKE_MASTER",
    "metadata_server": "MOONCAKE_TE_META_DATA_SERVER",
    "protocol": "MOONCAKE_PROTOCOL",
    "device_name": "MOONCAKE_DEVICE",
    "local_hostname": "MOONCAKE_LOCAL_HOSTNAME",
    "global_segment_size": "MOONCAKE_GLOBAL_SEGMENT_SIZE",
    "local_buffer_size": "MOONCAKE_LOCAL_BUFFER_SIZE",
    "ssd_offload_path": "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH",
}
_MOONCAKE_DEFAULTS: dict[str, Any] = {
    "metadata_server": "P2PHANDSHAKE", "protocol": "tcp", "local_hostname": "localhost",
    "global_segment_size": 4 * GiB, "local_buffer_size": 64 * MiB,
}  # fmt: skip


@dataclass(frozen=True)
class MooncakeConfig:
    """How this server joins a Mooncake Store as a client (`--hicache-spill-mooncake-config`, one JSON
    object with these keys; `""` / 0 mean unset). `with_env` fills what is unset from Mooncake's own
    variables, then from the defaults above."""

    master: str = ""  # host:port of mooncake_master's RPC
    metadata_server: str = ""  # "http://host:port/metadata" (the master's HTTP one), etcd, or P2PHANDSHAKE
    protocol: str = ""  # tcp, rdma, ...
    device_name: str = ""  # RDMA devices, comma-separated ("" lets Mooncake pick)
    local_hostname: str = ""  # the address other clients reach this one at
    global_segment_size: int = 0  # bytes of DRAM this client contributes to the store
    local_buffer_size: int = 0  # bytes of the client's own transfer buffer
    ssd_offload_path: str = ""  # Mooncake's SSD tier on this host (e.g. an NVMe-oF mount); "" for none

    @classmethod
    def from_user(cls, data: object) -> MooncakeConfig:
        """From the flag's JSON object: known keys only, strings, sizes as bytes or with a unit."""
        _require(isinstance(data, dict), None, "expected a JSON object of Mooncake settings")
        assert isinstance(data, dict)
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        _require(not unknown, None, f"unknown key {', '.join(unknown)} (known: {', '.join(names)})")
        given: dict[str, Any] = {k: _mooncake_value(k, v) for k, v in data.items()}
        return cls(**given)

    def with_env(self, environ: Mapping[str, str]) -> MooncakeConfig:
        """Unset fields from Mooncake's variables (`MOONCAKE_MASTER`, ...), then the defaults."""
        out = {}
        for name, var in _MOONCAKE_ENV.items():
            value = getattr(self, name)
            if not value and environ.get(var):
                try:
                    value = _mooncake_value(name, environ[var])
                except ConfigError as e:
                    raise ConfigError(f"{var}: {e}") from None
            out[name] = value or _MOONCAKE_DEFAULTS.get(name, value)
        return MooncakeConfig(**out)

    def __post_init__(self) -> None:
        _require(self.master == "" or ":" in self.master, None,
                 f"master must be host:port, got {self.master!r}")  # fmt: skip
        for name in ("global_segment_size", "local_buffer_size"):
            size = getattr(self, name)
            _require(
                size == 0 or size >= 16 * MiB,
                None,
                f"{name} must be at least 16M (Mooncake's least), got {size}",
            )


def _mooncake_value(name: str, value: object) -> str | int:
    if name.endswith("_size"):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        _require(isinstance(value, str), None, f'{name}: expected a size such as "4G", got {value!r}')
        return parse_size(str(value), 1)  # a bare number is bytes, as Mooncake reads it
    _require(isinstance(value, str), None, f"{name}: expected a string, got {value!r}")
    return str(value)


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
        "device_name, local_hostname, global_segment_size, local_buffer_size, ssd_offload_path; unset keys from "
        "MOONCAKE_MASTER, MOONCAKE_TE_META_DATA_SERVER, ... as sglang's mooncake backend reads them",
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
        _require(
            self.capacity_bytes > 0, "capacity_bytes", f"capacity must be positive, got {self.capacity_bytes}"
        )
        _require(
            self.min_free_bytes >= 0,
            "min_free_bytes",
            f"min free bytes must be >= 0, got {self.min_free_bytes}",
        )
        _require(
            1 <= self.io_threads <= 256, "io_threads", f"io threads must be in 1..256, got {self.io_threads}"
        )
        _require(
            self.chunk_bytes >= 4096 and self.chunk_bytes % 4096 == 0,
            "chunk_bytes",
            f"chunk size must be a positive multiple of 4096, got {self.chunk_bytes}",
        )
        _require(
            -7 <= self.zstd_level <= 22, "zstd_level", f"zstd level must be in -7..22, got {self.zstd_level}"
        )
        _require(
            self.backend is SpillBackend.FILE or bool(self.mooncake.master),
            "mooncake",
            'the mooncake backend needs the master\'s address: a "master" key or MOONCAKE_MASTER',
        )


MIN_IO_TIMEOUT_S = 10.0


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
        "when a resumed request whose reads have not landed may run: wait_complete (wait for them, up "
        "to the I/O timeout; `wait` is accepted too), timeout, best_effort (recompute at once); as "
        "sglang's --hicache-storage-prefetch-policy",
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
        "write_back on a tier no other server uses: while idle, write the next victims of eviction "
        "(the coldest unwritten KV, until they and the free slots make this share of the device pool), "
        "so that evicting them later copies nothing; 0 turns it off",
    )
    write_policy: WritePolicy = option(
        WritePolicy.WRITE_BACK,
        "when KV is written to the tier: write_back (on eviction), write_through (also when cached; "
        "for servers sharing a tier behind a router)",
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
        "the medium spilled pages are announced under in KV events (--kv-events-config): disk (the "
        "truthful name), or cpu_pinned for a router that indexes only device and host tiers (smg 1.13's "
        "cache_aware), so that it routes a resumed conversation to the server holding it spilled",
        "--hicache-spill-kv-events-medium",
    )
    layer_groups: int = tuning(
        4,
        "extents are written in this many layer groups, each verified alone; 1: page-major (format v5)",
    )
    layerwise_restore: bool = option(
        False,
        "a resumed request's prefill starts once its restore's first layer group landed; each layer "
        "waits for its own",
        "--hicache-spill-layerwise",
    )

    def __post_init__(self) -> None:
        _require(
            self.prefetch_ttl_s > 0, "prefetch_ttl_s", f"prefetch ttl must be > 0, got {self.prefetch_ttl_s}"
        )
        _require(
            0 <= self.clean_ahead <= 1,
            "clean_ahead",
            f"clean ahead must be in [0, 1], got {self.clean_ahead}",
        )
        _require(  # 1 would let pins hold the whole budget: nothing else could be spilled
            0 <= self.pin_share < 1, "pin_share", f"pin share must be in [0, 1), got {self.pin_share}"
        )
        _require(
            self.staging_bytes >= MiB,
            "staging_bytes",
            f"staging must be at least 1M, got {self.staging_bytes}",
        )
        _require(
            self.min_spill_tokens >= 1,
            "min_spill_tokens",
            f"min spill tokens must be >= 1, got {self.min_spill_tokens}",
        )
        _require(
            self.admission_min_tokens >= 0,
            "admission_min_tokens",
            f"admission min tokens must be >= 0, got {self.admission_min_tokens}",
        )
        _require(
            self.prefetch_timeout_s > 0,
            "prefetch_timeout_s",
            f"prefetch timeout must be > 0, got {self.prefetch_timeout_s}",
        )
        _require(
            1 <= self.layer_groups <= 64,
            "layer_groups",
            f"layer groups must be in 1..64, got {self.layer_groups}",
        )

    @property
    def io_timeout_s(self) -> float:
        """How long a restore waits for one read before it gives up and recomputes."""
        return max(self.prefetch_timeout_s, MIN_IO_TIMEOUT_S)

    def to_json(self) -> str:
        return json.dumps(_to_plain(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SpillConfig:
        data = json.loads(text)
        return build(cls, data)


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, Path):
        return str(obj)
    return obj


T = TypeVar("T")


def build(cls: type[T], data: dict[str, Any]) -> T:
    """Build dataclass `cls` (nested ones too) from plain values, converting each to its field type."""
    hints = _field_types(cls)
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(data) - known
    _require(not unknown, None, f"unknown {cls.__name__} settings: {', '.join(sorted(unknown))}")
    kwargs = {name: convert(hints[name], value) for name, value in data.items()}
    return cls(**kwargs)


def convert(tp: Any, value: Any) -> Any:
    """Convert a plain (JSON or string) value to field type `tp`; raises ConfigError."""
    if dataclasses.is_dataclass(tp):
        return build(tp, value)  # type: ignore[arg-type]
    try:
        return _CONVERTERS.get(tp, tp)(value)
    except (ValueError, TypeError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"invalid value {value!r}: {e}") from None


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"expected a boolean, got {value!r}")


def _to_int(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ConfigError(f"expected an integer, got {value!r}")


_CONVERTERS: dict[Any, Callable[[Any], Any]] = {
    bool: _to_bool,
    int: _to_int,
    float: float,
    Path: Path,
    str: str,
}


def _field_types(cls: type) -> dict[str, Any]:
    import typing

    return typing.get_type_hints(cls)
