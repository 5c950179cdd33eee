"""Byte sizes: binary units, parsing (`200G`, `512MiB`) and formatting, and what a bare number means."""

from __future__ import annotations

import enum
import re

from sgl_hicache.config.errors import ConfigError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(?:i?B)?|(B))?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "K": KiB, "M": MiB, "G": GiB, "T": TiB}


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


class Bare(enum.Enum):
    """What a size setting makes of a number given without a unit."""

    GB = GiB  # gigabytes, sglang's unit (`--hicache-size 200` is 200 GB); binary, as all our units
    REFUSED = None  # refused with a hint: no unit would read naturally (a chunk of 4: bytes? MiB?)
