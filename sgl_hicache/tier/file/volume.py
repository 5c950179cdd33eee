"""The tier's volume: can it hold one extent above the free-space watermark, and how much is free now.

Every store keeps `min_free_bytes` free on the volume (budget/process.py); on a volume whose total size is
not above that plus one extent, every store is refused and silently counted as no_space. Anything
larger can work (a volume of a few MiB above the watermark holds extents of a few MiB). `too_small`
says so as a `VolumeShort`, in the config's terms: the server layer words it with the flag's name
(`server/room.py`). The launcher refuses such a configuration before sglang starts (exit 2), with
the least extent its model can write; a server started otherwise (`sglang.launch_server` with our
backend) gets one warning when its tier opens (`server/factory.py`).

`FreeSpace` keeps what the volume had free when last looked at (`TierStats.volume_free_bytes`, a
gauge): before every store, and about every second from an I/O thread (backend.py). The first eviction
that the free space forces (rather than the budget) is logged once; every one is counted apart
(`free_space_evictions`, budget/process.py).
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from sgl_hicache.config import Compression, GiB, KiB, MiB, TiB, TierConfig
from sgl_hicache.tier.faults import logger
from sgl_hicache.tier.file.paths import free_bytes
from sgl_hicache.tier.format import ALIGN, align_up

MIN_EXTENT_BYTES = 2 * ALIGN  # a header block and one payload block: no extent file is smaller


def extent_floor(payload_bytes: int, compression: Compression) -> int:
    """The least file size of an extent of at least `payload_bytes` raw bytes of KV (format.py): one
    4096-byte block of header at least, and the payload in whole blocks (compressed: one at least)."""
    payload = ALIGN if compression is Compression.ZSTD else align_up(max(payload_bytes, 1))
    return ALIGN + payload


@dataclass(frozen=True)
class VolumeShort:
    """A volume whose `total` bytes are not above `min_free` (`TierConfig.min_free_bytes`) plus
    `least`: it can never hold `least` bytes of extents above the watermark."""

    directory: Path
    total: int
    min_free: int
    least: int


def too_small(cfg: TierConfig, directory: Path, least: int = MIN_EXTENT_BYTES) -> VolumeShort | None:
    """The volume of `directory` (an existing directory) if it cannot hold `least` bytes of extents
    above `cfg.min_free_bytes`; None if it can, or if the volume reports no size (ramfs) or cannot
    be asked."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    total = st.f_blocks * st.f_frsize
    if not total or total >= cfg.min_free_bytes + least:
        return None
    return VolumeShort(directory, total, cfg.min_free_bytes, least)


UNKNOWN = -1  # `FreeSpace.last` before a look succeeded, or on a volume that reports no size (ramfs)


class FreeSpace:
    """The free space of the volume holding `directory`, as last measured (thread-safe)."""

    def __init__(self, directory: Path, min_free: int) -> None:
        self._directory, self._min_free = directory, min_free
        self._lock = threading.Lock()
        self._logged = False
        self.last = UNKNOWN

    def record(self, free: int | None) -> None:
        """What `paths.free_bytes` just said (None: the volume reports no size)."""
        self.last = UNKNOWN if free is None else free

    def refresh(self) -> None:
        """Measure and `record`, keeping the last value if the volume cannot be asked (the
        directory is gone: a store re-creates it; other faults are a store's to count). Never raises."""
        with contextlib.suppress(OSError):
            self.record(free_bytes(self._directory))

    def forced_eviction(self, free: int, nbytes: int) -> None:
        """Extents are evicted because writing `nbytes` would leave less than min-free: logged once."""
        with self._lock:
            first, self._logged = not self._logged, True
        if first:
            logger.warning(
                "spill tier: the volume of %s has %s free, and a store of %s would leave less than the "
                "%s to keep free (min_free_bytes): evicting extents below the budget to make room (logged "
                "once; counted in tier_free_space_evictions, free space in tier_volume_free_bytes)",
                self._directory, human(free), human(nbytes), human(self._min_free),
            )  # fmt: skip


def human(n: int) -> str:
    """A byte count in binary units, at most one decimal: 64M, 1.5G, 4096."""
    for unit, size in (("T", TiB), ("G", GiB), ("M", MiB), ("K", KiB)):
        if n >= size:
            return f"{n / size:.1f}".removesuffix(".0") + unit
    return str(n)
