"""I/O failures as results: errno → Status, rate-limited logging, and the stats counters."""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections import Counter

from sgl_hicache.tier.directio import ShortIO
from sgl_hicache.tier.format import FormatError, Mismatch
from sgl_hicache.tier.results import Op, Status

logger = logging.getLogger("sgl_hicache.tier")

LOG_INTERVAL_S = 60.0
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}


def classify(op: Op, err: Exception) -> Status:
    """Status for an error raised by a store or load job (anything else is a bug and propagates)."""
    if isinstance(err, Mismatch):
        return Status.MISMATCH
    if isinstance(err, FormatError) or (op is Op.LOAD and isinstance(err, ShortIO)):
        return Status.CORRUPT
    if op is Op.LOAD and isinstance(err, FileNotFoundError):
        return Status.MISS
    if isinstance(err, OSError) and err.errno in _NO_SPACE:
        return Status.NO_SPACE
    return Status.IO_ERROR


def condition(op: Op, err: Exception) -> str:
    """A short name for a failure condition (one log line per condition per interval)."""
    code = getattr(err, "errno", None)
    name = errno.errorcode.get(code, type(err).__name__) if isinstance(code, int) else type(err).__name__
    return f"{op.value}:{name}"


class FaultLog:
    """Logs the first occurrence of each condition, then at most once per LOG_INTERVAL_S with a count."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self._interval = interval_s
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()

    def report(self, op: Op, err: Exception, where: str) -> None:
        cond = condition(op, err)
        more = self._due(cond)
        if more is not None:
            suffix = f" ({more} more since last report)" if more else ""
            logger.warning("spill tier %s failed on %s: %s%s", cond, where, err, suffix)

    def unexpected(self, op: Op, err: Exception, where: str) -> None:
        """A fault no job expected (a bug, a binding raising): an error, with its traceback."""
        cond = "unexpected " + condition(op, err)
        more = self._due(cond)
        if more is not None:
            suffix = f" ({more} more since last report)" if more else ""
            logger.error("spill tier %s on %s: %s%s", cond, where, err, suffix, exc_info=err)

    def _due(self, cond: str) -> int | None:
        """How many of `cond` went unlogged since it was last logged, if it is to be logged now."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(cond)
            if last is not None and now - last < self._interval:
                self._suppressed[cond] += 1
                return None
            self._last[cond] = now
            return self._suppressed.pop(cond, 0)


class Counters:
    """Thread-safe named counters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: Counter[str] = Counter()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._c[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)
