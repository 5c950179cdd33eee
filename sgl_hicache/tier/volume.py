"""Is the tier's volume large enough to hold one extent above the free-space watermark?

Every store keeps `min_free_bytes` free on the volume (capacity.py); on a volume whose total size is
not above that plus one extent, every store is refused and silently counted as no_space. Anything
larger can work (a volume of a few MiB above the watermark holds extents of a few MiB). The launcher
refuses such a configuration before sglang starts (`server/validate.py`, exit 2), with the least
extent its model can write (`server/room.py`); a server started otherwise (`sglang.launch_server`
with our backend) gets one warning at open.
"""

from __future__ import annotations

import os
from pathlib import Path

from sgl_hicache.config import Compression, GiB, KiB, MiB, TiB, TierConfig, flag_named, format_size
from sgl_hicache.tier.faults import logger
from sgl_hicache.tier.format import ALIGN, align_up

MIN_EXTENT_BYTES = 2 * ALIGN  # a header block and one payload block: no extent file is smaller


def extent_floor(payload_bytes: int, compression: Compression) -> int:
    """The least file size of an extent of at least `payload_bytes` raw bytes of KV (format.py): one
    4096-byte block of header at least, and the payload in whole blocks (compressed: one at least)."""
    payload = ALIGN if compression is Compression.ZSTD else align_up(max(payload_bytes, 1))
    return ALIGN + payload


def too_small(cfg: TierConfig, directory: Path, least: int = MIN_EXTENT_BYTES) -> str | None:
    """Why the volume of `directory` (an existing directory) cannot hold one extent of `least` bytes
    above `cfg.min_free_bytes`, in words that name the flag; None if it can, or if the volume reports
    no size (ramfs) or cannot be asked."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    total = st.f_blocks * st.f_frsize
    if not total or total >= cfg.min_free_bytes + least:
        return None
    flag = flag_named(TierConfig, "min_free_bytes")
    return (
        f"{flag}: the volume of {directory} holds {human(total)} in all, not above the "
        f"{format_size(cfg.min_free_bytes)} to keep free plus one extent (at least {format_size(least)}), so every "
        f"store would be refused (counted as no_space); lower {flag} or use a larger volume"
    )


def warn_if_too_small(cfg: TierConfig, directory: Path) -> None:
    reason = too_small(cfg, directory)
    if reason is not None:
        logger.warning("spill tier: %s", reason)


def human(n: int) -> str:
    """A byte count in binary units, at most one decimal: 64M, 1.5G, 4096."""
    for unit, size in (("T", TiB), ("G", GiB), ("M", MiB), ("K", KiB)):
        if n >= size:
            return f"{n / size:.1f}".removesuffix(".0") + unit
    return str(n)
