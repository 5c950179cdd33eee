"""A user's value for a setting, in sglang's conventions, converted to the field's type.

Text comes from a flag or an `SGL_HICACHE_*` variable; JSON values from a key of
`--hicache-spill-extra-config`, whose JSON type must fit: a count is an integer, a switch `true` or
`false`, a size a string with its unit, a choice a string, seconds a number. Sizes: a number without
a unit is GB where the field says so (`Bare.GB`, sglang's unit), else refused with a hint. Counts
take integers only (`1.9` is refused, never truncated); seconds must be finite. Every refusal is a
`ConfigError` of one line that the caller prefixes with the flag, key or variable.
"""

from __future__ import annotations

import enum
import json
import math
import re
from pathlib import Path
from typing import Any

from sgl_hicache.config import Bare, ConfigError, MooncakeConfig, parse_size

_INTEGER = re.compile(r"^\s*[+-]?\d+\s*$")
_SWITCH = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}


def from_text(tp: Any, bare: Bare | None, text: str) -> Any:
    """`text` (a flag's value or a variable) as a value of field type `tp`."""
    if bare is not None:
        return parse_size(text, bare.value)
    if tp is bool:
        if text.strip().lower() not in _SWITCH:
            raise ConfigError(f"expected a boolean (true/false, yes/no, on/off, 1/0), got {text!r}")
        return _SWITCH[text.strip().lower()]
    if tp is int:
        if not _INTEGER.match(text):
            raise ConfigError(f"expected an integer, got {text!r}")
        return int(text)
    if tp is float:
        return _finite(text)
    if tp is MooncakeConfig:
        return MooncakeConfig.from_user(_json_object(text))
    return _plain(tp, text)


def _json_object(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        why = f"{e.msg} (at character {e.pos})" if isinstance(e, json.JSONDecodeError) else type(e).__name__
        raise ConfigError(f"not a JSON object: {why}") from None


def from_json(tp: Any, bare: Bare | None, value: Any) -> Any:
    """JSON `value` (a key of the extra config) as a value of field type `tp`."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if bare is not None:
        _expect(isinstance(value, str) or number, value, 'a size such as "4M"')
        return parse_size(str(value), bare.value)
    if tp is bool:
        _expect(isinstance(value, bool), value, "true or false")
        return value
    if tp is int:
        _expect(number and isinstance(value, int), value, "an integer")
        return value
    if tp is float:
        _expect(number, value, "a finite number")
        return _finite(value)
    _expect(isinstance(value, str), value, "a string")
    return _plain(tp, value)


def _expect(fits: bool, value: Any, what: str) -> None:
    if not fits:
        raise ConfigError(f"expected {what}, got {json.dumps(value)}")


def _finite(value: Any) -> float:
    try:
        number = float(value)
    except (ValueError, OverflowError):
        number = math.nan
    if not math.isfinite(number):
        raise ConfigError(f"expected a finite number, got {value!r}")
    return number


def _plain(tp: Any, text: str) -> Any:
    """A choice (an enum's value, or an alias it accepts) or a path."""
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(text)
        except ValueError:
            choices = ", ".join(m.value for m in tp)
            raise ConfigError(f"invalid choice {text!r} (choose from {choices})") from None
    return Path(text) if tp is Path else text
