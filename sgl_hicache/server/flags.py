"""Command-line flags and `SGL_HICACHE_*` environment overrides, derived from `SpillConfig` fields.

Each user-settable field is a `Setting`: either a flag of its own (`config.option`,
`--hicache-spill-<field>` unless the field names its own) or a key of the one JSON flag
`--hicache-spill-extra-config` (`config.tuning`, the knobs few need, as sglang's
`--hicache-storage-backend-extra-config`). Each has one environment variable, named after its flag
(`--hicache-spill-capacity` → `SGL_HICACHE_SPILL_CAPACITY`) or key (`io_threads` →
`SGL_HICACHE_SPILL_IO_THREADS`). Precedence: flag or key, then environment, then the default.
Values are read in sglang's conventions (`server.values`). Nothing here imports sglang.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import shutil
import textwrap
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sgl_hicache.config import (
    Bare,
    ConfigError,
    MooncakeConfig,
    SpillBackend,
    SpillConfig,
    TierConfig,
    flag_of,
    format_size,
    key_of,
)
from sgl_hicache.server import values

EXTRA_CONFIG = "--hicache-spill-extra-config"
_EXTRA_DEST = "hicache_spill_extra_config"
GROUPS = {(): "spill and restore", ("tier",): "the tier directory"}  # flags grouped by config class


@dataclass(frozen=True)
class Setting:
    path: tuple[str, ...]  # e.g. ("tier", "capacity_bytes")
    type: Any
    default: Any
    help: str
    flag: str | None  # e.g. "--hicache-spill-capacity"; None for a key of EXTRA_CONFIG
    key: str | None  # e.g. "io_threads"; None for a setting with its own flag
    bare: Bare | None  # set for a byte size: what a number without a unit means

    @property
    def name(self) -> str:
        return self.path[-1]

    @property
    def dest(self) -> str:
        return "hicache_spill__" + "__".join(self.path)

    @property
    def env(self) -> str:
        name = self.flag.removeprefix("--").removeprefix("hicache-") if self.flag else f"spill_{self.key}"
        return "SGL_HICACHE_" + name.replace("-", "_").upper()

    @property
    def label(self) -> str:
        """How messages name it: its flag, or the extra config and its key."""
        return self.flag or f"{EXTRA_CONFIG} {self.key}"

    @property
    def metavar(self) -> str:
        if self.bare is not None:
            return "SIZE"
        if self.type is float:
            return "SECONDS" if self.name.endswith("_s") else "NUMBER"
        named = {int: "N", Path: "DIR", bool: "true|false", MooncakeConfig: "JSON"}
        return named.get(self.type) or "{" + ",".join(m.value for m in self.type) + "}"

    @property
    def shown_default(self) -> str:
        if self.bare is not None:
            return format_size(self.default)
        if self.type is MooncakeConfig:
            return "none"
        return str(self.default).lower() if self.type is bool else str(self.default)

    def from_text(self, text: str) -> Any:
        return values.from_text(self.type, self.bare, text)

    def from_json(self, value: Any) -> Any:
        return values.from_json(self.type, self.bare, value)


def settings() -> list[Setting]:
    """Every user-settable field: SpillConfig's own, then its nested configs'."""
    return list(_walk(SpillConfig, ()))


def flag_names() -> list[str]:
    """Every flag of ours (what the launcher takes before sglang's)."""
    return [s.flag for s in settings() if s.flag] + [EXTRA_CONFIG]


def _walk(cls: type, prefix: tuple[str, ...]) -> Iterator[Setting]:
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    for f in [f for f in fields if "help" in f.metadata]:
        key = key_of(f)
        flag = None if key else flag_of(f)
        yield Setting(
            (*prefix, f.name), hints[f.name], f.default, f.metadata["help"], flag, key, f.metadata["bare"]
        )
    for f in [f for f in fields if dataclasses.is_dataclass(hints[f.name])]:
        yield from _walk(hints[f.name], (*prefix, f.name))


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Our flags, grouped, on `parser` (their values are read by `config_from`)."""
    groups: dict[tuple[str, ...], Any] = {}
    for s in [s for s in settings() if s.flag]:
        where = s.path[:-1]
        if where not in groups:
            groups[where] = parser.add_argument_group(f"sgl_hicache: {GROUPS[where]}")
        kwargs: dict[str, Any] = {"dest": s.dest, "default": None}
        kwargs["help"] = f"{s.help} (default: {s.shown_default}; env {s.env})"
        if s.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["metavar"] = s.metavar
        groups[where].add_argument(s.flag, **kwargs)
    example = '{"io_threads": 16, "chunk_size": "8M"}'
    parser.add_argument_group("sgl_hicache: tuning").add_argument(
        EXTRA_CONFIG, dest=_EXTRA_DEST, metavar="JSON", default=None,
        help=f"the knobs below as one JSON object, e.g. '{example}'; a key given here beats its variable",
    )  # fmt: skip
    parser.add_argument_group(f"keys of {EXTRA_CONFIG}", description=_keys_table())


def _keys_table() -> str:
    """One row per key (a parser with RawDescriptionHelpFormatter shows it as is)."""
    width = max(shutil.get_terminal_size().columns - 2, 60)
    rows = []
    for s in [s for s in settings() if s.key]:
        head = f"{s.key} {s.metavar}"
        text = f"{s.help} (default: {s.shown_default}; env {s.env})"
        head = f"{head:<25} "  # a key wider than the column still gets a space before its text
        rows.append(textwrap.fill(text, width, initial_indent=head, subsequent_indent=" " * 26))
    return "\n".join(rows)


def config_from(
    args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None
) -> SpillConfig:
    """Build the config from parsed flags and the extra config over environment overrides; raises
    ConfigError (one line, naming the flag, key or variable)."""
    environ = os.environ if environ is None else environ
    extra = parse_extra(getattr(args, _EXTRA_DEST, None))
    given: dict[str, dict[str, Any]] = {"": {}, "tier": {}}
    sources: dict[str, str] = {}
    for s in settings():
        flag = getattr(args, s.dest, None) if s.flag and args is not None else None
        parse: Callable[[Any], Any]
        if s.key in extra:
            raw, source, parse = extra[s.key], s.label, s.from_json
        elif flag is not None:
            raw, source, parse = flag, s.label, s.from_text
        elif s.env in environ:
            raw, source, parse = environ[s.env], s.env, s.from_text
        else:
            continue
        try:
            value = raw if isinstance(raw, bool) and s.flag else parse(raw)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
        given["tier" if s.path[0] == "tier" else ""][s.name], sources[s.name] = value, source
    try:
        if given["tier"].get("backend") is SpillBackend.MOONCAKE:  # unset keys from MOONCAKE_* variables
            given["tier"]["mooncake"] = given["tier"].get("mooncake", MooncakeConfig()).with_env(environ)
        return SpillConfig(tier=TierConfig(**given["tier"]), **given[""])
    except ConfigError as e:
        labels = {s.name: s.label for s in settings()} | sources
        prefix = f"{labels[e.field]}: " if e.field in labels else ""
        raise ConfigError(f"{prefix}{e}", e.field) from None


def parse_extra(text: str | None) -> dict[str, Any]:
    """The keys of `--hicache-spill-extra-config`, still JSON values; ConfigError for text that is not
    a JSON object or for an unknown key (naming the closest and every known one)."""
    if text is None:
        return {}
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        why = f"{e.msg} (at character {e.pos})" if isinstance(e, json.JSONDecodeError) else type(e).__name__
        raise ConfigError(f"{EXTRA_CONFIG}: not a JSON object: {why}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{EXTRA_CONFIG}: not a JSON object: {json.dumps(data)[:40]}")
    known = sorted(s.key for s in settings() if s.key)
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(key, known, 1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ConfigError(f"{EXTRA_CONFIG}: unknown key {key!r} ({hint}known: {', '.join(known)})")
    return data


def refuse_unknown_ours(argv: list[str]) -> None:
    """ConfigError for the first argument left over by our parser that names one of ours (sglang has
    no `hicache-spill` flag): a knob that moved into the extra config, or a typo (with the closest)."""
    moved = {f"--hicache-spill-{s.key.replace('_', '-')}": s for s in settings() if s.key}
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if not arg.startswith("--") or "hicache-spill" not in name.replace("_", "-"):
            continue
        setting = moved.get(name.replace("--no-", "--", 1))
        if setting is None:
            raise ConfigError(unknown_flag(name, flag_names()))
        if setting.type is bool:
            value = "false" if name.startswith("--no-") else "true"
        elif not eq:
            value = argv[i + 1] if i + 1 < len(argv) else "..."
        example = f"'{{\"{setting.key}\": {_json_literal(value)}}}'"
        raise ConfigError(f"{name} moved into {EXTRA_CONFIG}: pass {EXTRA_CONFIG} {example}")


def unknown_flag(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, 1)
    return f"unknown flag {name}" + (f" (did you mean {close[0]}?)" if close else "")


def _json_literal(text: str) -> str:
    try:
        return json.dumps(json.loads(text))
    except (ValueError, RecursionError):
        return json.dumps(text)
