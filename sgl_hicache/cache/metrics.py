"""Prometheus metrics of the spill tier, in sglang's `sglang:` naming style.

sglang serves `/metrics` (with `--enable-metrics`) from its HTTP process by aggregating the
multiprocess files that every process writes under `PROMETHEUS_MULTIPROC_DIR`. Our metrics are
created in the scheduler process, after sglang set that directory, and are not registered in any
in-process registry (so building a second cache in one process never collides): their values reach
`/metrics` through those files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sgl_hicache.config import SpillConfig

BACKEND_NAME = "hicache_spill"
TIER_GAUGES = {  # TierStats field: (metric name, help)
    "bytes_stored": ("tier_used_bytes", "bytes of published extents in the tier"),
    "extents": ("tier_extents", "published extents in the tier"),
    "io_errors": ("tier_io_errors", "I/O errors the tier met since start (EIO, EACCES, EROFS, ...)"),
    "checksum_failures": ("tier_checksum_failures", "reads that failed verification since start"),
    "mismatches": ("tier_mismatches", "reads of extents that were not what their key names since start"),
    "no_space": ("tier_no_space", "stores refused for lack of space since start"),
    "evictions": ("tier_evictions", "extents the tier evicted to stay within its budget since start"),
    "recreations": ("tier_recreations", "times the tier directory was removed and re-created since start"),
}
RESTORE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

COUNTERS = {
    "match_requests": "prefix matches served by the spill cache",
    "evicted_tokens": "tokens evicted from the device KV pool",
    "spilled_tokens": "evicted tokens written to the tier",
    "written_through_tokens": "tokens submitted to the tier when cached (write_through policy), before any eviction",
    "writes_through_deferred": "write-throughs not submitted because staging was half full or more "
    "then (spill_io.BACKGROUND_SHARE; the next insert on the path tries again; eviction writes it otherwise)",
    "writes_through_too_large": "write-throughs never submitted because the node is larger than "
    "write-through's share of staging (eviction writes it; raise --hicache-spill-staging)",
    "spilled_bytes": "packed KV bytes submitted to the tier",
    "dropped_tokens": "evicted tokens dropped instead of spilled (tier off, slow or full, or too short)",
    "spill_failures": "spills the tier failed to write (I/O error, no space)",
    "spills_refused_staging_full": "evicted nodes dropped because staging was full then (writes in flight)",
    "spills_refused_too_large": "evicted nodes dropped because they are larger than all of staging "
    "(raise --hicache-spill-staging)",
    "restored_tokens": "tokens restored from the tier into the device pool",
    "restored_bytes": "packed KV bytes read back for restores",
    "restore_failures": "restores abandoned (miss, corruption, I/O error, timeout, no memory): recomputed",
    "corrupt_extents": "extents found corrupt or missing on read",
    "mismatch_extents": "extents whose header or length was not what their key names (never used as KV)",
    "flushes": "cache flushes (flush_cache, weight updates): each starts a new key epoch",
    "tp_disagreements": "decisions one TP rank could take and another could not (spill, restore, warm start): all took the safe one",
    "prefetch_requests": "arriving requests whose prefix runs into spilled KV (reads started at arrival)",
    "prefetch_issued": "extent reads started by a prefetch",
    "prefetch_coalesced": "prefetches that joined a read already started for the same extent",
    "prefetch_hits": "restores that found their read already started by a prefetch",
    "prefetch_abandoned": "prefetched reads released unused after their time to live",
    "reads_on_demand": "extent reads a restore had to start itself (no prefetch)",
    "restore_deferrals": "extent reads a restore found still in flight (its admission waited for them)",
    "restores_overtaken": "restores recomputed because the eviction that made room for them released "
    "bytes their readiness had found (a write finished, a read abandoned): never waited for",
    "internal_errors": "exceptions of our own logic in a call from sglang, contained: served as sglang's "
    "plain radix cache would (logged once per path)",
    "lookups": "cross-server lookups started (a prompt running past the tree: other servers' extents)",
    "lookup_fs_calls": "file system calls made by cross-server lookups",
    "lookup_found_tokens": "tokens cross-server lookups found verified on the tier",
    "lookup_attached_tokens": "tokens attached as spilled nodes from cross-server lookups",
    "lookup_refused": "lookup claims that failed verification (forged, foreign, inconsistent): never used",
    "lookup_stale": "lookup claims whose extent was gone (evicted or deleted by its writer): clean misses",
    "lookups_waited": "admission rounds a request skipped while its cross-server lookup ran",
    "restores_too_late": "restores given up because their reads outlasted the prefetch policy's limit",
}


@dataclass(frozen=True)
class SpillMetrics:
    """Counter totals kept in-process (`totals`, read by tests and `check_integrity`) and, when
    created with `create`, mirrored to Prometheus."""

    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0.0))
    prometheus: dict[str, Any] | None = None
    restore_seconds: Any = None  # Histogram child, when exported
    tier_gauges: dict[str, Any] | None = None  # TierStats field -> Gauge child, when exported

    @classmethod
    def create(cls, config: SpillConfig, tp_rank: int = 0) -> SpillMetrics:
        from prometheus_client import Counter, Gauge, Histogram

        labels = {"tp_rank": str(tp_rank)}
        names = list(labels)
        info = Gauge("sglang:hicache_spill_info", "1 while the sgl_hicache spill cache serves (labels say how)",
                     [*names, "backend", "enabled"], registry=None, multiprocess_mode="max")  # fmt: skip
        info.labels(**labels, backend=BACKEND_NAME, enabled=str(config.enabled).lower()).set(1)
        capacity = Gauge("sglang:hicache_spill_tier_capacity_bytes", "byte budget of the spill tier", names,
                         registry=None, multiprocess_mode="max")  # fmt: skip
        capacity.labels(**labels).set(config.tier.capacity_bytes)
        counters = {
            name: Counter(f"sglang:hicache_spill_{name}", doc, names, registry=None).labels(**labels)
            for name, doc in COUNTERS.items()
        }
        restore = Histogram("sglang:hicache_spill_restore_seconds", "time to restore a request's spilled KV",
                            names, registry=None, buckets=RESTORE_BUCKETS)  # fmt: skip
        gauges = {
            stat: Gauge(
                f"sglang:hicache_spill_{name}", doc, names, registry=None, multiprocess_mode="mostrecent"
            ).labels(**labels)
            for stat, (name, doc) in TIER_GAUGES.items()
        }
        return cls(prometheus=counters, restore_seconds=restore.labels(**labels), tier_gauges=gauges)

    def observe_restore(self, seconds: float) -> None:
        if self.restore_seconds is not None:
            self.restore_seconds.observe(seconds)

    def set_tier_stats(self, stats: Any) -> None:
        """Mirror the tier's own counters (a `TierStats`) to their gauges."""
        if self.tier_gauges is not None:
            for stat, gauge in self.tier_gauges.items():
                gauge.set(getattr(stats, stat))

    def inc(self, name: str, amount: float = 1) -> None:
        if amount:
            self.totals[name] += amount
            if self.prometheus is not None:
                self.prometheus[name].inc(amount)
