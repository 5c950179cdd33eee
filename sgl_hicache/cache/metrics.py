"""Prometheus metrics of the spill tier, in sglang's shape.

sglang serves `/metrics` (with `--enable-metrics`) from its HTTP process by aggregating the
multiprocess files that every process writes under `PROMETHEUS_MULTIPROC_DIR`. Our metrics are
created in the scheduler process, after sglang set that directory, and are not registered in any
in-process registry (so building a second cache in one process never collides): their values reach
`/metrics` through those files.

The shape is sglang's: names `sglang:hicache_spill_*`; running totals are counters (`..._total`),
states are gauges; every series carries sglang's labels (`model_name`, `tp_rank`, `pp_rank`, and
whatever `--extra-metric-labels` adds); a family of reasons is one counter with a `reason` label
(`dropped_tokens_total{reason=...}`), as sglang does. `totals` keeps every count in-process too
(tests, `GET /server_info`), under the names of `COUNTERS`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sgl_hicache import BACKEND_NAME
from sgl_hicache.config import SpillConfig

TIER_GAUGES = {  # TierStats field: (metric name, help)
    "bytes_stored": ("tier_used_bytes", "bytes of published extents in the tier"),
    "extents": ("tier_extents", "published extents in the tier"),
    "volume_free_bytes": (
        "tier_volume_free_bytes",
        "free bytes on the tier's volume when last looked at "
        "(about every second; -1: unknown, or a tier without a volume)",
    ),
}
TIER_COUNTERS = {  # TierStats running totals: (metric name, help), exported as counters
    "io_errors": ("tier_io_errors", "I/O errors the tier met (EIO, EACCES, EROFS, ...)"),
    "checksum_failures": ("tier_checksum_failures", "reads that failed verification"),
    "mismatches": ("tier_mismatches", "reads of extents that were not what their key names"),
    "no_space": ("tier_no_space", "stores refused for lack of space"),
    "evictions": ("tier_evictions", "extents the tier evicted to stay within its budget"),
    "free_space_evictions": (
        "tier_free_space_evictions",
        "extents the tier evicted to keep "
        "--hicache-spill-min-free free on its volume (the volume is full below the budget)",
    ),
    "recreations": ("tier_recreations", "times the tier directory was removed and re-created"),
    "removed_bad_files": (
        "tier_removed_bad_files",
        "files in the tier that were not sound extents of this namespace's secret (corrupt, torn, "
        "foreign) and were removed, at the start scan or when a load met them (on a Mooncake Store: "
        "headers that did not verify, removed at a warm start)",
    ),
    "manifest_bad_records": (
        "tier_manifest_bad_records",
        "records of a Mooncake Store's manifest that did not verify at a warm start (another "
        "deployment's secret on this namespace, or tampered): skipped, kept",
    ),
    "written_bytes": (
        "tier_written_bytes",
        "bytes written to the tier: extent payloads as stored and their headers (files or Mooncake "
        "objects); a store that found its extent there already writes none",
    ),
    "purge_retries": (
        "tier_purge_retries",
        "purges the tier ran again because the store or file system failed them (retried until done)",
    ),
    "newer_extents": (
        "tier_newer_extents",
        "extents of a newer format version met and kept (a newer "
        "sgl_hicache shares the tier: finish the rolling upgrade)",
    ),
}
STAGING_GAUGES = {
    "staging_used_bytes": "host staging in use (extents on their way to the tier, reads on their way back)",
    "staging_peak_bytes": "the most host staging in use at once since start (size --hicache-spill-staging by it)",
    "staging_capacity_bytes": "host staging there is (--hicache-spill-staging, less staging_spoiled_bytes)",
}
STAGING_REFUSALS = (
    "staging_refusals",
    "staging blocks refused for lack of room (a spill then drops, a restore waits or recomputes): "
    "raise --hicache-spill-staging if it grows",
)
STAGING_HELD = (
    "staging_held_bytes",
    "host staging in use by what holds it (holder: write = a spill or write-through packing or on its "
    "way to the tier; restore = a read a restore in progress needs, its slots taken; restore_deferred = "
    "a read a restore attempt asked for, its request deferred or gone; prefetch = a prefetch's or hint's "
    "read no restore asked for yet; abandoned = a read given up, released when it completes; retiring = "
    "blocks given back, waiting for the device copy using them); sums to staging_used_bytes",
)
STAGING_HELD_TIME = (
    "staging_held_byte_seconds",
    "host staging held over time by holder (staging_held_bytes integrated, sampled at each poll of "
    "the cache: a block counts from the poll before it was taken to the poll that gave it back)",
)
STAGING_USED_TIME = (
    "staging_used_seconds",
    "seconds host staging spent with its use in each quarter of its capacity (used=0-25%, ..., "
    "75-100%), sampled at each poll of the cache",
)
USED_BANDS = ("0-25%", "25-50%", "50-75%", "75-100%")
AMPLIFICATION_GAUGE = (
    "tier_written_per_restored_byte",
    "bytes written to the tier per byte restored from it (tier_written_bytes / restored_bytes): write "
    "amplification; +Inf while written to but never restored from, 0 before the first write",
)
RESTORE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class DropReason(enum.StrEnum):
    """Why evicted tokens were dropped (recomputed if needed again) instead of spilled."""

    TOO_SHORT = "too_short"  # a leaf below min_spill_tokens (--hicache-spill-extra-config)
    STAGING_FULL = "staging_full"  # writes in flight held staging then (or a waiting restore's room)
    TOO_LARGE = "too_large"  # larger than all of staging
    NO_TIER = "no_tier"  # spill off (the tier did not open, or switched off after an internal error)
    UNNAMEABLE = "unnameable"  # a token id no key can name (outside 0..2**32-1)
    INTERNAL_ERROR = "internal_error"  # our logic raised: contained, dropped as sglang would
    TP_DISAGREEMENT = "tp_disagreement"  # another TP rank could not spill it
    NOT_ADMITTED = "not_admitted"  # --hicache-spill-admission: not reused, hinted, pinned nor long


class StagingHolder(enum.StrEnum):
    """What holds a block of host staging (`staging_held_bytes{holder}`: cache/staging_holders.py)."""

    WRITE = "write"  # a store's packed KV: packing, or on its way to the tier (its completion not taken)
    RESTORE = "restore"  # a read a restore in progress needs (its slots taken; open, or landing layer-wise)
    RESTORE_DEFERRED = "restore_deferred"  # a read a restore attempt asked for; no slots taken (deferred)
    PREFETCH = "prefetch"  # a read a prefetch or hint started that no restore attempt asked for yet
    ABANDONED = "abandoned"  # a read given up while in flight: released when its completion arrives
    RETIRING = "retiring"  # a block given back, waiting for the device copy (pack, unpack) using it


COUNTERS = {
    "match_requests": "prefix matches served by the spill cache",
    "evicted_tokens": "tokens evicted from the device KV pool",
    "spilled_tokens": "evicted tokens kept on the tier: submitted at eviction (one whose file is there already "
    "is only refreshed), or pointing at the copy written ahead, through, or restored from",
    "written_through_tokens": "tokens submitted to the tier when cached (write_through policy), before any eviction",
    "written_ahead_tokens": "tokens an idle server wrote to the tier before their eviction (clean_ahead): "
    "evicting them then copies nothing",
    "writes_through_deferred": "write-throughs not submitted because staging was half full or more "
    "then (staging_share.BACKGROUND_SHARE), or its room was kept for a restore's read (restore_reserve); "
    "the next insert on the path tries again; eviction writes it otherwise",
    "writes_through_too_large": "write-throughs never submitted because the node is larger than "
    "write-through's share of staging (eviction writes it; raise --hicache-spill-staging)",
    "spilled_bytes": "packed KV bytes submitted to the tier",
    "dropped_tokens": "evicted tokens dropped instead of spilled (by reason on /metrics: DropReason)",
    "spill_failures": "spills the tier failed to write (I/O error, no space)",
    "spills_refused_staging_full": "evicted nodes dropped because staging was full then (writes in flight)",
    "spills_refused_reserved": "evicted nodes dropped because their spill would have taken the room in "
    "staging a restore's read waited for (--hicache-spill-extra-config restore_reserve; their tokens "
    "count as staging_full)",
    "spills_refused_too_large": "evicted nodes dropped because they are larger than all of staging "
    "(raise --hicache-spill-staging)",
    "restored_tokens": "tokens restored from the tier into the device pool by restores that completed",
    "restored_bytes": "packed KV bytes read from the tier, verified and unpacked into the device pool by "
    "restores that completed (a restore from staging, its write still under way, reads none)",
    "restore_failures": "restores abandoned (miss, corruption, I/O error, timeout, no memory): recomputed",
    "corrupt_extents": "extents that failed verification on read (checksum, MAC, truncation, header)",
    "lost_extents": "extents gone when read (evicted or removed by another process, a store restarted): clean misses",
    "mismatch_extents": "extents whose header or length was not what their key names (never used as KV)",
    "flushes": "cache flushes (flush_cache, weight updates): each starts a new key epoch",
    "tp_disagreements": "decisions one TP rank could take and another could not (spill, restore, warm start): all took "
    "the safe one (not a read landing a scheduler round later on one rank: the others wait that round)",
    "prefetch_requests": "arriving requests whose prefix runs into spilled KV (reads started at arrival)",
    "prefetch_issued": "extent reads started by a prefetch",
    "prefetch_coalesced": "prefetches that joined a read already started for the same extent",
    "prefetch_hits": "restores that found their read already started by a prefetch",
    "prefetch_abandoned": "prefetched reads released unused after their time to live",
    "reads_taken_back": "landed prefetched reads given back (read again when their restore comes) so that an "
    "eviction's spill found room in staging instead of dropping its victim (take_back_reads), or a restore "
    "waiting for room could start its read (restores_take_back: those also in reads_taken_back_for_restores)",
    "reads_taken_back_tokens": "the tokens of the reads counted in reads_taken_back",
    "reads_taken_back_for_restores": "of reads_taken_back, those given back for a restore waiting for room in "
    "staging (restores_take_back), not for an eviction's spill",
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
    "restores_streamed": "restores completed that gave back the staging of extents already unpacked before "
    "their last read landed: their history streamed through staging (it need not fit at once)",
    "restore_staging_waits": "extent reads a restore could not start at once for lack of room in staging "
    "(other reads and writes held it): it waited for room, then streamed (prefetches yield meanwhile)",
    "restore_reads_yielded": "restore attempts that started no new read because another restore waited for "
    "room in staging first (restores_in_order: room goes to restores in the order they began waiting)",
    "restores_too_large": "restores recomputed because one extent's read is larger than all of staging "
    "(raise --hicache-spill-staging)",
    "staging_spoiled_bytes": "host staging set aside for good: blocks of failed reads whose transfer the "
    "tier gave up on and may still write them (a Mooncake transfer timeout); staging is that much smaller",
    # Layer-wise restores (--hicache-spill-layerwise, cache/layerwise.py):
    "layerwise_restores": "restores admitted layer-wise (the prefill starting once their first layer group landed)",
    "layerwise_overlapped_restores": "layer-wise restores admitted before their last layer group landed: "
    "the prefill ran while later layers were still read",
    "layerwise_failed_restores": "layer-wise restores whose later group failed (miss, corrupt, I/O error, timeout) "
    "after the prefill started: its requests were retracted and recomputed",
    "layerwise_retracted_requests": "requests retracted after a forward that read a failed layer-wise restore",
    "layerwise_dropped_tokens": "tokens of failed layer-wise restores dropped from the tree",
    "layerwise_wait_seconds": "seconds forwards waited for layer groups of restores in progress (I/O not hidden)",
    # Where a resumed turn's time goes (wall seconds on the scheduler's clock; a benchmark takes
    # their growth over one turn, `python -m benchmarks.long_history`):
    "restore_wait_seconds": "seconds admitted requests waited (deferred, the rest of the batch running; "
    "or held, nothing running) for the reads of their spilled prefix",
    "admission_holds": "first admission attempts that held the scheduler for their reads in flight "
    "instead of deferring (--hicache-spill-extra-config admission_hold)",
    "admission_holds_expired": "holds that ended with the restore still waiting (its budget spent, or a "
    "read restarted for room): deferred after all",
    "admission_hold_seconds": "seconds the scheduler thread held admission for reads in flight "
    "(counted in restore_wait_seconds too)",
    "restore_read_seconds": "seconds from the first read a restore used starting to the last one "
    "completing, when the tier finished it (verification included: the tier verifies as it reads; "
    "a layer-wise restore's too)",
    "restore_unpack_seconds": "seconds the scheduler thread spent issuing unpacks (on a GPU, enqueueing "
    "them on the copy stream; on CPU, the copies themselves)",
    "lookup_seconds": "seconds cross-server lookups ran (start to result taken by the scheduler)",
    "spill_pack_seconds": "seconds the scheduler thread spent issuing packs of evicted or written-through "
    "KV into staging (on a GPU, enqueueing them; on CPU, the copies themselves)",
    # Retention hints (cache/retention.py):
    "pins": "pin hints applied (POST /hicache/pin)",
    "pins_refused": "pin hints refused: over the pin budget (pin_share of the tier budget) or spill off",
    "pinned_spilled_tokens": "tokens of pinned conversations spilled (and kept by the tier until their TTL)",
    "pin_over_budget": "pinned extents the tier could not keep within the pin budget (left to its LRU)",
    "drops": "drop hints applied (POST /hicache/drop)",
    "purges": "purge hints applied (POST /hicache/purge)",
    "purges_incomplete": "purge hints whose tier cannot purge a cache_salt: device and tree only",
    "hint_dropped_tokens": "tokens removed from the tree (device or spilled) by drop and purge hints",
    "drop_kept_tokens": "tokens a drop or purge left on the device: in use by a running request",
}


# Counted in the family `dropped_tokens_total{reason}` on /metrics instead (tokens, by reason).
NOT_EXPORTED = ("dropped_tokens", "spills_refused_staging_full", "spills_refused_too_large")


def written_per_restored(written: float, restored: float) -> float | None:
    """Write amplification: bytes written to the tier per byte restored from it (None while nothing
    was restored)."""
    return written / restored if restored else None


def sglang_labels(server_args: Any, tp_rank: int) -> dict[str, str]:
    """The labels sglang's own collectors put on a scheduler's series (`model_name`, `tp_rank`,
    `pp_rank`; our backend refuses pipeline parallelism, so `pp_rank` is 0) and the operator's
    `--extra-metric-labels`."""
    # sglang names a model its served name, or its path when it has none (as its serving config does).
    model = getattr(server_args, "served_model_name", None) or getattr(server_args, "model_path", None) or ""
    labels = {"model_name": str(model), "tp_rank": str(tp_rank), "pp_rank": "0"}
    labels.update(
        {str(k): str(v) for k, v in (getattr(server_args, "extra_metric_labels", None) or {}).items()}
    )
    return labels


@dataclass(frozen=True)
class SpillMetrics:
    """Counter totals kept in-process (`totals`, `drops`; read by tests and `/server_info`) and,
    when created with `create`, mirrored to Prometheus."""

    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0.0))
    drops: dict[DropReason, float] = field(default_factory=lambda: dict.fromkeys(DropReason, 0.0))
    prometheus: dict[str, Any] | None = None
    dropped: dict[DropReason, Any] | None = None  # Counter children of dropped_tokens_total by reason
    restore_seconds: Any = None  # Histogram child, when exported
    tier_gauges: dict[str, Any] | None = None  # TierStats field -> Gauge child, when exported
    tier_counters: dict[str, Any] | None = None  # TierStats field -> Counter child, when exported
    staging_gauges: dict[str, Any] | None = None
    staging_refusals: Any = None  # Counter child of STAGING_REFUSALS, when exported
    amplification: Any = None  # Gauge child of AMPLIFICATION_GAUGE, when exported
    held_byte_seconds: dict[StagingHolder, float] = field(
        default_factory=lambda: dict.fromkeys(StagingHolder, 0.0)
    )
    used_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(USED_BANDS, 0.0))
    staging_held: dict[StagingHolder, Any] | None = None  # Gauge children of STAGING_HELD by holder
    held_time: dict[StagingHolder, Any] | None = None  # Counter children of STAGING_HELD_TIME by holder
    used_time: dict[str, Any] | None = None  # Counter children of STAGING_USED_TIME by band
    _tier_seen: dict[str, int] = field(default_factory=dict)  # last TierStats totals mirrored

    @classmethod
    def create(cls, config: SpillConfig, labels: Mapping[str, str]) -> SpillMetrics:
        """Exported metrics carrying `labels` (`sglang_labels`)."""
        from prometheus_client import Counter, Gauge, Histogram

        names = list(labels)

        def gauge(name: str, doc: str, mode: Any = "mostrecent", extra: tuple[str, ...] = ()) -> Any:
            return Gauge(
                f"sglang:hicache_spill_{name}", doc, [*names, *extra], registry=None, multiprocess_mode=mode
            )

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return Counter(f"sglang:hicache_spill_{name}", doc, [*names, *extra], registry=None)

        info = gauge(
            "info",
            "1 while the sgl_hicache spill cache serves (labels say how)",
            "max",
            ("backend", "enabled"),
        )
        info.labels(**labels, backend=BACKEND_NAME, enabled=str(config.enabled).lower()).set(1)
        gauge("tier_capacity_bytes", "byte budget of the spill tier", "max").labels(**labels).set(
            config.tier.capacity_bytes
        )
        dropped = counter(
            "dropped_tokens", "evicted tokens dropped instead of spilled, by reason", ("reason",)
        )
        held = gauge(*STAGING_HELD, extra=("holder",))
        held_time = counter(*STAGING_HELD_TIME, extra=("holder",))
        used_time = counter(*STAGING_USED_TIME, extra=("used",))
        restore = Histogram("sglang:hicache_spill_restore_seconds", "time to restore a request's spilled KV",
                            names, registry=None, buckets=RESTORE_BUCKETS)  # fmt: skip
        return cls(
            prometheus={
                n: counter(n, doc).labels(**labels) for n, doc in COUNTERS.items() if n not in NOT_EXPORTED
            },
            dropped={r: dropped.labels(**labels, reason=r.value) for r in DropReason},
            restore_seconds=restore.labels(**labels),
            tier_gauges={k: gauge(n, doc).labels(**labels) for k, (n, doc) in TIER_GAUGES.items()},
            tier_counters={k: counter(n, doc).labels(**labels) for k, (n, doc) in TIER_COUNTERS.items()},
            staging_gauges={n: gauge(n, doc).labels(**labels) for n, doc in STAGING_GAUGES.items()},
            staging_refusals=counter(*STAGING_REFUSALS).labels(**labels),
            amplification=gauge(*AMPLIFICATION_GAUGE).labels(**labels),
            staging_held={h: held.labels(**labels, holder=h.value) for h in StagingHolder},
            held_time={h: held_time.labels(**labels, holder=h.value) for h in StagingHolder},
            used_time={b: used_time.labels(**labels, used=b) for b in USED_BANDS},
        )

    def observe_restore(self, seconds: float) -> None:
        if self.restore_seconds is not None:
            self.restore_seconds.observe(seconds)

    def set_tier_stats(self, stats: Any) -> None:
        """Mirror the tier's own state (a `TierStats`): gauges as they are, running totals as what
        they grew by since the last call."""
        if self.tier_gauges is not None:
            for stat, gauge in self.tier_gauges.items():
                gauge.set(getattr(stats, stat))
        if self.tier_counters is not None:
            for stat, counter in self.tier_counters.items():
                now = int(getattr(stats, stat))
                grown = now - self._tier_seen.get(stat, 0)
                if grown > 0:
                    counter.inc(grown)
                self._tier_seen[stat] = now
        if self.amplification is not None:
            written = int(getattr(stats, "written_bytes", 0))
            ratio = written_per_restored(written, self.totals["restored_bytes"])
            self.amplification.set(ratio if ratio is not None else math.inf if written else 0.0)

    def set_staging(self, used: int, peak: int, capacity: int, refused: int = 0) -> None:
        """Mirror the staging pool: gauges as they are, `refused` (its running total) as a counter."""
        if self.staging_refusals is not None:
            grown = refused - self._tier_seen.get(STAGING_REFUSALS[0], 0)
            if grown > 0:
                self.staging_refusals.inc(grown)
            self._tier_seen[STAGING_REFUSALS[0]] = refused
        if self.staging_gauges is not None:
            values = {
                "staging_used_bytes": used,
                "staging_peak_bytes": peak,
                "staging_capacity_bytes": capacity,
            }
            for name, gauge in self.staging_gauges.items():
                gauge.set(values[name])

    def set_staging_held(self, held: Mapping[StagingHolder, int]) -> None:
        """Mirror staging in use by holder (a holder not in `held` holds nothing)."""
        if self.staging_held is not None:
            for holder, gauge in self.staging_held.items():
                gauge.set(held.get(holder, 0))

    def add_staging_time(self, held: Mapping[StagingHolder, int], seconds: float, band: str) -> None:
        """Staging held as `held` for `seconds`, its use in quarter `band` (`USED_BANDS`) of its capacity."""
        self.used_seconds[band] += seconds
        if self.used_time is not None:
            self.used_time[band].inc(seconds)
        for holder, nbytes in held.items():
            if nbytes and seconds:
                self.held_byte_seconds[holder] += nbytes * seconds
                if self.held_time is not None:
                    self.held_time[holder].inc(nbytes * seconds)

    def drop(self, tokens: int, reason: DropReason) -> None:
        """Evicted tokens dropped instead of spilled, and why."""
        if tokens:
            self.totals["dropped_tokens"] += tokens
            self.drops[reason] += tokens
            if self.dropped is not None:
                self.dropped[reason].inc(tokens)

    def inc(self, name: str, amount: float = 1) -> None:
        if amount:
            self.totals[name] += amount
            if self.prometheus is not None and name in self.prometheus:
                self.prometheus[name].inc(amount)
