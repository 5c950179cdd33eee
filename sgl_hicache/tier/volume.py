"""Is the tier's volume large enough to be useful above the free-space watermark?

Every store keeps `min_free_bytes` free on the volume (capacity.py); on a volume whose total size is
not above that plus a useful capacity, every store is refused and silently counted as no_space.
The launcher refuses such a configuration before sglang starts (`server/validate.py`, exit 2); a
server started otherwise (`sglang.launch_server` with our backend) gets one warning at open.
"""

from __future__ import annotations

import os
from pathlib import Path

from sgl_hicache.config import GiB, KiB, MiB, TiB, TierConfig, flag_named
from sgl_hicache.tier.faults import logger

USEFUL_BYTES = 256 * MiB  # the least room for extents worth having (or the capacity, if smaller)


def too_small(cfg: TierConfig, directory: Path) -> str | None:
    """Why the volume of `directory` (an existing directory) cannot hold a useful tier above
    `cfg.min_free_bytes`, in words that name the flag; None if it can, or if the volume reports no
    size (ramfs) or cannot be asked."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    total = st.f_blocks * st.f_frsize
    useful = min(cfg.capacity_bytes, USEFUL_BYTES)
    if not total or total >= cfg.min_free_bytes + useful:
        return None
    flag = flag_named(TierConfig, "min_free_bytes")
    return (
        f"{flag}: the volume of {directory} holds {human(total)} in all, not above the "
        f"{human(cfg.min_free_bytes)} to keep free plus {human(useful)} for extents, so every store "
        f"would be refused (counted as no_space); lower {flag} or use a larger volume"
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
