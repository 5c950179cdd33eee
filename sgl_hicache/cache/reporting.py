"""What `GET /server_info` shows of the cache (the `hicache_spill` key, server/hooks.py): the tree's
spilled tokens, every counter, staging, writes and early unpacking, the tier's stats, the TP
agreement's cost, and an opt-in integrity verdict. Reads only: nothing here changes state.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Protocol

from sgl_hicache.cache.agreement import Agreement
from sgl_hicache.cache.controller import SpillController
from sgl_hicache.cache.metrics import SpillMetrics, written_per_restored
from sgl_hicache.cache.restores import EarlyUnpackStats
from sgl_hicache.cache.tree import SpillTree

INTEGRITY_ENV = "SGL_HICACHE_REPORT_INTEGRITY"


class Checked(Protocol):
    def check_integrity(self) -> None: ...


class ReportingCache(Checked, Protocol):
    """What the report reads of the cache (`SpillRadixCache` is one)."""

    controller: SpillController | None
    tree: SpillTree
    spill_metrics: SpillMetrics
    agreement: Agreement


def report(cache: ReportingCache, idle: bool) -> dict[str, Any]:
    """Counters, staging, tier stats and an integrity verdict (see the module doc)."""
    io = io_report(cache.controller) if cache.controller is not None else NO_CONTROLLER
    written = io["tier"]["written_bytes"] if io["tier"] is not None else 0
    return {
        "spilled_tokens_in_tree": cache.tree.spilled_tokens,
        "counters": dict(cache.spill_metrics.totals),
        **io,
        "tier_written_per_restored_byte": written_per_restored(
            written, cache.spill_metrics.totals["restored_bytes"]
        ),
        "integrity": integrity_verdict(cache, idle),
        "tp_agreement": {
            "ranks": cache.agreement.size,
            "collectives": cache.agreement.calls,
            "seconds": round(cache.agreement.seconds, 6),
        },
    }


def integrity_verdict(cache: Checked, idle: bool) -> str:
    """Opt-in (`SGL_HICACHE_REPORT_INTEGRITY=1`; else "off"): the check runs on the scheduler
    thread and lists every file of the tier, so any client polling `/server_info` could stall
    the scheduler. "skipped: ..." unless idle (running requests hold slots outside the tree),
    else "ok" or "failed: ..." (a tier file another process removed meanwhile is an OSError)."""
    if os.environ.get(INTEGRITY_ENV) != "1":
        return "off"
    if not idle:
        return "skipped: requests in flight"
    try:
        cache.check_integrity()
    except (AssertionError, OSError) as e:
        return f"failed: {e}"
    return "ok"


def io_report(ctl: SpillController) -> dict[str, Any]:
    """The controller's staging, writes and early unpacking, and the tier's stats."""
    return {
        "staging_used_bytes": ctl.staging.used_bytes,
        "staging_capacity_bytes": ctl.staging.capacity_bytes,
        "staging_peak_bytes": ctl.staging.peak_bytes,
        "staging_refused": ctl.staging.refused,
        "staging_held_bytes": {h.value: n for h, n in ctl.staging_held().items()},
        "staging_pinned": ctl.staging.pinned,
        "writes_in_flight": ctl.writes_in_flight,
        "partial_restores": len(ctl.restores.held_slots()),
        "early_unpack": dataclasses.asdict(ctl.restores.stats),
        "tier": dataclasses.asdict(ctl.tier.stats()),
    }


NO_CONTROLLER: dict[str, Any] = {
    "staging_used_bytes": 0, "staging_capacity_bytes": 0, "staging_peak_bytes": 0, "staging_refused": 0,
    "staging_held_bytes": {}, "staging_pinned": False, "writes_in_flight": 0, "partial_restores": 0,
    "early_unpack": vars(EarlyUnpackStats()), "tier": None,
}  # fmt: skip
