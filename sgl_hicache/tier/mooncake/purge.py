"""Purging a cache_salt from a Mooncake Store (`MooncakeTier.submit_purge`).

Every object of a salted extent (header, chunks, aliases) is named in its salt's directory
(client.py), in whatever namespace, so one `remove_by_regex` of `salt_pattern` removes them all, for
every model and TP rank sharing the store (each rank's purge runs it again: idempotent). Stores of
the salt in flight when the purge is queued are *doomed*: their store job removes what it has just
written (backend.py). A purge the store failed (an unreachable master, the binding raising) is
*owed*: retried on the tier's periodic tick until it succeeds, each retry counted in
`purge_retries` (a failure also in `io_errors`, logged at most once a minute).

`doom` and `doomed` run under the tier's lock; `run` (whose failure the tier's completion counts) and `retry` on its I/O threads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from sgl_hicache.tier.faults import Counters, FaultLog
from sgl_hicache.tier.keys import ExtentKey
from sgl_hicache.tier.mooncake.client import StoreClient, salt_pattern
from sgl_hicache.tier.mooncake.objects import StoreFailed
from sgl_hicache.tier.results import Op


class Purges:
    def __init__(self, client: StoreClient, counters: Counters, faults: FaultLog, where: str) -> None:
        self._client, self._counters, self._faults, self._where = client, counters, faults, where
        self._doomed: set[ExtentKey] = set()
        self._owed: set[bytes] = set()
        self._owed_lock = threading.Lock()

    def doom(self, storing: Iterable[ExtentKey]) -> None:
        """A purge is queued; `storing`: the keys of its salt's stores in flight."""
        self._doomed.update(storing)

    def doomed(self, key: ExtentKey) -> bool:
        """`key`'s store ended: whether what it wrote must go (taken once)."""
        found = key in self._doomed
        self._doomed.discard(key)
        return found

    def run(self, salt: bytes) -> int | None:
        """Remove every object of `salt`; how many, or None if the store failed. Owed until the
        store says it is done: also when the call raises (the binding), which propagates."""
        with self._owed_lock:
            self._owed.add(salt)
        reply = self._client.remove_matching(salt_pattern(salt))
        if not reply.ok:
            self._faults.report(Op.PURGE, StoreFailed("remove_by_regex", reply), self._where)
            return None
        with self._owed_lock:
            self._owed.discard(salt)
        self._counters.add("purged_extents", reply.n)
        return reply.n

    def retry(self) -> None:
        """Run each owed purge again (the tier's periodic tick)."""
        with self._owed_lock:
            owed = list(self._owed)
        for salt in owed:
            self._counters.add("purge_retries")
            try:
                done = self.run(salt) is not None
            except Exception as e:  # the binding raised: still owed, and the other salts still run
                self._faults.unexpected(Op.PURGE, e, self._where)
                done = False
            if not done:
                self._counters.add("io_errors")

    @property
    def owed(self) -> int:
        with self._owed_lock:
            return len(self._owed)
