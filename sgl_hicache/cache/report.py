"""The spill cache's state for `GET /server_info` (`SpillRadixCache.report`).

The integrity verdict is opt-in (`SGL_HICACHE_REPORT_INTEGRITY=1`; otherwise `"off"`): the check
runs on the scheduler thread and lists every file of the tier, so any client of `GET /server_info`
could stall the scheduler by polling it on a large tier. Tests and debugging turn it on.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sgl_hicache.cache.spill_radix_cache import SpillRadixCache

INTEGRITY_ENV = "SGL_HICACHE_REPORT_INTEGRITY"


def spill_report(cache: SpillRadixCache, idle: bool) -> dict[str, Any]:
    """Counters, staging, early unpacking, tier stats and an integrity verdict."""
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
        "integrity": integrity_verdict(cache, idle),
        "tp_agreement": {
            "ranks": cache.agreement.size,
            "collectives": cache.agreement.calls,
            "seconds": round(cache.agreement.seconds, 6),
        },
    }


def integrity_verdict(cache: SpillRadixCache, idle: bool) -> str:
    """Verdict: "off" unless opted in, "skipped: ..." unless the scheduler is idle (running requests hold
    slots outside the tree), else "ok" or "failed: ..." (a tier file another process removed meanwhile
    is an OSError: a failure like any other, not an exception)."""
    if os.environ.get(INTEGRITY_ENV) != "1":
        return "off"
    if not idle:
        return "skipped: requests in flight"
    try:
        cache.check_integrity()
    except (AssertionError, OSError) as e:
        return f"failed: {e}"
    return "ok"
