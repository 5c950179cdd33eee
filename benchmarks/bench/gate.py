"""`--gate`: pass or fail a run against thresholds; the reasons become the exit status and report."""

from __future__ import annotations

import math

from benchmarks.bench.spec import FAMILIES, Gate, Target
from benchmarks.bench.summary import NAN, Figures, best_of, ratio


def check(gate: Gate, workloads: dict[str, dict[str, Figures]]) -> list[str]:
    """Failures (empty: passed). `workloads` holds each system's medians over repeats (errors
    summed). Per workload, each target of it (`Gate.for_workload`) against each peer that ran: ours'
    figure over that of the peer's configuration best at it (`summary.best_of`) must meet the
    target's bound; and no system may exceed `max_errors` (a run with failing requests compares
    nothing)."""
    failures = []
    for name, figures in workloads.items():
        for system, f in figures.items():
            if f.errors > gate.max_errors:
                failures.append(f"{name}: {system} had {f.errors} failed requests")
        ours = figures.get("ours")
        peers = [(peer, members) for peer, members in FAMILIES.items() if any(n in members for n in figures)]
        if ours is None or not peers:
            failures.append(
                f"{name}: the gate compares ours with the peers (HiCache, LMCache); run ours and some"
            )
            continue
        for target in gate.for_workload(name):
            for peer, members in peers:
                failures += _judge(name, target, figures, ours, peer, members)
    return failures


def _judge(name: str, target: Target, figures: dict[str, Figures], ours: Figures, peer: str,
           members: tuple[str, ...]) -> list[str]:  # fmt: skip
    """The failure, if any, of one target against one peer's configuration best at its figure."""
    c = target.compared
    best = best_of(figures, members, c)
    value = NAN if best is None else ratio(getattr(ours, c.field), getattr(figures[best], c.field))
    if target.met(value):
        return []
    resident = figures.get("resident")
    reached = (
        NAN
        if resident is None or best is None
        else ratio(getattr(resident, c.field), getattr(figures[best], c.field))
    )
    versus = best if best is not None else f"{peer} (no configuration measured it)"
    return [f"{name}: {c.label} ours/{versus} = {value:.3f}, needs {target}{_reference(reached)}"]


def _reference(value: float) -> str:
    """What the `resident` reference (a device pool holding the whole workload: what a cache behind
    the run's pool can hope to reach, measured) reached on the same figure, so a reader sees whether
    the threshold is within reach at all."""
    return "" if math.isnan(value) else f" (resident, a pool holding the whole workload: {value:.3f})"
