"""Shared benchmark harness: timing, repeated side-by-side measurement, and the final JSON line.

Every benchmark in this directory measures its baseline in the same run (this machine is shared
and noisy, so only ratios measured side by side mean anything) and ends by printing exactly one
JSON object of named figures as its last stdout line (`emit`).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def best_of(fn: Callable[[], Any], repeat: int = 5, warmup: int = 1) -> float:
    """Run `fn` warmup+repeat times; return the best wall time of the measured runs in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def median_of(fn: Callable[[], Any], repeat: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def log(msg: str) -> None:
    """Human-readable progress goes to stderr, so stdout's last line stays the JSON result."""
    print(msg, file=sys.stderr, flush=True)


def emit(figures: dict[str, Any]) -> None:
    """Print the final JSON line of named figures (floats rounded to 4 significant digits)."""
    rounded = {k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in figures.items()}
    print(json.dumps(rounded, sort_keys=True), flush=True)
