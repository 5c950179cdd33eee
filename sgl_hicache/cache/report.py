"""The spill cache's state for `GET /server_info` (`SpillRadixCache.report`)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sgl_hicache.cache.spill_radix_cache import SpillRadixCache


def spill_report(cache: SpillRadixCache, idle: bool) -> dict[str, Any]:
    """Counters, staging, early unpacking, tier stats and an integrity verdict. The check needs an
    idle scheduler (running requests hold slots outside the tree): otherwise the verdict says it
    was skipped."""
    integrity = "skipped: requests in flight"
    if idle:
        try:
            cache.check_integrity()
            integrity = "ok"
        except AssertionError as e:
            integrity = f"failed: {e}"
    io = cache.spill_io
    return {
        "spilled_tokens_in_tree": cache.spilled_tokens,
        "counters": dict(cache.spill_metrics.totals),
        "staging_used_bytes": io.staging.used_bytes if io else 0,
        "staging_capacity_bytes": io.staging.capacity_bytes if io else 0,
        "staging_peak_bytes": io.staging.peak_bytes if io else 0,
        "staging_refused": io.staging.refused if io else 0,
        "writes_in_flight": io.writes_in_flight if io else 0,
        "partial_restores": len(cache.partial_restores.held_slots()),
        "early_unpack": dataclasses.asdict(cache.partial_restores.stats),
        "tier": dataclasses.asdict(io.tier.stats()) if io else None,
        "integrity": integrity,
    }
