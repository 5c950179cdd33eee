"""How client hints reach every TP rank (issue 14), without a server: rank 0's hook appends the
checked hints to the aborts sglang broadcasts; every rank's hook takes them out of the received list
before sglang dispatches it (in place, even when a prefetch fails) and prefetches each, in order."""

from __future__ import annotations

import pickle
from types import SimpleNamespace
from typing import Any

import pytest

from sgl_hicache.cache.hint_source import ResumeHint
from sgl_hicache.cache.spill_radix_cache import SpillRadixCache
from sgl_hicache.server import hooks


class Cache(SpillRadixCache):
    """A SpillRadixCache without a tree: only what the two hooks call (raises on anything else)."""

    def __init__(self, hints: list[ResumeHint] | None, fail: bool = False) -> None:  # no super(): no tree
        self.hints = object() if hints is not None else None  # type: ignore[assignment]
        self.waiting, self.fail, self.prefetched = list(hints or []), fail, []  # type: list[Any]

    def take_hints(self) -> list[ResumeHint]:
        taken, self.waiting = self.waiting, []
        return taken

    def prefetch(self, token_ids: Any, extra_key: str | None = None, cache_salt: str | None = None,
                 rid: str | None = None, hinted: bool = False) -> int:  # fmt: skip
        if self.fail:
            raise RuntimeError("prefetch failed")
        assert hinted and rid is None, "a client's hint, not an arrival: its path is admitted to the tier"
        self.prefetched.append(ResumeHint(token_ids, extra_key, cache_salt))
        return len(token_ids)


def scheduler(cache: Any) -> Any:
    return SimpleNamespace(tree_cache=cache)


HINTS = [ResumeHint([1, 2, 3], None, None), ResumeHint([4, 5], "lora-a", "salt")]


def test_rank_0_appends_its_hints_to_the_aborts_it_broadcasts() -> None:
    cache = Cache(HINTS)
    abort = object()
    assert hooks.send_hints([abort], scheduler(cache)) == [abort, *HINTS]
    assert hooks.send_hints([abort], scheduler(cache)) == [abort]  # taken once


def test_a_rank_without_an_inbox_sends_nothing() -> None:
    aborts: list[Any] = []
    assert hooks.send_hints(aborts, scheduler(Cache(None))) is aborts


def test_every_rank_takes_the_hints_out_in_place_and_prefetches_them_in_order() -> None:
    cache, first, last = Cache([]), object(), object()
    received = [first, HINTS[0], last, HINTS[1]]
    assert hooks.apply_hints(scheduler(cache), received) is None  # BEFORE hook: arguments unchanged
    assert received == [first, last]
    assert cache.prefetched == HINTS


def test_hints_leave_the_list_even_when_a_prefetch_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hooks, "HOOK_ERRORS", type(hooks.HOOK_ERRORS)())
    received = [HINTS[0], "req"]
    hooks.apply_hints(scheduler(Cache([], fail=True)), recv_reqs=received)
    assert received == ["req"], "sglang's dispatcher would have met our hint and raised"
    assert hooks.HOOK_ERRORS["prefetch_hint"] == 1


def test_a_hint_survives_sglangs_pickled_broadcast() -> None:
    assert pickle.loads(pickle.dumps(HINTS)) == HINTS
