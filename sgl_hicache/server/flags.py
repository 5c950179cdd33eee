"""Command-line flags and `SGL_HICACHE_*` environment overrides, derived from `SpillConfig` fields.

Each user-settable field (declared with `config.option`) becomes one flag, `--hicache-spill-<field>`
unless the field names its own, and one environment variable named after the flag
(`--hicache-spill-capacity` → `SGL_HICACHE_SPILL_CAPACITY`). Precedence: flag, then environment,
then the dataclass default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from sgl_hicache.config import ConfigError, SpillConfig, TierConfig, convert, flag_of, format_size


@dataclass(frozen=True)
class Flag:
    path: tuple[str, ...]  # e.g. ("tier", "capacity_bytes")
    name: str  # e.g. "--hicache-spill-capacity"
    type: Any
    default: Any
    help: str

    @property
    def dest(self) -> str:
        return "hicache_spill__" + "__".join(self.path)

    @property
    def env(self) -> str:
        return (
            "SGL_HICACHE_" + self.name.removeprefix("--").removeprefix("hicache-").replace("-", "_").upper()
        )


def spill_flags() -> list[Flag]:
    return list(_walk(SpillConfig, ()))


def _walk(cls: type, prefix: tuple[str, ...]) -> Iterator[Flag]:
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _walk(hints[f.name], (*prefix, f.name))
        elif "help" in f.metadata:
            yield Flag((*prefix, f.name), flag_of(f), hints[f.name], f.default, f.metadata["help"])


def add_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sgl_hicache spill tier")
    for flag in spill_flags():
        shown = (
            format_size(flag.default)
            if isinstance(flag.default, int) and flag.default >= 1024
            else flag.default
        )
        kwargs: dict[str, Any] = {
            "dest": flag.dest,
            "default": None,
            "help": f"{flag.help} (default: {shown}; env {flag.env})",
        }
        if flag.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["metavar"] = flag.type.__name__.upper() if flag.type in (int, float) else None
        group.add_argument(flag.name, **kwargs)


def config_from(
    args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None
) -> SpillConfig:
    """Build the config from parsed flags over environment overrides; raises ConfigError."""
    environ = os.environ if environ is None else environ
    values: dict[str, dict[str, Any]] = {"": {}, "tier": {}}
    for flag in spill_flags():
        raw = getattr(args, flag.dest, None) if args is not None else None
        source = flag.name
        if raw is None and flag.env in environ:
            raw, source = environ[flag.env], flag.env
        if raw is None:
            continue
        try:
            value = convert(flag.type, raw)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
        values["tier" if flag.path[0] == "tier" else ""][flag.path[-1]] = value
    try:
        return SpillConfig(tier=TierConfig(**values["tier"]), **values[""])
    except ConfigError as e:
        names = {flag.path[-1]: flag.name for flag in spill_flags()}
        prefix = f"{names[e.field]}: " if e.field in names else ""
        raise ConfigError(f"{prefix}{e}", e.field) from None
