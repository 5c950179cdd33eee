"""The extents a tier that cannot list its store has seen lately (backend.py): a bounded LRU.

Such a tier learns of an extent only by storing or loading it, and never hears of the store
evicting one, so its index only grows: bounded here to `limit` entries (the least recently used
go first), with a running byte total for `stats`. Not thread-safe: the owner holds its lock.
"""

from __future__ import annotations

from collections import OrderedDict

from sgl_hicache.tier.base import ExtentInfo
from sgl_hicache.tier.keys import ExtentKey

DEFAULT_LIMIT = 1 << 20  # ~200 MB of entries at most


class RecentExtents:
    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self._entries: OrderedDict[ExtentKey, ExtentInfo] = OrderedDict()
        self._limit = limit
        self.bytes = 0  # file_bytes of the entries

    def remember(self, info: ExtentInfo) -> None:
        """Add or refresh `info` as the most recently used; forgets the oldest past the limit."""
        self.forget(info.key)
        self._entries[info.key] = info
        self.bytes += info.file_bytes
        while len(self._entries) > self._limit:
            self.bytes -= self._entries.popitem(last=False)[1].file_bytes

    def forget(self, key: ExtentKey) -> None:
        gone = self._entries.pop(key, None)
        self.bytes -= 0 if gone is None else gone.file_bytes

    def get(self, key: ExtentKey) -> ExtentInfo | None:
        return self._entries.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)
