"""What the cache needs of a source of client resume hints (the server's `HintInbox` is one).

The cache owns no transport: whoever builds it (`server/factory.py`) passes a `HintSource` in, so
`cache/` never imports `server/`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol


class ResumeHint(NamedTuple):
    """One checked client hint, as it travels from the TP rank-0 scheduler (which has the inbox)
    to every rank inside sglang's own request broadcast (so it must pickle, and it does)."""

    token_ids: list[int]
    extra_key: str | None
    cache_salt: str | None


class RetentionHint(NamedTuple):
    """A checked pin, drop or purge (cache/retention.py), travelling like a `ResumeHint`."""

    kind: str  # "pin", "drop" or "purge"
    token_ids: list[int]  # empty for a purge
    extra_key: str | None
    cache_salt: str | None
    ttl_s: float | None  # a pin's


class HintRefused(NamedTuple):
    """What a hint handler returns to refuse a hint: the sender is answered 409 with `reason`."""

    reason: str


class HintSource(Protocol):
    def drain(self, handle: Callable[..., object]) -> int:
        """Call `handle(token_ids, extra_key, cache_salt, kind, ttl_s)` for each waiting hint, at
        most a bounded number per call, and return how many were taken; a `HintRefused` that
        `handle` returns refuses that hint. Runs on the scheduler thread: never blocks, and raises
        nothing for a bad hint (the source answers its sender with the error)."""
        ...
