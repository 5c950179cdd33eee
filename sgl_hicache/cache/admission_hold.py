"""Admission holds: a resumed request whose reads are under way when it is first tried may hold the
scheduler a bounded moment for them instead of being deferred.

A deferral ("retry", admission.py) costs the request the scheduler's next round: on a busy server
the forward that runs meanwhile, however short its reads (docs/RESULTS.md, "Where ours' resumed-turn
time goes on `agents`"). A request arriving on a short queue is tried in the round it arrived,
when the reads its arrival started cannot have landed. A hold trades that round for a pause of the
whole scheduler, so the holds of one round (`new_round`: sglang's `get_next_batch_to_run`) share a
budget: a share (`SpillConfig.admission_hold`, through `RestorePolicy.hold_share`) of what a
deferral has cost lately, measured here as the time from the end of a deferred request's attempt
to its next in the round after (an exponential average, `deferral_s`; holds are not in it, and a
request not tried for rounds, its batch full, is no sample). A forward then runs at
least 1/(1 + share) as often as without holds. On a GPU a round is a forward of milliseconds, so a
hold is too; on this CPU it is a fraction of a second.

Rules:
- only at a request's first attempt, and only when every read its restore needs has started
  (PENDING); a request deferred once pays its deferral anyway. A restore waiting for room in
  staging (STREAMING) is not held: room comes back only as other writes and restores finish, and
  on `agents` such holds mostly spent their budget and then deferred anyway (7.6 s of pauses for
  17 of 39 holds, throughput 0.93x: docs/RESULTS.md);
- never before a deferral was measured, with a share of 0, or under `best_effort` (share 0);
  never longer than the policy lets a restore wait (`restore_wait_s`);
- it ends as soon as the restore is ready (whole, or its first layer group landed for a layer-wise
  restore) or failed, or the round's budget is spent (the request is then deferred as before); it
  sleeps on the tier's completions (`Tier.wait_posted`), never spins.
Counted: `admission_holds`, `admission_holds_expired` (spent, deferred after all),
`admission_hold_seconds`. Scheduler thread only; each TP rank holds on its own (nothing agreed
happens inside a hold; the verdict after it is agreed as any other).
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
        self._spent = 0.0  # seconds held in this round
        self._round = 0  # rounds started (`new_round`)
        self._held = 0.0  # seconds held in all rounds
        self._tried: dict[str, tuple[float, int, float]] = {}  # rid -> its last attempt's end, round
        # and `_held` then, while it is being deferred

    def attempt(self, rid: str) -> bool:
        """Note the start of an admission attempt of `rid` that found spilled nodes; True if it is
        its first (since its last admission). One in the round after the attempt before measures
        what that deferral cost: the time since the end of the attempt before (`tried`), the holds
        since not included (a request sglang did not try for rounds, its batch full, measures none)."""
        last = self._tried.get(rid)
        if last is None:
            return True
        at, round_, held = last
        if self._round == round_ + 1:
            interval = self.clock() - at - (self._held - held)
            self.deferral_s = interval if not self.deferral_s else (
                EMA_WEIGHT * interval + (1 - EMA_WEIGHT) * self.deferral_s
            )  # fmt: skip
        return False

    def tried(self, rid: str) -> None:
        """The end of an attempt of `rid` (after any hold)."""
        self._tried[rid] = (self.clock(), self._round, self._held)

    def new_round(self) -> None:
        """sglang starts a scheduling round (its admission comes next): the holds' budget is whole."""
        self._spent = 0.0
        self._round += 1

    def budget_s(self, share: float, limit_s: float) -> float:
        """How long a first attempt may hold now: what is left of this round's `share` of a
        deferral's cost, within `limit_s`."""
        return max(0.0, min(share * self.deferral_s - self._spent, limit_s))

    def hold(self, state: Readiness, budget_s: float, check: Callable[[], Readiness],
             wait: Callable[[float], None], layerwise: bool) -> Readiness:  # fmt: skip
        """From verdict `state`, wait up to `budget_s` while `check()` says the restore's reads are
        in flight (`wait(t)`: sleep up to t on the tier's completions and take them); the last
        verdict."""
        if budget_s <= 0 or state is not Readiness.PENDING:
            return state
        self.metrics.inc("admission_holds")
        t0 = self.clock()
        while state is Readiness.PENDING and (left := t0 + budget_s - self.clock()) > 0:
            wait(min(left, LAYERWISE_SLICE_S) if layerwise else left)
            state = check()
        held = self.clock() - t0
        self._spent += held
        self._held += held
        self.metrics.inc("admission_hold_seconds", held)
        self.metrics.inc("admission_holds_expired", int(state in (Readiness.PENDING, Readiness.STREAMING)))
        return state

    def admitted(self, rid: str) -> None:
        self._tried.pop(rid, None)

    def forget_older_than(self, cutoff: float) -> None:
        """Requests last tried before `cutoff` and never seen again (aborted) leave no state behind."""
        for rid in [r for r, (t, _, _) in self._tried.items() if t < cutoff]:
            del self._tried[rid]
