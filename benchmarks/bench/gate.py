"""`--gate`: pass or fail a run against thresholds; the reasons become the exit status and report."""

from __future__ import annotations

import math

from benchmarks.bench.spec import Gate
from benchmarks.bench.summary import NAN, Figures, best_hicache, ratio


def check(gate: Gate, workloads: dict[str, dict[str, Figures]]) -> list[str]:
    """Failures (empty: passed). `workloads` holds each system's medians over repeats (errors
    summed). Per workload, each figure of ours against the HiCache configuration best at it
    (`summary.best_hicache`): ours' resumed-turn TTFT p50 at least `ttft_resume_below_hicache` below
    the lowest one, ours' throughput not below `throughput_vs_hicache_min` of the highest one; and no
    system may exceed `max_errors` (a run with failing requests compares nothing)."""
    failures = []
    for name, figures in workloads.items():
        for system, f in figures.items():
            if f.errors > gate.max_errors:
                failures.append(f"{name}: {system} had {f.errors} failed requests")
        ours, best, fastest = figures.get("ours"), best_hicache(figures), best_hicache(figures, "throughput")
        if ours is None or best is None or fastest is None:
            failures.append(f"{name}: the gate compares ours with HiCache; run both")
            continue
        resident = figures.get("resident")
        ttft = ratio(ours.ttft_resume_p50_ms, figures[best].ttft_resume_p50_ms)
        if math.isnan(ttft) or ttft > 1 - gate.ttft_resume_below_hicache:
            reached = _reached(resident, figures[best], "ttft_resume_p50_ms")
            failures.append(
                f"{name}: resumed TTFT p50 ours/{best} = {ttft:.3f}, "
                f"needs <= {1 - gate.ttft_resume_below_hicache:.2f}{_reference(reached)}"
            )
        tput = ratio(ours.throughput_tok_s, figures[fastest].throughput_tok_s)
        if math.isnan(tput) or tput < gate.throughput_vs_hicache_min:
            reached = _reached(resident, figures[fastest], "throughput_tok_s")
            failures.append(
                f"{name}: throughput ours/{fastest} = {tput:.3f}, "
                f"needs >= {gate.throughput_vs_hicache_min:.2f}{_reference(reached)}"
            )
    return failures


def _reached(resident: Figures | None, peer: Figures, name: str) -> float:
    return NAN if resident is None else ratio(getattr(resident, name), getattr(peer, name))


def _reference(value: float) -> str:
    """What the `resident` reference (a device pool holding the whole workload: what a cache behind
    the run's pool can hope to reach, measured) reached on the same figure, so a reader sees whether
    the threshold is within reach at all."""
    return "" if math.isnan(value) else f" (resident, a pool holding the whole workload: {value:.3f})"
