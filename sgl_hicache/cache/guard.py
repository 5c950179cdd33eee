"""Containment of our exceptions in the calls sglang makes into the cache (`match_prefix`, `evict`,
`init_load_back`, `reset`, and inserts through `cache_finished_req` / `cache_unfinished_req`).

An exception raised by our extension logic (spill, restore, prefetch bookkeeping) must never reach
sglang's scheduler loop: it would end the scheduler process, and with it the server. A method
marked `@contained(name, fallback)` that raises an `Exception` instead counts it (the
`internal_errors` counter), logs it once per name with its traceback, and returns what
`fallback(cache, *args)` returns: sglang's plain `RadixCache` behaviour on our tree, which never
serves KV that was not verified (a resident-only match, a restore not done, a drop instead of a
spill). Fallbacks must leave the tree and pool consistent (`check_integrity` holds) whatever point
the method reached. A fallback may run code that just failed (a walk, a drop): if it raises too,
the guard counts and logs that once per name, answers with the fallback's `last_resort` (an
always-safe answer that touches no KV: an empty match, nothing evicted, nothing restored, sglang's
own reset) and switches spill off for good on that cache (`disable_spill`, logged once), so the
server goes on as sglang's plain radix cache. A fallback without a last resort re-raises.

Inner steps with a cheaper fallback (the poll of completions, one node's spill, a restore's
readiness or unpack, the adoption of spilled nodes by an insert) are contained where they run, so
the method goes on and, with TP > 1, still reaches its agreement collectives: a deterministic
fault (every rank has the same tree) takes the same fallback on every rank. A fault on one rank
only that escapes to a method's fallback can skip a collective; it is counted and logged like any.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar

from sgl_hicache.cache.metrics import SpillMetrics

logger = logging.getLogger(__name__)


class Guarded(Protocol):
    @property
    def spill_metrics(self) -> SpillMetrics: ...

    @property
    def errors_logged(self) -> set[str]: ...

    def disable_spill(self) -> None: ...


C = TypeVar("C", bound=Guarded)
S = TypeVar("S", bound=Guarded)
P = ParamSpec("P")
T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


def internal_error(cache: Guarded, name: str) -> None:
    """Count the exception being handled and log it (with its traceback) the first time `name` fails."""
    cache.spill_metrics.inc("internal_errors")
    if name not in cache.errors_logged:
        cache.errors_logged.add(name)
        logger.exception(
            "sgl_hicache: internal error in %s; served as sglang's plain radix cache would "
            "(nothing unverified is used; logged once, counted in internal_errors)",
            name,
        )


def fallback_failed(cache: Guarded, name: str) -> None:
    """Count the exception a fallback raised, log it once per `name`, and turn spill off for good."""
    cache.spill_metrics.inc("internal_errors")
    if f"{name} (fallback)" not in cache.errors_logged:
        cache.errors_logged.add(f"{name} (fallback)")
        logger.exception(
            "sgl_hicache: internal error in the fallback of %s; answered with its last resort "
            "(logged once, counted in internal_errors)",
            name,
        )
    cache.disable_spill()


def last_resort(answer: Callable[..., Any]) -> Callable[[F], F]:
    """Give a fallback the answer its guard returns if the fallback itself raises: called with the
    same arguments, always safe (it reads, frees and serves no KV)."""

    def attach(fallback: F) -> F:
        fallback.last_resort = answer  # type: ignore[attr-defined]
        return fallback

    return attach


def contained(
    name: str, fallback: Callable[Concatenate[S, P], T]
) -> Callable[[Callable[Concatenate[S, P], T]], Callable[Concatenate[S, P], T]]:
    """The method, or `fallback(self, ...)` after counting and logging an exception it raised."""

    def wrap(method: Callable[Concatenate[S, P], T]) -> Callable[Concatenate[S, P], T]:
        @functools.wraps(method)
        def run(self: S, *args: P.args, **kwargs: P.kwargs) -> T:
            try:
                return method(self, *args, **kwargs)
            except Exception:
                internal_error(self, name)
            try:
                return fallback(self, *args, **kwargs)
            except Exception:
                resort: Callable[Concatenate[S, P], T] | None = getattr(fallback, "last_resort", None)
                if resort is None:
                    raise
                fallback_failed(self, name)
                return resort(self, *args, **kwargs)

        return run

    return wrap


class GuardedPart(Generic[C]):
    """A part of the cache (spilling.py, matching.py, ...) that holds the cache owning it as `cache`
    and whose steps are `contained`: their errors count on the cache's metrics and are logged once
    per name for the whole cache, and a fallback that fails turns spill off on the cache."""

    def __init__(self, cache: C) -> None:
        self.cache = cache

    @property
    def spill_metrics(self) -> SpillMetrics:
        return self.cache.spill_metrics

    @property
    def errors_logged(self) -> set[str]:
        return self.cache.errors_logged

    def disable_spill(self) -> None:
        self.cache.disable_spill()


def nothing(_cache: Any, *_args: Any, **_kwargs: Any) -> None:
    """The fallback of a step that may simply be skipped (a poll: the next one sees its work)."""
