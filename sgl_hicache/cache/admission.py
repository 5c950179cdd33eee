"""Admission of a request whose cached prefix runs into spilled KV (sglang's `init_load_back`).

sglang's scheduler calls `init_load_back` when it admits a request whose match had a host hit; the
answer is what the request keeps of its prefix, or None ("retry": the scheduler skips it this
round; its loop never waits on I/O but for a bounded hold at a request's first attempt). This
object decides, for the spilled nodes on the request's path:
- their **readiness** (`_restore_readiness`): the reads they need, started if missing, and how long
  admission may wait for them (`RestorePolicy`, the one place the prefetch policy becomes limits,
  restore_policy.py), counted from the oldest read or the request's first deferral; at a request's
  first attempt, a bounded hold for reads in flight instead of a deferral (admission_hold.py);
- what **every TP rank agrees** on (`_agreed_readiness`: the least ready);
- the outcome: restored whole (restoring.py), admitted layer-wise (layerwise_flow.py), deferred
  while what landed streams into the restore's slots, recomputed, or, an extent lost on some rank,
  the spilled chain dropped everywhere.
It also says whether an attempt was deferred (`begin` / `end`: the admission hook turns sglang's
"stop admitting" into "skip this one") and whether admission should wait for a running
cross-server lookup (`lookup_waiting`).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams
from sglang.srt.mem_cache.radix_cache import TreeNode

from sgl_hicache.cache.admission_hold import AdmissionHold
from sgl_hicache.cache.guard import GuardedPart, contained
from sgl_hicache.cache.layerwise_flow import LayerwiseFlow
from sgl_hicache.cache.owning_cache import OwningCache
from sgl_hicache.cache.reads import Readiness
from sgl_hicache.cache.restore_policy import RestorePolicy
from sgl_hicache.cache.restoring import Restoring, owner_of
from sgl_hicache.cache.spill_state import ExtentState
from sgl_hicache.config import SpillConfig


class Admission:
    """One admission attempt of a request (`begin_admission` .. `end_admission`): whether
    `init_load_back` deferred it, which sglang reports only as a generic "stop admitting"."""

    def __init__(self, rid: str | None) -> None:
        self.rid = rid
        self.deferred = False


class AdmissionCache(OwningCache, Protocol):
    """What admission needs of the cache (`SpillRadixCache` is one)."""

    spill_config: SpillConfig
    root_node: TreeNode


class RestoreAdmission(GuardedPart[AdmissionCache]):
    def __init__(self, cache: AdmissionCache, restoring: Restoring, layerwise: LayerwiseFlow) -> None:
        super().__init__(cache)
        self.restoring = restoring
        self.layerwise = layerwise
        self._deferred_since: dict[str, float] = {}  # rid -> when its admission was first deferred
        self.hold = AdmissionHold(cache.spill_metrics)
        self._attempt: Admission | None = None

    def begin(self, rid: str | None) -> Admission:
        """Start watching one admission attempt of request `rid` (the admission hook's)."""
        self._attempt = Admission(rid)
        return self._attempt

    def end(self, attempt: Admission) -> bool:
        """Whether `init_load_back` deferred the request during `attempt` (its reads are in flight)."""
        if self._attempt is attempt:
            self._attempt = None
        return attempt.deferred

    def lookup_waiting(self, rid: str | None) -> bool:
        """Whether request `rid`'s admission should wait for its cross-server lookup: still running,
        within the prefetch policy's limit (`RestorePolicy.lookup_wait_s`; never with best_effort).
        Off where none is started (on a root no other server uses: `Matching._start_lookup`).
        Never blocks."""
        ctl, limit_s = self.cache.controller, RestorePolicy.of(self.cache.spill_config).lookup_wait_s
        if ctl is None or limit_s <= 0:
            return False
        waiting = ctl.lookups.waiting(rid, limit_s)
        self.cache.spill_metrics.inc("lookups_waited", int(waiting))
        return waiting

    def load_back(self, params: InitLoadBackParams) -> tuple[int, Any] | None:
        """`SpillRadixCache.init_load_back` after its poll (see there)."""
        cache = self.cache
        rid = getattr(params.req, "rid", None)
        answer = self._load_back(params, rid)
        if answer is None:
            if self._attempt is not None and self._attempt.rid == rid:
                self._attempt.deferred = True
            return None
        if cache.controller is not None:  # admitted: a restore in progress not consumed now never will be
            cache.controller.restores.drop(owner_of(rid))
        if rid is not None:
            self.hold.admitted(rid)
        since = self._deferred_since.pop(rid, None) if rid is not None else None
        if since is not None:  # the admission waited for reads: the resumed turn's "wait" phase
            cache.spill_metrics.inc("restore_wait_seconds", time.monotonic() - since)
        return answer

    def _load_back(self, params: InitLoadBackParams, rid: str | None) -> tuple[int, Any] | None:
        cache = self.cache
        anchor = params.req.last_node if params.req is not None else None
        chain = cache.tree.path_up(params.best_match_node, anchor)
        if chain is None or sum(len(n.key) for n in chain) != params.host_hit_length:
            return 0, anchor if anchor is not None else cache.root_node
        spilled = [n for n in chain if n.evicted]
        if spilled:
            ready = self._agreed_readiness(spilled, self._readiness(spilled, rid))
            if ready is None:  # a rank found an extent lost: every rank drops the spilled chain
                self._drop_lost(spilled, rid)
                return 0, anchor
            if ready is Readiness.LAYERWISE:  # the prefill starts; each layer waits for its group
                if not self.layerwise.restore(spilled, rid, anchor):
                    return 0, anchor
                if params.req is not None:
                    params.req.host_hit_is_storage = True
                return params.host_hit_length, params.best_match_node
            if ready in (Readiness.PENDING, Readiness.STREAMING):  # unpack what landed, never wait
                if rid is not None:
                    self.restoring.stream(spilled, rid, anchor, ready)
                return None  # the scheduler retries admission next round
            if ready is Readiness.FAILED:
                cache.spill_metrics.inc("restore_failures")
                if cache.controller is not None:
                    cache.controller.finish_reads([node.spill for node in spilled], owner_of(rid))
                return 0, anchor
            if not self.restoring.restore(spilled, rid, anchor):
                return 0, anchor
        if params.req is not None:
            params.req.host_hit_is_storage = True  # per-tier cached-token details: ours is the storage tier
        return params.host_hit_length, params.best_match_node

    def _agreed_readiness(self, nodes: list[TreeNode], ready: Readiness) -> Readiness | None:
        """The readiness every rank agrees on (the least ready); None: some rank's extent is LOST.
        A disagreement is counted only where another rank's verdict changed the outcome here (the
        restore goes on, recomputes, or drops the chain): a read landing a round later on one rank
        makes the others wait a round, which is timing, not a disagreement."""
        cache = self.cache
        lost = any(node.spill.extent.state is ExtentState.LOST for node in nodes)
        codes = {Readiness.READY: 5, Readiness.LAYERWISE: 4, Readiness.PENDING: 3, Readiness.STREAMING: 2}
        code = codes.get(ready, 0 if lost else 1)
        agreed = cache.agreement.min([code])[0]
        goes_on = codes[Readiness.STREAMING]  # every level from here up: the restore goes on
        cache.spill_metrics.inc("tp_disagreements", int(min(agreed, goes_on) != min(code, goes_on)))
        if agreed == 0 and cache.agreement.size > 1:
            return None
        return {v: k for k, v in codes.items()}.get(agreed, Readiness.FAILED)

    def _drop_lost(self, nodes: list[TreeNode], rid: str | None) -> None:
        """After an agreed loss: the first spilled node of the chain goes, with its subtree."""
        cache = self.cache
        cache.spill_metrics.inc("restore_failures")
        if cache.controller is not None:
            cache.controller.finish_reads([node.spill for node in nodes], owner_of(rid))
        if cache.tree.attached(nodes[0]):
            cache.tree.prune(nodes[0])

    def _not_ready(self, *_args: Any) -> Readiness:
        """A restore whose readiness could not be judged recomputes (its verdict is still agreed)."""
        return Readiness.FAILED

    def _readiness(self, nodes: list[TreeNode], rid: str | None) -> Readiness:
        """This rank's readiness of the restore of `nodes` (layer-wise where it may start so), after
        a hold at the request's first attempt (admission_hold.py)."""
        state = self._checked(nodes, rid)
        if rid is None:
            return state
        if self.hold.attempt(rid):
            state = self._held(nodes, rid, state)
        self.hold.tried(rid)
        return state

    def _checked(self, nodes: list[TreeNode], rid: str | None) -> Readiness:
        return self.layerwise.ready(nodes, self._restore_readiness(nodes, rid))

    def _unheld(self, nodes: list[TreeNode], rid: str, state: Readiness) -> Readiness:
        """A hold that failed (taking completions raised: the cache's poll would have skipped that
        one) leaves the verdict it started from: the request is deferred, or goes on, as without it."""
        return state

    @contained("init_load_back (hold)", _unheld)
    def _held(self, nodes: list[TreeNode], rid: str, state: Readiness) -> Readiness:
        policy = RestorePolicy.of(self.cache.spill_config)
        return self.hold.hold(
            state,
            self.hold.budget_s(policy.hold_share, policy.restore_wait_s),
            lambda: self._checked(nodes, rid),
            self._wait_io,
            layerwise=self.layerwise.table is not None,
        )

    def _wait_io(self, timeout_s: float) -> None:
        """Sleep up to `timeout_s` for a tier completion, then take what finished."""
        ctl = self.cache.controller
        if ctl is not None:
            ctl.tier.wait_posted(timeout_s)
            ctl.poll()

    @contained("init_load_back (readiness)", _not_ready)
    def _restore_readiness(self, nodes: list[TreeNode], rid: str | None) -> Readiness:
        """The reads this restore needs (starting any missing ones), within the prefetch policy's
        limit (`RestorePolicy.restore_wait_s`); past it the request recomputes. The wait counts
        from the oldest read or the request's first deferral, whichever is earlier, so reads
        restarted meanwhile (a TTL expiry, a split) never defer a request forever."""
        cache = self.cache
        if cache.controller is None:
            return Readiness.FAILED
        state, waited = cache.controller.readiness([node.spill for node in nodes], owner_of(rid))
        if state not in (Readiness.PENDING, Readiness.STREAMING):
            return state
        if rid is None and state is Readiness.STREAMING:  # no later attempt to stream it to
            return Readiness.FAILED
        if rid is not None:
            now = time.monotonic()
            waited = max(waited, now - self._deferred_since.setdefault(rid, now))
        if waited < RestorePolicy.of(cache.spill_config).restore_wait_s:
            return state
        cache.spill_metrics.inc("restores_too_late")
        return Readiness.FAILED

    def forget_old_deferrals(self) -> None:
        """Requests deferred long ago and never seen again (aborted) leave no state behind."""
        config = self.cache.spill_config
        cutoff = time.monotonic() - 2 * (config.io_timeout_s + config.prefetch_ttl_s)
        for rid in [r for r, t in self._deferred_since.items() if t < cutoff]:
            del self._deferred_since[rid]
        self.hold.forget_older_than(cutoff)
