"""Figures per system and workload, the best configuration of each peer, and the ratios of ours to
the baselines."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from benchmarks.bench.client import TIERS, Result
from benchmarks.bench.probe import total
from benchmarks.bench.spec import COMPARED, COMPARED_BY_KEY, FAMILIES, HICACHE, LMCACHE, Compared

NAN = float("nan")


@dataclass(frozen=True)
class Figures:
    """One system on one workload. Latencies in ms; NaN where nothing was measured."""

    requests: int
    errors: int
    resumed: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_resume_p50_ms: float
    ttft_resume_p90_ms: float
    itl_p50_ms: float
    throughput_tok_s: float  # output tokens of successful requests per second of the workload
    hit_rate: float  # cached prompt tokens / prompt tokens
    hit_rate_device: float
    hit_rate_host: float
    hit_rate_storage: float
    restore_gbps: float  # bytes restored from the system's disk tier per second spent restoring
    # sglang's own queue time (arrival to admission: waiting for device pool space, and for a
    # restore's reads where the cache defers admission), mean per request: the part of TTFT spent
    # before any prefill starts
    queue_mean_ms: float
    wall_s: float

    def to_json(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else NAN


def summarize(results: list[Result], wall_s: float, metrics: dict[str, float]) -> Figures:
    ok = [r for r in results if r.error is None]
    resumed = [r.ttft_ms for r in ok if r.resumed]
    prompt = sum(r.prompt_tokens for r in ok) or 1
    split = [r.cached for r in ok]
    by_tier = {t: NAN if None in split else sum(c[t] for c in split if c is not None) / prompt for t in TIERS}
    return Figures(
        requests=len(results),
        errors=len(results) - len(ok),
        resumed=len(resumed),
        ttft_p50_ms=pct([r.ttft_ms for r in ok], 50),
        ttft_p90_ms=pct([r.ttft_ms for r in ok], 90),
        ttft_resume_p50_ms=pct(resumed, 50),
        ttft_resume_p90_ms=pct(resumed, 90),
        itl_p50_ms=pct([x for r in ok for x in r.itl_ms], 50),
        throughput_tok_s=sum(len(r.output_ids) for r in ok) / wall_s if wall_s > 0 else NAN,
        hit_rate=sum(r.cached_tokens for r in ok) / prompt,
        hit_rate_device=by_tier["device"],
        hit_rate_host=by_tier["host"],
        hit_rate_storage=by_tier["storage"],
        restore_gbps=restore_gbps(metrics),
        queue_mean_ms=queue_mean_ms(metrics),
        wall_s=wall_s,
    )


def restore_gbps(metrics: dict[str, float]) -> float:
    """Ours: restored bytes over the restore-latency histogram's total seconds (the time from a
    restore's start to its KV being in the pool). Systems without those series: NaN."""
    seconds = total(metrics, "sglang:hicache_spill_restore_seconds_sum")
    nbytes = total(metrics, "sglang:hicache_spill_restored_bytes_total")
    return nbytes / seconds / 1e9 if seconds > 0 else NAN


def queue_mean_ms(metrics: dict[str, float]) -> float:
    """Mean of sglang's `queue_time_seconds` histogram over the workload, in ms (NaN: not served)."""
    count = total(metrics, "sglang:queue_time_seconds_count")
    return 1000 * total(metrics, "sglang:queue_time_seconds_sum") / count if count > 0 else NAN


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 and not math.isnan(a) and not math.isnan(b) else NAN


def best_of(
    figures: dict[str, Figures], members: Collection[str], figure: str | Compared = "ttft"
) -> str | None:
    """The strongest of a peer's configurations `members` *for `figure`* (a `Compared`, or the key
    of one of `spec.COMPARED`): the best value of that figure, a tie going to the best of the
    compared figures in their order, then to the name. Each figure of ours is judged against the
    configuration best at that figure, so no configuration's strength is left out. None if no
    configuration measured it."""
    first = figure if isinstance(figure, Compared) else COMPARED_BY_KEY[figure]
    keyed = [((_score(f, first), *(_score(f, c) for c in COMPARED if c is not first)), n)
             for n, f in figures.items() if n in members and not math.isnan(getattr(f, first.field))]  # fmt: skip
    return min(keyed)[1] if keyed else None


def _score(f: Figures, c: Compared) -> float:
    """Lower is better; NaN last."""
    value = getattr(f, c.field)
    return math.inf if math.isnan(value) else -value if c.higher_is_better else value


def best_hicache(figures: dict[str, Figures], figure: str = "ttft") -> str | None:
    """The strongest HiCache configuration for `figure` (`best_of`)."""
    return best_of(figures, HICACHE, figure)


def best_lmcache(figures: dict[str, Figures], figure: str = "ttft") -> str | None:
    """The strongest LMCache configuration for `figure` (`best_of`): its chunk size and tiers."""
    return best_of(figures, LMCACHE, figure)


def ratios(figures: dict[str, Figures]) -> dict[str, float]:
    """Ours over (a), the resident reference, the best configuration of each peer (`_vs_hicache`,
    `_vs_lmcache`: for each figure, the configuration best at it) and each peer configuration, for
    each compared figure (`spec.COMPARED`: resumed-turn TTFT p50, throughput), where both were
    measured."""
    out: dict[str, float] = {}
    ours = figures.get("ours")
    configs = [n for n in figures if any(n in members for members in FAMILIES.values())]
    for key in ("recompute", *FAMILIES, "resident", *configs):
        for c in COMPARED:
            base = best_of(figures, FAMILIES[key], c) if key in FAMILIES else key
            out[f"{c.key}_vs_{key}"] = _vs(ours, figures.get(base or ""), c.field)
    return out


def _vs(ours: Figures | None, base: Figures | None, name: str) -> float:
    return NAN if ours is None or base is None else ratio(getattr(ours, name), getattr(base, name))
