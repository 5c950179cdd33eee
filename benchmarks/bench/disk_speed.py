"""The disk's read speed, and HiCache's `timeout` prefetch policy tuned to it (`hicache-timeout-tuned`).

Under `--hicache-storage-prefetch-policy timeout`, sglang 0.5.23 lets a request wait for its L3
prefetch `prefetch_timeout_base + tokens / 1024 * prefetch_timeout_per_ki_token` seconds, then admits
it with what has arrived and recomputes the rest (`UnifiedRadixCache._start_storage_prefetch_wait`;
`prefetch_timeout_per_page = page_size / 1024 * prefetch_timeout_per_ki_token`). Both are keys of
`--hicache-storage-backend-extra-config` (`HybridCacheController.parse_storage_backend_extra_config`),
defaulting to 1 s and 0.25 s: a fixed guess, which cuts a read short on a disk slower than
1024 tokens' KV per 0.25 s (SmolLM2: 90 MiB/s; an 8B model's 128 KiB a token: 512 MiB/s) and lets a
request wait on a stalled one on a faster disk. Tuned, the per-Ki-token timeout is the time the
measured disk takes to read 1024 tokens' KV, times a margin; the base is a scheduler round's slack.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.bench.spec import HICACHE, Shape
from sgl_hicache.tier.directio import O_DIRECT, alloc_aligned, probe_direct_io

MiB = 2**20
TUNED_MARGIN = 2.0  # the timeout is this many times the measured read time
# The fixed part: a scheduler round on a busy CPU and the `file` backend's per-page file opens, not
# the disk (sglang's default: 1 s).
TUNED_BASE_S = 0.5


@dataclass(frozen=True)
class PrefetchTimeouts:
    """sglang's two prefetch timeout settings (`timeout` policy)."""

    base_s: float
    per_ki_token_s: float

    def extra_config(self) -> dict[str, float]:
        """The `--hicache-storage-backend-extra-config` keys that set them."""
        return {"prefetch_timeout_base": self.base_s, "prefetch_timeout_per_ki_token": self.per_ki_token_s}

    def timeout_s(self, tokens: int) -> float:
        """How long sglang lets a prefetch of `tokens` run (its formula, at any page size)."""
        return self.base_s + tokens / 1024 * self.per_ki_token_s


def tuned_timeouts(kv_bytes_per_token: int, read_mib_s: float, margin: float = TUNED_MARGIN,
                   base_s: float = TUNED_BASE_S) -> PrefetchTimeouts:  # fmt: skip
    """Timeouts that let a prefetch read at `read_mib_s` finish `margin` times over: per Ki tokens,
    `margin` x the seconds 1024 tokens' KV (`kv_bytes_per_token` each) take at that speed."""
    if kv_bytes_per_token < 1 or not read_mib_s > 0 or margin < 1 or base_s < 0:
        raise ValueError(
            f"tuned timeouts need KV bytes >= 1, a read speed > 0, margin >= 1 and base >= 0; got "
            f"{kv_bytes_per_token}, {read_mib_s}, {margin}, {base_s}"
        )
    return PrefetchTimeouts(base_s, margin * kv_bytes_per_token * 1024 / (read_mib_s * MiB))


def measure_read_mib_s(directory: Path, size_mib: int = 64, block_mib: int = 1) -> float:
    """The cold sequential read speed of the disk under `directory`, MiB/s: a file of `size_mib`
    written there (and synced), then read back in `block_mib` reads with O_DIRECT where the file
    system takes it, else after evicting it from the page cache; the file is removed. One thread,
    as HiCache's `file` backend reads a request's pages."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f".read-speed-{uuid.uuid4().hex}"
    block = alloc_aligned(block_mib * MiB)
    direct = probe_direct_io(directory)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            for i in range(0, size_mib, block_mib):
                os.pwrite(fd, block, i * MiB)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        fd = os.open(path, os.O_RDONLY | (O_DIRECT if direct else 0))
        try:
            t0, offset = time.perf_counter(), 0
            while (n := os.preadv(fd, [block], offset)) > 0:
                offset += n
            seconds = time.perf_counter() - t0
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    return offset / MiB / max(seconds, 1e-9)


def measured_shape(shape: Shape, names: Iterable[str], directory: Path) -> Shape:
    """`shape` with the disk's read speed where one of `names` is tuned to it and none was given:
    measured under `directory` (where the run's tiers go), and said in one line on stderr."""
    tuned = [n for n in names if n in HICACHE and HICACHE[n].tuned_timeout]
    if not tuned or shape.disk_read_mib_s is not None:
        return shape
    speed = measure_read_mib_s(directory)
    print(f"bench: the disk under {directory} reads {speed:.0f} MiB/s (cold, sequential); {', '.join(tuned)} "
          "is tuned to it", file=sys.stderr)  # fmt: skip
    return replace(shape, disk_read_mib_s=speed)
