"""Hostile input to the retention routes (issue 27: `POST /hicache/pin`, `/drop`, `/purge`), without a
server: checked in the HTTP process (`parse_hint`: HTTP 400) and again on the scheduler thread
(`unpack_hint`), a pin refused by the scheduler answered 409 with its reason, and the hints' way to
every TP rank (taken out of sglang's received list, applied in order, pickled by its broadcast)."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_hicache.cache.hint_source import HintRefused, ResumeHint, RetentionHint
from sgl_hicache.server import hooks
from sgl_hicache.server.hints import Hint, HintError, HintLimits, check_hint, pack_hint, unpack_hint
from sgl_hicache.server.http_routes import ROUTES, parse_hint
from tests.server.test_hostile_inbox import FakeTokenizer, ask, inbox, private  # noqa: F401 (fixtures)

LIMITS = HintLimits(vocab_size=100, max_tokens=50)


@pytest.mark.parametrize(
    "kind, ids, extra_key, cache_salt, ttl_s",
    [
        ("pin", [1], None, None, None), ("pin", [1], None, None, 0), ("pin", [1], None, None, -5),
        ("pin", [1], None, None, math.nan), ("pin", [1], None, None, math.inf), ("pin", [1], None, None, True),
        ("pin", [1], None, None, "60"), ("pin", [1], None, None, 7 * 86400 + 1), ("pin", [], None, None, 5),
        ("pin", [100], None, None, 5), ("pin", [1], None, "s" * 257, 5), ("drop", [1], None, None, 5),
        ("drop", [2**63], None, None, None), ("drop", None, None, "s", None), ("purge", None, None, None, None),
        ("purge", None, None, "", None), ("purge", [1], None, "s", None), ("purge", None, "k", "s", None),
        ("purge", None, None, "s", 5), ("purge", None, None, ["s"], None), ("nuke", [1], None, "s", None),
        (None, [1], None, None, None), ("prefetch", [1], None, None, 5),
    ],
)  # fmt: skip
def test_bad_retention_hints_are_refused(
    kind: Any, ids: Any, extra_key: Any, cache_salt: Any, ttl_s: Any
) -> None:
    with pytest.raises(HintError) as e:
        check_hint(ids, extra_key, cache_salt, LIMITS, kind, ttl_s)
    assert "\n" not in str(e.value)


def test_good_retention_hints_pass_and_travel_unchanged() -> None:
    hints = [
        check_hint([1, 2], "k", "s", LIMITS, "pin", 3600),
        check_hint([1, 2], None, None, LIMITS, "drop"),
        check_hint(None, None, "user-42", LIMITS, "purge"),
        check_hint([3], None, None, LIMITS),
    ]
    assert hints[0] == Hint([1, 2], "k", "s", "pin", 3600.0)
    assert hints[2] == Hint([], None, "user-42", "purge")
    assert [unpack_hint(pack_hint(h), LIMITS) for h in hints] == hints
    assert msgpack.unpackb(pack_hint(hints[3])) == {"ids": [3], "extra_key": None, "cache_salt": None}


@pytest.mark.parametrize(
    "payload",
    [
        {"kind": "pin", "ids": [1]}, {"kind": "pin", "ids": [1], "ttl_s": "9"}, {"kind": "nuke", "ids": [1]},
        {"kind": "purge"}, {"kind": "purge", "cache_salt": "s", "ids": [1]}, {"kind": 3, "ids": [1]},
        {"kind": "drop", "ids": [1], "ttl_s": 1.0, "extra_key": None, "cache_salt": None, "x": 1},
    ],
)  # fmt: skip
def test_the_scheduler_checks_retention_hints_again(payload: dict[str, Any]) -> None:
    with pytest.raises(Exception):  # noqa: B017 (msgpack raises several kinds; all are answered)
        unpack_hint(msgpack.packb(payload), LIMITS)


@pytest.mark.parametrize(
    "kind, body",
    [
        ("purge", b"{}"), ("purge", b'{"cache_salt": ""}'), ("purge", b'{"cache_salt": "s", "input_ids": [1]}'),
        ("purge", b'{"cache_salt": "s", "messages": [{}]}'), ("purge", b'{"cache_salt": 5}'), ("purge", b"[]"),
        ("pin", b'{"input_ids": [1]}'), ("pin", b'{"input_ids": [1], "ttl_s": null}'),
        ("pin", b'{"input_ids": [1], "ttl_s": 1e400}'), ("pin", b'{"messages": [{}], "ttl_s": 0}'),
        ("drop", b'{"input_ids": [1], "ttl_s": 5}'), ("drop", b'{"cache_salt": "s"}'), ("drop", b"\xff"),
    ],
)  # fmt: skip
def test_bad_bodies_of_each_route_are_one_line_400s(kind: str, body: bytes) -> None:
    with pytest.raises(HintError) as e:
        parse_hint(body, FakeTokenizer([1]), LIMITS, kind)
    assert "\n" not in str(e.value)


def test_bodies_of_each_route() -> None:
    assert set(ROUTES.values()) == {"prefetch", "pin", "drop", "purge"}
    chat = b'{"messages": [{"role": "user", "content": "hi"}], "cache_salt": "u", "ttl_s": 600}'
    assert parse_hint(chat, FakeTokenizer([4, 5]), LIMITS, "pin") == Hint([4, 5], None, "u", "pin", 600.0)
    assert parse_hint(b'{"cache_salt": "u"}', None, LIMITS, "purge") == Hint([], None, "u", "purge")
    with pytest.raises(HintError, match="does not take 'ttl_s'"):  # ignored before issue 38: refused now
        parse_hint(b'{"input_ids": [1], "ttl_s": 60}', None, LIMITS)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
FIELDS = st.fixed_dictionaries(
    {}, optional={"input_ids": JSON, "messages": JSON, "cache_salt": JSON, "extra_key": JSON, "ttl_s": JSON}
)


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(["pin", "drop", "purge"]), body=FIELDS | JSON)
def test_random_bodies_are_a_hint_or_a_400(kind: str, body: Any) -> None:
    try:
        hint = parse_hint(json.dumps(body).encode(), FakeTokenizer([1]), LIMITS, kind)
    except HintError:
        return
    assert hint.kind == kind and unpack_hint(pack_hint(hint), LIMITS) == hint


def test_a_refused_pin_is_answered_409_with_its_reason(inbox: Any, private: Path) -> None:  # noqa: F811
    reply = ask(inbox, private, Hint([1], None, None, "pin", 5.0), lambda *a: HintRefused("over the budget"))
    assert reply == {"error": "over the budget", "status": 409}
    seen: list[Any] = []
    reply = ask(inbox, private, Hint([], None, "u", "purge"), lambda *a: seen.append(a))
    assert reply == {"accepted": True} and seen == [([], None, "u", "purge", None)]


class Cache:
    """What the hooks call on a cache (isinstance checks are patched below)."""

    def __init__(self) -> None:
        self.applied: list[Any] = []
        self.retention = SimpleNamespace(apply=self.applied.append)

    def prefetch(self, *hint: Any, hinted: bool = False) -> int:
        self.applied.append(ResumeHint(*hint))
        return 0


def test_retention_hints_leave_sglangs_list_and_apply_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    from sgl_hicache.cache import spill_radix_cache

    monkeypatch.setattr(spill_radix_cache, "SpillRadixCache", Cache)
    hints = [RetentionHint("pin", [1], None, None, 5.0), ResumeHint([2], None, None),
             RetentionHint("purge", [], None, "u", None)]  # fmt: skip
    received = ["req", *hints, "req2"]
    cache = Cache()
    hooks.apply_hints(SimpleNamespace(tree_cache=cache), received)
    assert received == ["req", "req2"] and cache.applied == hints
    assert pickle.loads(pickle.dumps(hints)) == hints
