"""In-memory index of published extents: LRU order, pins, byte accounting and reservations.

Not thread-safe: the owner (FileTier) calls every method under its lock.

Why an OrderedDict: `move_to_end` on access and popping from the front give O(1) LRU without a
separate list, at ~300 bytes per extent all told (measured by benchmarks/tier.py --index-extents).
Invariants (checked by `check`): used_bytes == sum of entries' file_bytes; used_bytes + reserved
<= capacity; a pinned key is never chosen as a victim. `dying` counts victims taken out of the
index whose files are not yet unlinked (the owner unlinks them before writing, outside the lock,
then calls `buried`); `reserve` counts them as still on disk, so the bytes on disk (indexed +
dying + written so far by reserved stores) never exceed the capacity, even transiently.
Each entry keeps `used_at` (wall clock of its publish or last use), so that the shared budget
(process.py) can weigh our LRU against other processes' files by their mtime.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque

from sgl_hicache.tier.keys import ExtentKey
from sgl_hicache.tier.results import ExtentInfo

EVICTED_KEPT = 1 << 16  # evicted keys kept for `Tier.take_evicted` between two calls


class OverBudget(Exception):
    """No room: the extent does not fit the budget or the free-space watermark (not a fault)."""


class Entry:
    __slots__ = ("file_bytes", "parent", "payload_len", "token_count", "used_at")

    def __init__(
        self,
        parent: ExtentKey,
        token_count: int,
        payload_len: int,
        file_bytes: int,
        used_at: float | None = None,
    ) -> None:
        self.parent = parent
        self.token_count = token_count
        self.payload_len = payload_len
        self.file_bytes = file_bytes
        self.used_at = time.time() if used_at is None else used_at

    def info(self, key: ExtentKey) -> ExtentInfo:
        return ExtentInfo(key, self.parent, self.token_count, self.payload_len, self.file_bytes)


class Index:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used_bytes = 0
        self.reserved = 0
        self.dying = 0
        self.dying_keys: set[ExtentKey] = set()
        self._lru: OrderedDict[ExtentKey, Entry] = OrderedDict()
        self._pins: dict[ExtentKey, int] = {}
        self.evicted: deque[ExtentKey] = deque(maxlen=EVICTED_KEPT)  # `Tier.take_evicted`

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: ExtentKey) -> bool:
        return key in self._lru

    def get(self, key: ExtentKey) -> Entry | None:
        return self._lru.get(key)

    def items(self) -> list[tuple[ExtentKey, Entry]]:
        return list(self._lru.items())

    def touch(self, key: ExtentKey) -> None:
        entry = self._lru.get(key)
        if entry is not None:
            self._lru.move_to_end(key)
            entry.used_at = time.time()

    def add(self, key: ExtentKey, entry: Entry) -> None:
        """Insert as most recently used, replacing (and un-accounting) any old entry."""
        self.remove(key)
        self._lru[key] = entry
        self.used_bytes += entry.file_bytes

    def remove(self, key: ExtentKey) -> Entry | None:
        entry = self._lru.pop(key, None)
        if entry is not None:
            self.used_bytes -= entry.file_bytes
        return entry

    def remove_if(self, key: ExtentKey, entry: Entry) -> bool:
        """Remove `key` if it is still indexed as `entry` (not re-published since); whether it was."""
        if self._lru.get(key) is not entry:
            return False
        self.remove(key)
        return True

    def pin(self, key: ExtentKey) -> None:
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: ExtentKey) -> None:
        left = self._pins[key] - 1
        if left:
            self._pins[key] = left
        else:
            del self._pins[key]

    def pinned(self, key: ExtentKey) -> bool:
        return key in self._pins

    def reserve(self, nbytes: int) -> list[tuple[ExtentKey, Entry]] | None:
        """Reserve `nbytes` within capacity, evicting LRU unpinned entries; None (no change) if impossible."""
        victims = self._victims(self.used_bytes + self.reserved + self.dying + nbytes - self.capacity)
        if victims is None:
            return None
        self.kill(victims)
        self.reserved += nbytes
        return victims

    def evict(self, nbytes: int) -> list[tuple[ExtentKey, Entry]] | None:
        """Remove LRU unpinned entries totalling at least `nbytes`; None (no change) if impossible."""
        victims = self._victims(nbytes)
        self.kill(victims or [])
        return victims

    def oldest_unpinned(self) -> tuple[ExtentKey, Entry] | None:
        return next(((k, e) for k, e in self._lru.items() if k not in self._pins), None)

    def kill(self, victims: list[tuple[ExtentKey, Entry]]) -> None:
        """Take `victims` out of the index; their bytes count as dying until `buried`."""
        for key, entry in victims:
            self.remove(key)
            self.evicted.append(key)
            self.dying += entry.file_bytes
            self.dying_keys.add(key)

    def buried(self, key: ExtentKey, nbytes: int) -> None:
        """A victim's file (`nbytes`) is gone from disk."""
        self.dying -= nbytes
        self.dying_keys.discard(key)

    def release(self, nbytes: int) -> None:
        self.reserved -= nbytes

    def _victims(self, need: int) -> list[tuple[ExtentKey, Entry]] | None:
        victims: list[tuple[ExtentKey, Entry]] = []
        for key, entry in self._lru.items():
            if need <= 0:
                break
            if key not in self._pins:
                victims.append((key, entry))
                need -= entry.file_bytes
        return victims if need <= 0 else None

    def check(self) -> None:
        total = sum(e.file_bytes for e in self._lru.values())
        if total != self.used_bytes:
            raise AssertionError(
                f"index accounting: entries sum to {total} B, used_bytes says {self.used_bytes}"
            )
        if self.used_bytes + self.reserved > self.capacity:
            raise AssertionError(
                f"over budget: used {self.used_bytes} + reserved {self.reserved} > capacity {self.capacity}"
            )
        if self.reserved < 0 or self.dying < 0:
            raise AssertionError(f"negative reservation {self.reserved} or dying bytes {self.dying}")
