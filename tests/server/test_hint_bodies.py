"""The JSON bodies of the hint routes, without a server (issue 38): a key a route does not take is
a 400 (a typo such as `cache_slat` on a drop must never act on the default tenant), so is a body
with both `messages` and `input_ids`; `messages` are checked and normalized as sglang's
`/v1/chat/completions` takes them, so OpenAI content parts give the tokens of the plain string."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sgl_hicache.server.hints import Hint, HintError, HintLimits
from sgl_hicache.server.http_routes import parse_hint
from tests.server.test_hostile_inbox import FakeTokenizer

LIMITS = HintLimits(vocab_size=100, max_tokens=50)
USER = {"role": "user", "content": "hi"}


def refused(body: Any, kind: str = "prefetch", tokenizer: Any = None) -> str:
    """The one-line reason `parse_hint` refuses `body` for; fails if it takes it."""
    with pytest.raises(HintError) as e:
        parse_hint(json.dumps(body).encode(), tokenizer or FakeTokenizer([1]), LIMITS, kind)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize(
    "kind, body, key",
    [
        ("drop", {"input_ids": [1], "cache_slat": "tenant-a"}, "cache_slat"),
        ("drop", {"messages": [USER], "ttl": 5}, "ttl"),
        ("prefetch", {"input_ids": [1], "model": "m"}, "model"),
        ("prefetch", {"input_ids": [1], "ttl_s": 60}, "ttl_s"),
        ("pin", {"input_ids": [1], "ttl_s": 60, "extra_keys": "k"}, "extra_keys"),
        ("purge", {"cache_salt": "s", "salt": "s"}, "salt"),
        ("drop", {"input_ids": [1], "line\nbreak": 1}, "line\\nbreak"),
    ],
)  # fmt: skip
def test_a_key_the_route_does_not_take_is_a_400_that_names_it(kind: str, body: Any, key: str) -> None:
    assert key in refused(body, kind)


@pytest.mark.parametrize("kind", ["prefetch", "pin", "drop"])
def test_messages_and_input_ids_together_are_a_400(kind: str) -> None:
    body: dict[str, Any] = {"messages": [USER], "input_ids": [1]} | ({"ttl_s": 5} if kind == "pin" else {})
    assert "not both" in refused(body, kind)


@pytest.mark.parametrize(
    "messages",
    [
        [{"content": "no role"}], [{"role": "bogus", "content": "x"}], [{"role": "User", "content": "x"}], [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [{"text": "no type"}]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
        [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "video_url", "video_url": {"url": "v"}}]}],
    ],
)  # fmt: skip
def test_messages_sglang_would_refuse_or_that_are_not_text_are_a_400(messages: Any) -> None:
    refused({"messages": messages})


@pytest.fixture(scope="module")
def chatml(tiny_model: Path) -> tuple[Any, str]:
    """The tiny model's tokenizer (a ChatML template that concatenates `message['content']`) and
    the content format sglang detects for its template."""
    from sglang.srt.parser.jinja_template_utils import detect_jinja_template_content_format
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    return tokenizer, detect_jinja_template_content_format(tokenizer.chat_template)


def ids_of(messages: list[dict[str, Any]], chatml: tuple[Any, str]) -> list[int]:
    limits = HintLimits(vocab_size=len(chatml[0]), max_tokens=4096)
    body = json.dumps({"messages": messages, "cache_salt": "t"}).encode()
    hint = parse_hint(body, chatml[0], limits, "prefetch", content_format=chatml[1])
    assert hint == Hint(hint.ids, None, "t")
    return hint.ids


def parts(*texts: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": t} for t in texts]


def test_content_parts_give_the_tokens_of_the_plain_string(chatml: tuple[Any, str]) -> None:
    assert chatml[1] == "string"  # what sglang's /v1/chat/completions does with this template
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."},
             {"role": "assistant", "content": "Seven."}, {"role": "user", "content": "Another one and why"}]  # fmt: skip
    with_parts = [{"role": "system", "content": parts("Be brief.")}, {"role": "user", "content": parts("Name a prime.")},
                  {"role": "assistant", "content": "Seven."}, {"role": "user", "content": parts("Another one", "and why")}]  # fmt: skip
    assert ids_of(with_parts, chatml) == ids_of(plain, chatml)  # sglang joins text parts with one space
    assert len(ids_of(plain, chatml)) > 10


def test_messages_reach_the_template_as_sglang_passes_them() -> None:
    class Recorder(FakeTokenizer):
        def apply_chat_template(self, messages: Any, **kwargs: Any) -> Any:
            self.seen = messages
            return [1]

    tok = Recorder()
    body = {
        "messages": [{"role": "user", "content": parts("a", "b")}, {"role": "assistant", "content": None}]
    }
    parse_hint(json.dumps(body).encode(), tok, LIMITS, content_format="string")
    assert tok.seen == [{"role": "user", "content": "a b"}, {"role": "assistant", "content": ""}]
    parse_hint(json.dumps(body).encode(), tok, LIMITS, content_format="openai")
    assert tok.seen == [{"role": "user", "content": parts("a", "b")}, {"role": "assistant", "content": ""}]
