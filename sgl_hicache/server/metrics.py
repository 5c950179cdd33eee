"""Prometheus metrics of the spill tier, in sglang's `sglang:` naming style.

sglang serves `/metrics` (with `--enable-metrics`) from its HTTP process by aggregating the
multiprocess files that every process writes under `PROMETHEUS_MULTIPROC_DIR`. Our metrics are
created in the scheduler process, after sglang set that directory, and are not registered in any
in-process registry (so building a second cache in one process never collides): their values reach
`/metrics` through those files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sgl_hicache.config import SpillConfig

BACKEND_NAME = "hicache_spill"


@dataclass(frozen=True)
class SpillMetrics:
    info: Any
    tier_capacity_bytes: Any
    match_requests: Any
    evicted_tokens: Any
    dropped_tokens: Any

    @classmethod
    def create(cls, config: SpillConfig, tp_rank: int = 0) -> SpillMetrics:
        from prometheus_client import Counter, Gauge

        labels = {"tp_rank": str(tp_rank)}
        names = list(labels)
        info = Gauge(
            "sglang:hicache_spill_info",
            "1 while the sgl_hicache spill cache serves (labels say how)",
            [*names, "backend", "enabled"],
            registry=None,
            multiprocess_mode="max",
        )
        info.labels(**labels, backend=BACKEND_NAME, enabled=str(config.enabled).lower()).set(1)
        capacity = Gauge(
            "sglang:hicache_spill_tier_capacity_bytes",
            "byte budget of the spill tier",
            names,
            registry=None,
            multiprocess_mode="max",
        )
        capacity.labels(**labels).set(config.tier.capacity_bytes)

        def counter(name: str, doc: str) -> Any:
            return Counter(f"sglang:hicache_spill_{name}", doc, names, registry=None).labels(**labels)

        return cls(
            info=info,
            tier_capacity_bytes=capacity,
            match_requests=counter("match_requests", "prefix matches served by the spill cache"),
            evicted_tokens=counter("evicted_tokens", "tokens evicted from the device KV pool"),
            dropped_tokens=counter("dropped_tokens", "evicted tokens dropped instead of spilled"),
        )
