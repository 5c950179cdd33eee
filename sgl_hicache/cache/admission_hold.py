"""Admission holds: a resumed request whose reads are in flight when it is first tried may hold the
scheduler a bounded moment for them instead of being deferred.

A deferral ("retry", admission.py) costs the request the scheduler's next round: on a busy server
the forward that runs meanwhile, however short its reads (docs/RESULTS.md, "Where ours' resumed-turn
time goes on `agents`": 1.8 s per restore on this CPU against 0.2 s of reads). A hold trades that
for a wait of the whole scheduler, so it is bounded by a share (`SpillConfig.admission_hold`,
through `RestorePolicy.hold_share`) of what a deferral has cost lately: the time between a deferred
request's successive attempts, measured here (an exponential average, `deferral_s`). On a GPU a
round is a forward of milliseconds, so a hold is too; on this CPU it is a fraction of a second.

Rules:
- only at a request's first attempt, and only when every read it needs has started (PENDING): a
  restore waiting for room in staging (STREAMING) would not land by waiting, and a request deferred
  once pays its deferral anyway;
- never before a deferral was measured, with a share of 0, or under `best_effort` (share 0);
- never longer than the policy lets a restore wait (`restore_wait_s`);
- it ends as soon as the restore is no longer PENDING (ready whole, its first layer group landed
  for a layer-wise restore, or failed) or the budget is spent (the request is then deferred as
  before); it sleeps on the tier's completions (`Tier.wait_posted`), never spins.
Counted: `admission_holds`, `admission_holds_expired` (spent, deferred after all),
`admission_hold_seconds`. Scheduler thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sgl_hicache.cache.metrics import SpillMetrics
from sgl_hicache.cache.reads import Readiness

EMA_WEIGHT = 0.25  # of the newest interval in `deferral_s`
LAYERWISE_SLICE_S = 0.005  # a layer-wise restore's first group lands without a completion: look this often


class AdmissionHold:
    def __init__(self, metrics: SpillMetrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self.clock = clock
        self.deferral_s = 0.0  # what a deferral cost lately (0: none measured yet)
        self._tried: dict[str, float] = {}  # rid -> its last attempt, while it is being deferred

    def attempt(self, rid: str) -> bool:
        """Note the start of an admission attempt of `rid` that found spilled nodes; True if it is
        its first (since its last admission). A later one measures what the deferral before it
        cost: the time since the end of the attempt before (`tried`), a hold not included."""
        last = self._tried.get(rid)
        if last is None:
            return True
        interval = self.clock() - last
        self.deferral_s = interval if not self.deferral_s else (
            EMA_WEIGHT * interval + (1 - EMA_WEIGHT) * self.deferral_s
        )  # fmt: skip
        return False

    def tried(self, rid: str) -> None:
        """The end of an attempt of `rid` (after any hold)."""
        self._tried[rid] = self.clock()

    def budget_s(self, share: float, limit_s: float) -> float:
        """How long a first attempt may hold: `share` of what a deferral costs, within `limit_s`."""
        return max(0.0, min(share * self.deferral_s, limit_s))

    def hold(self, budget_s: float, check: Callable[[], Readiness], wait: Callable[[float], None],
             layerwise: bool) -> Readiness:  # fmt: skip
        """Wait up to `budget_s` while `check()` says PENDING (`wait(t)`: sleep up to t on the tier's
        completions and take them); the last verdict."""
        if budget_s <= 0:
            return Readiness.PENDING
        self.metrics.inc("admission_holds")
        t0 = self.clock()
        state = Readiness.PENDING
        while state is Readiness.PENDING and (left := t0 + budget_s - self.clock()) > 0:
            wait(min(left, LAYERWISE_SLICE_S) if layerwise else left)
            state = check()
        self.metrics.inc("admission_hold_seconds", self.clock() - t0)
        self.metrics.inc("admission_holds_expired", int(state is Readiness.PENDING))
        return state

    def admitted(self, rid: str) -> None:
        self._tried.pop(rid, None)

    def forget_older_than(self, cutoff: float) -> None:
        """Requests last tried before `cutoff` and never seen again (aborted) leave no state behind."""
        for rid in [r for r, t in self._tried.items() if t < cutoff]:
            del self._tried[rid]
