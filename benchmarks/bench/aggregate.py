"""Repeats: the median of each figure over a system's repeats, its spread, and the figures against
the best configuration of each peer that the gate and the final line use.

Counts (`COUNTS`: requests, errors, resumed turns and their splits) are summed over repeats, so
one failed request in any repeat shows; every other figure is the median of the repeats (NaN
repeats left out) with its min–max spread. Ours against a peer's best configuration at a figure
(chosen by the median) is the ratio of medians; its spread is the range of the per-repeat ratios
(repeat k of ours against repeat k of that configuration, which ran in the same pass of the
interleaved order). "overall" is the geometric mean over workloads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import numpy as np

from benchmarks.bench.spec import COMPARED, FAMILIES, Compared
from benchmarks.bench.summary import EARLY_COUNTS, NAN, Figures, best_of, ratio

COUNTS = ("requests", "errors", "resumed", "resumed_resident", "resumed_restored", "resumed_recomputed",
          *EARLY_COUNTS)  # fmt: skip


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
    """One figure of ours (`spec.COMPARED`) against one peer's configuration best at it, per
    workload (by the median over repeats), and "overall"."""

    config: dict[str, str | None] = field(default_factory=dict)  # the peer's best at the figure
    ratio: dict[str, float] = field(default_factory=dict)  # ours / that configuration, medians
    range: dict[str, tuple[float, float]] = field(default_factory=dict)  # min, max of the per-repeat ratios
    # The same ratio for the `resident` reference in place of ours (a device pool that holds the
    # whole workload: every reusable prefix a device hit, nothing restored, no request waiting for
    # pool space): what a cache behind the run's smaller pool can hope to reach, measured (not a
    # proof: a larger pool also batches differently), so a gate threshold beyond it is visibly out
    # of reach on this workload and machine (NaN where `resident` did not run).
    resident: dict[str, float] = field(default_factory=dict)


def versus_best(workloads: dict[str, dict[str, Measured]],
                compared: tuple[Compared, ...] = COMPARED) -> dict[tuple[str, str], VersusBest]:  # fmt: skip
    """Per (peer, figure key) of `spec.FAMILIES` x `compared`: ours against that peer's best
    configuration at that figure, in each workload."""
    figure = {c.key: c for c in compared}
    out = {(peer, c.key): VersusBest() for peer in FAMILIES for c in compared}
    for w, by in workloads.items():
        medians = {s: m.median for s, m in by.items()}
        ours, resident = by.get("ours"), by.get("resident")
        for (peer, key), vs in out.items():
            name = figure[key].field
            vs.config[w] = best = best_of(medians, FAMILIES[peer], figure[key])
            peer_runs = by.get(best) if best else None
            vs.resident[w] = (
                NAN if resident is None or peer_runs is None else _of_medians(resident, peer_runs, name)
            )
            if ours is None or peer_runs is None:
                vs.ratio[w], vs.range[w] = NAN, (NAN, NAN)
                continue
            vs.ratio[w] = _of_medians(ours, peer_runs, name)
            vs.range[w] = _range(ours.runs, peer_runs.runs, name)
    for vs in out.values():
        for by_workload in (vs.ratio, vs.resident):
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
