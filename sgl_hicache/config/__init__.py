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

from sgl_hicache.config.enums import (
    Compression,
    Fsync,
    KvEventsMedium,
    PrefetchPolicy,
    SpillAdmission,
    SpillBackend,
    WritePolicy,
)
from sgl_hicache.config.errors import ConfigError
from sgl_hicache.config.fields import build, convert, flag_named, flag_of, key_of, option, tuning
from sgl_hicache.config.mooncake import MooncakeConfig
from sgl_hicache.config.spill import MIN_IO_TIMEOUT_S, SpillConfig, TierConfig
from sgl_hicache.config.units import Bare, GiB, KiB, MiB, TiB, format_size, parse_size

__all__ = [
    "MIN_IO_TIMEOUT_S", "Bare", "Compression", "ConfigError", "Fsync", "GiB", "KiB", "KvEventsMedium", "MiB",
    "MooncakeConfig", "PrefetchPolicy", "SpillAdmission", "SpillBackend", "SpillConfig", "TiB", "TierConfig",
    "WritePolicy", "build", "convert", "flag_named", "flag_of", "format_size", "key_of", "option", "parse_size",
    "tuning",
]  # fmt: skip
