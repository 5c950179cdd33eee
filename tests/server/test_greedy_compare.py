"""The shared comparison of greedy answers (`greedy.py`), on made-up pairs: no server."""

from __future__ import annotations

import dataclasses

import pytest

from tests.server.greedy import NEAR_TIE_NATS, Answer, Choice, Served, mismatch, transcript_mismatches

REFERENCE_IDS = (5, 6, 7, 8)


def reference(gap: float = 1e-3, cached: int = 100, second: int = 9) -> Answer:
    """Outputs 5 6 7 8 over `cached` reused tokens; at position 2 its second choice `second` trails 7
    by `gap` nats, elsewhere by 1 nat."""
    top2 = tuple(
        (Choice(t, -2.0), Choice(second if k == 2 else 900 + k, -2.0 - (gap if k == 2 else 1.0)))
        for k, t in enumerate(REFERENCE_IDS)
    )
    return Answer(REFERENCE_IDS, cached, top2)


def ours(ids: tuple[int, ...] = (5, 6, 9, 4), cached: int = 90) -> Answer:
    return Answer(ids, cached)


def test_identical_answers_pass() -> None:
    assert mismatch("#0", reference(), ours(REFERENCE_IDS)) is None
    assert mismatch("#0", reference(gap=5.0), ours(REFERENCE_IDS, cached=100), min_hit=100) is None
    assert mismatch("#0", Answer(REFERENCE_IDS, 100), ours(REFERENCE_IDS)) is None  # no logprobs needed


def test_a_flip_at_a_near_tie_where_ours_recomputed_more_passes() -> None:
    """Outputs after the flip differ freely: they continue a different sequence."""
    assert mismatch("#3", reference(gap=1e-3), ours((5, 6, 9, 4), cached=90)) is None
    assert mismatch("#3", reference(gap=NEAR_TIE_NATS / 2), ours((5, 6, 9), cached=0)) is None


def test_a_flip_at_a_large_gap_fails_naming_request_position_tokens_cached_and_gap() -> None:
    failure = mismatch("#3 fork", reference(gap=0.5), ours((5, 6, 9, 4), cached=90))
    assert failure is not None
    named = ("#3 fork", "position 2", "reference token 7", "ours 9", "reference 100", "ours 90", "gap 0.5")
    assert all(part in failure for part in named), failure
    assert "not a near-tie" in failure
    assert mismatch("#3", reference(gap=2 * NEAR_TIE_NATS), ours(cached=90)) is not None


@pytest.mark.parametrize("cached", [100, 101, 400])
def test_a_flip_where_ours_recomputed_no_more_than_the_reference_fails(cached: int) -> None:
    """Same reused prefix or more: the same arithmetic on the same KV, no room for a near-tie."""
    failure = mismatch("#4", reference(gap=1e-4), ours(cached=cached))
    assert failure is not None and "recomputed no more" in failure, failure
    assert f"ours {cached}" in failure


def test_a_token_that_is_not_the_references_second_choice_fails() -> None:
    failure = mismatch("#5", reference(gap=1e-4, second=11), ours((5, 6, 9, 4)))
    assert failure is not None and "second choice" in failure, failure


def test_a_difference_before_the_near_tie_fails() -> None:
    """Only the first difference may be a flip; the reference's gap at position 0 is 1 nat."""
    assert mismatch("#6", reference(gap=1e-4), ours((4, 6, 9, 4))) is not None


def test_an_answer_ending_early_fails() -> None:
    failure = mismatch("#7", reference(), ours((5, 6)))
    assert failure is not None and "ours None" in failure, failure


def test_a_difference_without_the_references_logprobs_fails() -> None:
    failure = mismatch("#8", Answer(REFERENCE_IDS, 100), ours())
    assert failure is not None and "not recorded" in failure, failure


def test_ours_reusing_less_than_the_design_says_fails_even_with_the_same_output() -> None:
    failure = mismatch("#9", reference(), ours(REFERENCE_IDS, cached=90), min_hit=96)
    assert failure is not None and "(96)" in failure and "ours 90" in failure, failure


