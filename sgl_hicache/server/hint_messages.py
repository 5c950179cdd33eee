"""The `messages` of a hint body as sglang's `/v1/chat/completions` takes them (issue 38).

A hint is worth something only if its tokens are the ones the conversation's next request will
have, so its messages go through the same steps as that request's, with sglang's own code (0.5.23,
`OpenAIServingChat._apply_jinja_template`): checked as sglang's `ChatCompletionMessageParam` (what
it refuses with 400, so do we), dumped, assistant tool-call arguments parsed, a `None` content made
`""`, the content put in the form the model's chat template expects
(`process_content_for_template_format`: for a template that reads `message['content']` as a string,
OpenAI text parts `[{"type": "text", "text": ...}]` become their texts joined by one space) and a
tool message's text parts flattened (`normalize_tool_content`).

A hint carries text only: a message with an image, video, audio or any other non-text part is
refused (400), as the tokens of such a request depend on its media. Not mirrored: sglang's
reordering of tool results for templates that match them by `tool_call_id`, and its non-Jinja
chat encoders (DeepSeek-V3.2, Kimi): hints for those conversations may miss the cache, never more.

Blocking (pydantic over up to `MAX_MESSAGES` messages): run it off the event loop.
"""

from __future__ import annotations

import functools
from typing import Any

from sgl_hicache.server.hints import HintError

MAX_MESSAGES = 1024
TEXT_PART = "text"


def chat_messages(raw: Any, content_format: str | None) -> list[dict[str, Any]]:
    """The messages the chat template gets for `raw` (a body's `messages`), given the content format
    sglang detected for the model's template ("string" or "openai"; None: "string"); HintError
    (one line) for messages sglang would refuse or that are not text."""
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_MESSAGES:
        raise HintError(f"'messages' must be a list of 1 to {MAX_MESSAGES} messages")
    from pydantic import ValidationError

    try:
        validated = _message_list().validate_python(raw)
    except ValidationError as e:
        first = e.errors()[0]  # loc: (message index, the union member tried, field, ...)
        where = f"message {first['loc'][0]}" if first["loc"] else "messages"
        raise HintError(f"{where} is not a chat message sglang takes: {first['msg']!r}"[:240]) from None
    return [_normalized(m.model_dump(), content_format or "string") for m in validated]


@functools.cache
def _message_list() -> Any:
    from pydantic import TypeAdapter
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionMessageParam

    return TypeAdapter(list[ChatCompletionMessageParam])


def _normalized(message: dict[str, Any], content_format: str) -> dict[str, Any]:
    from sglang.srt.entrypoints.openai.serving_chat import (
        normalize_assistant_tool_call_arguments,
        normalize_tool_content,
    )
    from sglang.srt.parser.jinja_template_utils import process_content_for_template_format

    content = message.get("content")
    if isinstance(content, list) and any(part.get("type") != TEXT_PART for part in content):
        raise HintError("a hint's message content parts must all be text (no image, audio or video)")
    try:
        normalize_assistant_tool_call_arguments(message, strict=True)
    except ValueError:
        raise HintError("an assistant tool call's 'arguments' are not a JSON object") from None
    if content is None:
        message["content"] = ""
    out: dict[str, Any] = process_content_for_template_format(message, content_format, [], [], [], [])
    out["content"] = normalize_tool_content(out["role"], out.get("content"))
    return out
