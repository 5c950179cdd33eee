"""Repeats: the median of each figure over a system's repeats, its spread, and the figures against
the best HiCache configuration that the gate and the final line use.

Counts (requests, errors, resumed) are summed over repeats, so one failed request in any repeat
shows; every other figure is the median of the repeats (NaN repeats left out) with its min–max
spread. Ours against the best HiCache configuration is the ratio of medians; its spread is the
range of the per-repeat ratios (repeat k of ours against repeat k of that configuration, which ran
in the same pass of the interleaved order). "overall" is the geometric mean over workloads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import numpy as np

from benchmarks.bench.summary import NAN, Figures, best_hicache, ratio

COUNTS = ("requests", "errors", "resumed", "resumed_resident", "resumed_restored", "resumed_recomputed")


@dataclass(frozen=True)
class Measured:
    """One system on one workload over its repeats (in repeat order)."""

    runs: tuple[Figures, ...]

    @property
    def median(self) -> Figures:
        return self._fold(lambda xs: float(np.median(xs)))

    @property
    def low(self) -> Figures:
        return self._fold(min)

    @property
    def high(self) -> Figures:
        return self._fold(max)

    def _fold(self, how: object) -> Figures:
        values = {}
        for f in fields(Figures):
            xs = [getattr(r, f.name) for r in self.runs]
            if f.name in COUNTS:
                values[f.name] = sum(xs)
                continue
            ok = [x for x in xs if not math.isnan(x)]
            values[f.name] = how(ok) if ok else NAN  # type: ignore[operator]
        return replace(self.runs[0], **values)


def medians(workloads: dict[str, dict[str, Measured]]) -> dict[str, dict[str, Figures]]:
    return {w: {s: m.median for s, m in by.items()} for w, by in workloads.items()}


@dataclass(frozen=True)
class VersusBest:
    """Ours against the best HiCache configuration of each workload, and "overall"."""

    # the configuration with the lowest TTFT (the TTFT ratios' base)
    config: dict[str, str | None] = field(default_factory=dict)
    # the one with the highest throughput (their base)
    throughput_config: dict[str, str | None] = field(default_factory=dict)
    # resumed-turn TTFT p50, ours / best (median over repeats)
    ttft: dict[str, float] = field(default_factory=dict)
    throughput: dict[str, float] = field(default_factory=dict)
    ttft_range: dict[str, tuple[float, float]] = field(default_factory=dict)  # min, max per repeat
    throughput_range: dict[str, tuple[float, float]] = field(default_factory=dict)
    # The same two ratios for the `resident` reference in place of ours (a device pool that holds
    # the whole workload: every reusable prefix a device hit, nothing restored, no request waiting
    # for pool space): what a cache behind the run's smaller pool can hope to reach, measured (not
    # a proof: a larger pool also batches differently), so a gate threshold beyond it is visibly out
    # of reach on this workload and machine (NaN where `resident` did not run).
    resident_ttft: dict[str, float] = field(default_factory=dict)
    resident_throughput: dict[str, float] = field(default_factory=dict)


def versus_best(workloads: dict[str, dict[str, Measured]]) -> VersusBest:
    out = VersusBest()
    for w, by in workloads.items():
        medians = {s: m.median for s, m in by.items()}
        out.config[w], out.throughput_config[w] = best_hicache(medians), best_hicache(medians, "throughput")
        ours, resident = by.get("ours"), by.get("resident")
        for name, best, ratios, ranges, reference in (
            ("ttft_resume_p50_ms", out.config[w], out.ttft, out.ttft_range, out.resident_ttft),
            ("throughput_tok_s", out.throughput_config[w], out.throughput, out.throughput_range,
             out.resident_throughput),
        ):  # fmt: skip
            peer = by.get(best) if best else None
            reference[w] = NAN if resident is None or peer is None else _of_medians(resident, peer, name)
            if ours is None or peer is None:
                ratios[w], ranges[w] = NAN, (NAN, NAN)
                continue
            ratios[w] = _of_medians(ours, peer, name)
            ranges[w] = _range(ours.runs, peer.runs, name)
    for by_workload in (out.ttft, out.throughput, out.resident_ttft, out.resident_throughput):
        by_workload["overall"] = geomean(list(by_workload.values()))
    return out


def _of_medians(a: Measured, b: Measured, name: str) -> float:
    return ratio(getattr(a.median, name), getattr(b.median, name))


def _range(ours: Sequence[Figures], peer: Sequence[Figures], name: str) -> tuple[float, float]:
    rs = [ratio(getattr(a, name), getattr(b, name)) for a, b in zip(ours, peer, strict=False)]
    rs = [r for r in rs if not math.isnan(r)]
    return (min(rs), max(rs)) if rs else (NAN, NAN)


def geomean(values: list[float]) -> float:
    """Geometric mean; NaN if any value is NaN or not positive, or there is none."""
    if not values or any(math.isnan(v) or v <= 0 for v in values):
        return NAN
    return math.exp(sum(math.log(v) for v in values) / len(values))
