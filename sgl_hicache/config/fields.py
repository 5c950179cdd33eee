"""How a config field is declared (`option`: a flag; `tuning`: a key of the extra config), named,
and built from plain values (JSON, strings, environment variables) or turned back into them."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import field
from pathlib import Path
from typing import Any, TypeVar

from sgl_hicache.config.errors import ConfigError, require
from sgl_hicache.config.units import Bare


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


def to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
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
    require(not unknown, None, f"unknown {cls.__name__} settings: {', '.join(sorted(unknown))}")
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
