"""The extents a tier that cannot list its store has seen lately (backend.py): a bounded LRU.

Such a tier learns of an extent only by finding it at open (manifest.py), storing, loading or
looking it up, and never hears of the store evicting one, so its index only grows: bounded here to
`limit` entries (the least recently used go first), with a running byte total for `stats`. Each
entry keeps its salt tag too: the objects of a salted extent are named by it (client.py), so a load
of a key this index forgot looks for it without a salt (and misses a salted one). Not thread-safe:
the owner holds its lock.
"""

from __future__ import annotations

from collections import OrderedDict

from sgl_hicache.tier.keys import ExtentKey
from sgl_hicache.tier.results import ExtentInfo

DEFAULT_LIMIT = 1 << 20  # ~250 MB of entries at most


class RecentExtents:
    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self._entries: OrderedDict[ExtentKey, tuple[ExtentInfo, bytes | None]] = OrderedDict()
        self._limit = limit
        self.bytes = 0  # file_bytes of the entries

    def remember(self, info: ExtentInfo, salt: bytes | None = None) -> None:
        """Add or refresh `info` (of salt tag `salt`) as the most recently used; forgets the oldest
        past the limit."""
        self.forget(info.key)
        self._entries[info.key] = (info, salt)
        self.bytes += info.file_bytes
        while len(self._entries) > self._limit:
            self.bytes -= self._entries.popitem(last=False)[1][0].file_bytes

    def forget(self, key: ExtentKey) -> None:
        gone = self._entries.pop(key, None)
        self.bytes -= 0 if gone is None else gone[0].file_bytes

    def get(self, key: ExtentKey) -> ExtentInfo | None:
        entry = self._entries.get(key)
        return None if entry is None else entry[0]

    def salt(self, key: ExtentKey) -> bytes | None:
        """The salt tag of `key` (None: stored without a cache_salt, or not in the index)."""
        entry = self._entries.get(key)
        return None if entry is None else entry[1]

    def of_salt(self, salt: bytes) -> list[ExtentKey]:
        return [k for k, (_, s) in self._entries.items() if s == salt]

    def infos(self) -> list[ExtentInfo]:
        """Every entry, least recently used first."""
        return [info for info, _ in self._entries.values()]

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)
