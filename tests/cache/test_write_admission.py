"""Write admission (issue 37): under `--hicache-spill-admission reused` the tier is written a node only
if it was reused, hinted, pinned, long, written before, or holds spilled children; any other node
an eviction meets is dropped, as sglang's plain cache drops it, and write-through and clean-ahead
skip it. Every restored slot is checked against its lossless marker."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from sgl_hicache.cache.agreement import SingleRank
from sgl_hicache.cache.hint_source import RetentionHint
from sgl_hicache.cache.metrics import DropReason
from sgl_hicache.cache.write_admission import Reason
from sgl_hicache.config import SpillAdmission, WritePolicy
from tests.cache.conftest import Stack, build_stack, close_stack, expected_kv, read_kv
from tests.cache.test_tp_agreement import ThreadedAgreement

LONG = 32  # --hicache-spill-admission-min-tokens in these tests


def prompt(i: int, n: int = 20) -> list[int]:
    return [1000 * i + t for t in range(n)]


FRESH, REUSED, TAIL, HINTED, PINNED, LONG_ONE, HEAD, BELOW = (
    prompt(1), prompt(2), [7] * 8, prompt(3), prompt(4), prompt(5, LONG), prompt(6), prompt(7, 40),
)  # fmt: skip


def node_of(s: Stack, tokens: list[int]) -> Any:
    """The node whose path ends exactly at `tokens`."""
    m = s.match(tokens)
    node = m.best_match_node if m.host_hit_length else m.last_device_node
    assert m.device_prefix_len + m.host_hit_length == len(tokens)
    return node


def restored(s: Stack, tokens: list[int]) -> bool:
    """Whether `tokens` are restored whole from the tier, with exactly their KV."""
    m = s.match(tokens)
    if m.device_prefix_len + m.host_hit_length < len(tokens):
        return False
    n, last = s.load_back(m)
    return bool(
        n == m.host_hit_length and read_kv(s.pool, s.cache.path_device_indices(last)) == expected_kv(tokens)
    )


def each_kind(s: Stack) -> None:
    """One node for each reason to admit, and two that have none (FRESH, REUSED + TAIL's tail)."""
    s.insert(FRESH)  # cached once
    s.insert(REUSED)
    s.insert(REUSED + TAIL)  # a later request reused REUSED; its own tail was cached once
    s.insert(HINTED)
    s.cache.prefetch(HINTED, hinted=True)  # a client's resume hint (not an arrival)
    s.insert(PINNED)
    s.cache.retention.apply(RetentionHint("pin", PINNED, None, None, 600.0))
    s.insert(LONG_ONE)
    s.insert(HEAD + BELOW)  # one node, cached once ...
    s.match(HEAD + [5])  # ... split by a match (no hit): HEAD is short and only reused by nothing


def test_each_reason_admits_and_a_node_without_one_is_dropped(make_stack: Any) -> None:
    s = make_stack(size=512, admission=SpillAdmission.REUSED, admission_min_tokens=LONG)
    each_kind(s)
    reason = {name: s.cache.write_admission.reason(node_of(s, t)) for name, t in (
        ("fresh", FRESH), ("reused", REUSED), ("tail", REUSED + TAIL), ("hinted", HINTED),
        ("pinned", PINNED), ("long", LONG_ONE), ("head", HEAD), ("below", HEAD + BELOW),
    )}  # fmt: skip
    assert reason == {"fresh": None, "reused": Reason.REUSED, "tail": None, "hinted": Reason.HINTED,
                      "pinned": Reason.PINNED, "long": Reason.LONG, "head": None, "below": Reason.LONG}  # fmt: skip
    s.evict_all()
    assert s.metrics.drops[DropReason.NOT_ADMITTED] == len(FRESH) + len(TAIL)
    for tokens in (REUSED, HINTED, PINNED, LONG_ONE, HEAD + BELOW):  # HEAD: it held BELOW, spilled
        assert restored(s, tokens), tokens
    assert not restored(s, FRESH) and not restored(s, REUSED + TAIL)
    restored_node = node_of(s, LONG_ONE)
    assert s.cache.write_admission.reason(restored_node) is Reason.WRITTEN
    s.cache.check_integrity()


def test_all_admits_every_node_as_before(make_stack: Any) -> None:
    s = make_stack(size=512)  # the default
    assert s.cache.spill_config.admission is SpillAdmission.ALL
    each_kind(s)
    s.evict_all()
    assert s.metrics.drops[DropReason.NOT_ADMITTED] == 0
    for tokens in (FRESH, REUSED + TAIL, HINTED, PINNED, LONG_ONE, HEAD + BELOW):
        assert restored(s, tokens), tokens


def test_a_hint_marks_its_whole_path_and_splits_keep_the_mark(make_stack: Any) -> None:
    s = make_stack(size=512, admission=SpillAdmission.REUSED)
    s.insert(HEAD + HINTED)
    s.cache.prefetch(HEAD + HINTED, hinted=True)
    s.cache.prefetch(FRESH)  # an arrival marks nothing
    s.insert(FRESH)
    s.match(HEAD[:8] + [5])  # splits the hinted node
    assert s.cache.write_admission.reason(node_of(s, HEAD[:8])) is Reason.HINTED
    s.evict_all()
    assert restored(s, HEAD + HINTED) and not restored(s, FRESH)


def test_clean_ahead_and_write_through_skip_what_is_not_admitted(make_stack: Any, tmp_path: Path) -> None:
    ahead = make_stack(size=512, admission=SpillAdmission.REUSED, clean_ahead=1.0)
    ahead.insert(FRESH)
    ahead.insert(REUSED)
    ahead.insert(REUSED + TAIL)
    ahead.cache.clean_ahead()
    ahead.cache.controller.wait_writes()
    assert ahead.metrics.totals["written_ahead_tokens"] == len(REUSED)
    written = ahead.cache.controller.tier.stats().written_bytes
    ahead.evict_all()  # REUSED points at its copy; FRESH and the tail are dropped
    assert ahead.cache.controller.tier.stats().written_bytes == written
    assert ahead.metrics.drops[DropReason.NOT_ADMITTED] == len(FRESH) + len(TAIL)

    through = make_stack(size=512, admission=SpillAdmission.REUSED, write_policy=WritePolicy.WRITE_THROUGH)
    through.insert(REUSED)  # cached once: not written (HiCache's write_through_selective)
    assert through.metrics.totals["written_through_tokens"] == 0
    through.insert(REUSED + TAIL)  # reused now: written; the new tail is not
    assert through.metrics.totals["written_through_tokens"] == len(REUSED)


def test_tp_ranks_agree_when_a_pin_expired_on_one_of_them(tmp_path: Path) -> None:
    """Pins depend on each rank's clock: a node one rank may spill only for its pin is dropped on
    every rank (the eviction's agreement), so their trees stay the same."""
    from sgl_hicache.cache.warm_start import tree_digest

    group = ThreadedAgreement.Group(2)
    stacks = [build_stack(tmp_path / f"rank{r}", size=256, admission=SpillAdmission.REUSED) for r in range(2)]
    try:
        for rank, s in enumerate(stacks):
            s.cache.agreement = ThreadedAgreement(group, rank)
            s.insert(PINNED)
            s.insert(REUSED)
            s.insert(REUSED + TAIL)
        for s, ttl_s in zip(stacks, (600.0, 0.0), strict=True):  # every rank applies it; rank 1's expired
            s.cache.retention.apply(RetentionHint("pin", PINNED, None, None, ttl_s))
        threads = [threading.Thread(target=s.evict_all) for s in stacks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert tree_digest(stacks[0].cache.root_node) == tree_digest(stacks[1].cache.root_node)
        assert stacks[1].metrics.drops[DropReason.NOT_ADMITTED] == len(PINNED) + len(TAIL)
        assert stacks[0].metrics.drops[DropReason.TP_DISAGREEMENT] == len(PINNED)
        for s in stacks:  # what each rank holds now (its restores need no agreement to show it)
            s.cache.agreement = SingleRank()
            assert not restored(s, PINNED) and restored(s, REUSED)
    finally:
        for s in stacks:
            close_stack(s)


@pytest.mark.parametrize("rule", list(SpillAdmission))
def test_the_rule_is_in_the_config_the_scheduler_gets(rule: SpillAdmission) -> None:
    from sgl_hicache.config import SpillConfig

    config = SpillConfig(admission=rule, admission_min_tokens=LONG)
    assert SpillConfig.from_json(config.to_json()) == config