PROMPT = tuple(range(20, 120))  # 100 tokens
TURN = tuple(range(200, 230))


def conversation(our_hits: tuple[int, int], flip_at_last: bool = True) -> list[Served]:
    """Three turns of one conversation; the reference reuses all it has cached (its decode-made
    tokens too); ours reuses `our_hits` in turns 2 and 3 and, with `flip_at_last`, answers turn 3
    with the reference's second choice at a near-tie."""
    p1, p2 = (*PROMPT, *REFERENCE_IDS, *TURN), (*PROMPT, *REFERENCE_IDS, *TURN, *REFERENCE_IDS, *TURN)
    hits = (len(PROMPT) + 3, len(p1) + 3)  # every prompt and output token but the last
    last = ours((5, 6, 9, 4) if flip_at_last else REFERENCE_IDS, our_hits[1])
    return [Served("#0", PROMPT, reference(cached=0), ours(REFERENCE_IDS, 0)),
            Served("#1", p1, reference(cached=hits[0]), ours(REFERENCE_IDS, our_hits[0])),
            Served("#2", p2, reference(cached=hits[1]), last)]  # fmt: skip


def test_a_flip_where_ours_reuses_its_own_earlier_recompute_passes() -> None:
    """Turn 2 recomputed ours' decode-made tail (3 tokens): turn 3 reuses that KV, whose last bits
    differ from the reference's, so its near-tie may flip although ours reuses all the reference does."""
    assert transcript_mismatches(conversation((100, 137))) == []
    failures = transcript_mismatches(conversation((103, 137)))  # turn 2 reused what the reference did
    assert len(failures) == 1 and failures[0].startswith("#2:") and "recomputed no more" in failures[0]


def test_a_transcript_needs_ours_to_reuse_the_references_hit_but_dropped_leaves() -> None:
    exact = conversation((103, 137), flip_at_last=False)
    assert transcript_mismatches(exact, page=1) == []
    dropped = conversation((100, 137), flip_at_last=False)
    assert transcript_mismatches(dropped, page=1, dropped=3) == []
    failures = transcript_mismatches(dropped, page=1, dropped=2)
    assert len(failures) == 1 and failures[0].startswith("#1:") and "(101)" in failures[0], failures
    assert transcript_mismatches(dropped, page=16) == []  # 100 // 16 * 16: the partial page recomputed


def test_after_a_flip_ours_needs_to_reuse_only_what_its_own_answer_shares() -> None:
    """Turn 2 flipped at output position 2: turn 3's prompt carries the reference's answer, of which
    ours cached 2 tokens (up to the flip), not the reference's 3."""
    flipped = conversation((100, 133), flip_at_last=False)
    flipped[1] = dataclasses.replace(flipped[1], ours=ours((5, 6, 9, 4), 100))
    assert transcript_mismatches(flipped, page=1, dropped=3) == []
    unflipped = conversation((100, 133), flip_at_last=False)
    assert "(134)" in transcript_mismatches(unflipped, page=1, dropped=3)[0]
    flipped[2] = dataclasses.replace(flipped[2], ours=ours(REFERENCE_IDS, 132))
    assert "(133)" in transcript_mismatches(flipped, page=1, dropped=3)[0]


def test_an_answer_is_read_from_a_generate_reply() -> None:
    reply = {"output_ids": [5, 6], "text": "..",
             "meta_info": {"cached_tokens": 12, "output_top_logprobs": [[[-0.5, 5, None], [-0.75, 9, None]],
                                                                         [[-0.1, 6, None], [-3.0, 2, None]]]}}  # fmt: skip
    assert Answer.of(reply) == Answer(
        (5, 6), 12, ((Choice(5, -0.5), Choice(9, -0.75)), (Choice(6, -0.1), Choice(2, -3.0)))
    )
    assert Answer.of({"output_ids": [5], "meta_info": {"cached_tokens": 0}}) == Answer((5,), 0)
