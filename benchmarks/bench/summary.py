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
    # Resumed turns by where most of their reusable prefix (`Result.prefix_tokens`) was found: on the
    # device (resident), in host memory or on disk (restored), nowhere (recomputed: prefilled again)
    resumed_resident: int
    resumed_restored: int
    resumed_recomputed: int
    # The same resumed turns split by whether each was sent before the request it follows (its
    # conversation's previous turn) had finished: `early_*` (a cache that looks a request up once, on
    # arrival, cannot find that turn's KV yet), `late_*` the others (`early_sources`). Only the open-loop
    # trace replays send early; in multi-turn and agents a turn waits for its previous answer, so
    # there every resumed turn is late
    early_resumes: int
    early_resident: int
    early_restored: int
    early_recomputed: int
    late_resumes: int
    late_resident: int
    late_restored: int
    late_recomputed: int
    tokens_restored: float  # prompt tokens served from host memory or disk
    tokens_recomputed: float  # of resumed turns' reusable prefixes, the tokens prefilled again
    disk_write_mb: float  # written to disk by the system's processes over the workload (`disk_writes`)
    # disk bytes written per byte restored (tokens_restored x the model's KV bytes per token); NaN
    # where nothing was restored
    write_per_restored: float

    def to_json(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else NAN


def summarize(results: list[Result], wall_s: float, metrics: dict[str, float], written_bytes: float = NAN,
              kv_bytes_per_token: int = 0) -> Figures:  # fmt: skip
    """`written_bytes`: what the system wrote to disk over the workload (NaN: not measured);
    `kv_bytes_per_token`: the model's, to turn restored tokens into bytes."""
    ok = [r for r in results if r.error is None]
    resumed = [r.ttft_ms for r in ok if r.resumed]
    prompt = sum(r.prompt_tokens for r in ok) or 1
    split = [r.cached for r in ok]
    by_tier = {t: NAN if None in split else sum(c[t] for c in split if c is not None) / prompt for t in TIERS}
    restored = NAN if None in split else float(sum(c["host"] + c["storage"] for c in split if c is not None))
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
        **{f"resumed_{k}": n for k, n in resumed_sources(ok).items()},
        **early_sources(results),
        tokens_restored=restored,
        tokens_recomputed=float(sum(max(0, r.prefix_tokens - r.cached_tokens) for r in ok if r.resumed)),
        disk_write_mb=written_bytes / 2**20,
        write_per_restored=ratio(written_bytes, restored * kv_bytes_per_token),
    )


SOURCES = ("resident", "restored", "recomputed")


def source(r: Result) -> str | None:
    """Where most of a request's reusable prefix came from: the device ("resident"), host memory or
    disk ("restored"), or nowhere ("recomputed"); a tie goes to the first of those. None where the
    answer named no split by tier or there was no prefix to reuse."""
    if r.cached is None or r.prefix_tokens <= 0:
        return None
    device, lower = r.cached["device"], r.cached["host"] + r.cached["storage"]
    missing = max(0, r.prefix_tokens - device - lower)
    return max((device, 2, "resident"), (lower, 1, "restored"), (missing, 0, "recomputed"))[2]


def resumed_sources(results: list[Result]) -> dict[str, int]:
    """How many resumed turns of `results` found their prefix where (`source`)."""
    found = [source(r) for r in results if r.resumed]
    return {s: found.count(s) for s in SOURCES}


def arrived_early(r: Result, done_s: dict[str, float]) -> bool:
    """Whether `r` was sent before the request it follows (`Result.follows`) finished, by
    `done_s` (each request's `Result.done_s` by key: the client's end of its answer, or its failure;
    the server may store its KV a little later). False where it follows none or that one's end is
    not known."""
    return r.follows is not None and r.sent_s < done_s.get(r.follows, NAN)


EARLY_COUNTS = tuple(f"{split}_{n}" for split in ("early", "late") for n in ("resumes", *SOURCES))
"""The figures `early_sources` gives."""


def early_sources(results: list[Result]) -> dict[str, int]:
    """The successful resumed turns of `results` (every request of one run of one workload, failed
    ones included, so a failed previous turn's end is known), split into those that `arrived_early`
    and the others: `early_resumes`, `late_resumes`, and of each split where most of its prefix was
    found, `early_<source>` and `late_<source>` (`resumed_sources`)."""
    done_s = {r.key: r.done_s for r in results}
    resumed = [r for r in results if r.error is None and r.resumed]
    out: dict[str, int] = {}
    for split, early in (("early", True), ("late", False)):
        turns = [r for r in resumed if arrived_early(r, done_s) is early]
        out[f"{split}_resumes"] = len(turns)
        out.update({f"{split}_{s}": n for s, n in resumed_sources(turns).items()})
    return out


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
