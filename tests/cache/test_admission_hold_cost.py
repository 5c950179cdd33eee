"""What a deferral costs, as admission holds measure it (cache/admission_hold.py, `deferral_s`): one
scheduling round, other requests' holds not in it (docs/DESIGN.md, "Admission holds"). A fake
clock: the figures are exact."""

from __future__ import annotations

import pytest

from sgl_hicache.cache.admission_hold import AdmissionHold
from sgl_hicache.cache.metrics import SpillMetrics
from sgl_hicache.cache.reads import Readiness


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def taught(round_s: float) -> tuple[AdmissionHold, Clock]:
    """A hold that saw one request deferred at its first attempt and admitted a round later."""
    clock = Clock()
    hold = AdmissionHold(SpillMetrics(), clock)
    hold.new_round()
    assert hold.attempt("teacher")
    hold.tried("teacher")
    clock.sleep(round_s)  # the forward
    hold.new_round()
    assert not hold.attempt("teacher")
    hold.admitted("teacher")
    assert hold.deferral_s == pytest.approx(round_s)
    return hold, clock


def held_for_its_budget(hold: AdmissionHold, clock: Clock, rid: str, share: float) -> float:
    """`rid`'s first attempt holds its whole budget (its reads never land in time)."""
    assert hold.attempt(rid)
    budget = hold.budget_s(share, 10.0)
    hold.hold(Readiness.PENDING, budget, lambda: Readiness.PENDING, clock.sleep, layerwise=False)
    hold.tried(rid)
    return budget


@pytest.mark.parametrize("share", [0.5, 1.0])
def test_another_requests_hold_is_not_in_a_deferrals_cost(share: float) -> None:
    """Each round, a request deferred (its retry comes next round) and then a newcomer holding the
    rest of the budget: the deferral costs a round (the forward), and the holds stay at `share` of
    it. Counted from the deferral's end, the newcomer's hold joined the cost, which fed the next
    budget: at the default share a hold grew to a whole round, at 1 without bound (to the policy's
    limit)."""
    hold, clock = taught(round_s=1.0)
    for n in range(12):
        hold.new_round()
        assert hold.attempt(f"deferred{n}")  # its reads just started: deferred (nothing to hold for)
        hold.tried(f"deferred{n}")
        held_for_its_budget(hold, clock, f"newcomer{n}", share)
        clock.sleep(1.0)  # the forward
        hold.new_round()
        assert not hold.attempt(f"deferred{n}")
        hold.admitted(f"deferred{n}")
    assert hold.deferral_s == pytest.approx(1.0)
    assert hold.budget_s(share, 10.0) == pytest.approx(share)


def test_a_request_not_tried_for_many_rounds_costs_one_round() -> None:
    """A deferred request sglang does not try again while its running batch is full (50 rounds of
    0.1 s): the next hold is still a share of one round, not of the 5 s between the attempts."""
    hold, clock = taught(round_s=0.1)
    hold.new_round()
    assert hold.attempt("waiting")
    hold.tried("waiting")
    for _ in range(50):
        clock.sleep(0.1)
        hold.new_round()  # get_new_batch_prefill returns at once: batch_is_full
    assert not hold.attempt("waiting")
    assert hold.budget_s(0.5, 10.0) <= 0.5 * 0.1 + 1e-9
