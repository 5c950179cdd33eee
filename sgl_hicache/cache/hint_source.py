"""What the cache needs of a source of client resume hints (the server's `HintInbox` is one).

The cache owns no transport: whoever builds it (`server/factory.py`) passes a `HintSource` in, so
`cache/` never imports `server/`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class HintSource(Protocol):
    def drain(self, handle: Callable[[list[int], str | None, str | None], object]) -> int:
        """Call `handle(token_ids, extra_key, cache_salt)` for each waiting hint, at most a bounded
        number per call, and return how many were taken. Runs on the scheduler thread: never blocks,
        and raises nothing for a bad hint (the source answers its sender with the error)."""
        ...
