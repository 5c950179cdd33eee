"""`SpillRadixCache`: sglang's radix cache whose evictions spill to the NVMe tier.

Three pieces, each with one owner (docs/DESIGN.md, "Controller, tree, cache"):
- the **tree** (`SpillTree`, tree.py) makes every change of spilled state and counts it;
- the **controller** (`SpillController`, controller.py) moves every byte: staging, stores, reads,
  restores in progress, lookups' I/O, and the ordering of each copy against sglang's forward;
- this **cache** translates sglang's calls into tree and controller calls; its parts take the
  decisions, one job each: spilling.py (evict → spill or drop, insert → adoption, write-through),
  matching.py (match, lookups attached, prefetch), admission.py (`init_load_back`: readiness under
  the prefetch policy, restore_policy.py, and TP agreement), restoring.py (a restore's slots, whole
  or streaming), layerwise_flow.py (layer-wise restores), lifecycle.py (reset, epochs, warm start),
  reporting.py, with clean_copies.py, retention.py and write_admission.py. When our logic raises in
  a call from sglang it answers with its fallback method instead (guard.py): sglang's plain radix
  cache behaviour on our tree, which never serves unverified KV.

Why sglang's `RadixCache` and not the default `UnifiedRadixCache`: in sglang 0.5.23 the unified cache
keeps its tree in a Rust core (nodes are opaque ids), so no Python subclass can keep a node spilled
or walk a cold subtree; `RadixCache` is the pure-Python tree that sglang's own FlexKV backend extends
the same way.

What sglang calls, and what happens:
- `evict`: victims as sglang picks them (eviction policy over unlocked device leaves); each is packed
  and written to the tier as one extent and stays in the tree as spilled, or is dropped.
- `match_prefix`: the device-resident part as usual; the spilled continuation as a host hit, which
  makes the scheduler call `init_load_back` when it admits the request.
- `init_load_back`: restores the spilled nodes on the path (all or nothing) into fresh slots; while
  their reads are in flight it answers "retry" (None) and unpacks verified chunks early.
- `insert`: sglang's; spilled nodes on the path adopt the request's slots; under write-through the
  resident path is then written.
- `reset`: an empty tree; at start the tier's extents are attached (warm restart), later a new epoch.
Spilled nodes count in neither evictable nor protected size: they hold no device memory.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    EvictResult,
    InitLoadBackParams,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from sgl_hicache.cache import reporting
from sgl_hicache.cache.admission import Admission, RestoreAdmission
from sgl_hicache.cache.build import SpillCacheBuild
from sgl_hicache.cache.clean_copies import CleanCopies
from sgl_hicache.cache.events import TierEvents
from sgl_hicache.cache.guard import contained, internal_error, last_resort, nothing
from sgl_hicache.cache.hint_source import ResumeHint, RetentionHint
from sgl_hicache.cache.layerwise import Layerwise
from sgl_hicache.cache.layerwise_flow import LayerwiseFlow
from sgl_hicache.cache.lifecycle import Lifecycle
from sgl_hicache.cache.matching import Matching, no_match
from sgl_hicache.cache.metrics import DropReason
from sgl_hicache.cache.restoring import Restoring, owner_of
from sgl_hicache.cache.retention import Retention
from sgl_hicache.cache.spill_state import SpillRef
from sgl_hicache.cache.spilling import Spilling
from sgl_hicache.cache.tree import SpillTree
from sgl_hicache.cache.warm_start import WarmStart
from sgl_hicache.cache.write_admission import WriteAdmission
from sgl_hicache.config import WritePolicy
from sgl_hicache.tier.keys import PathHasher, tenant_of

logger = logging.getLogger(__name__)


class SpillRadixCache(RadixCache):
    def __init__(self, build: SpillCacheBuild) -> None:
        config = build.config
        self.agreement = build.agreement
        self.spill_config = config
        self.spill_metrics = build.metrics
        self.controller = build.controller
        self.io_to_close = build.controller  # closed at shutdown, even after `disable_spill`
        self.namespace_id = build.namespace_id
        self.hints = build.hints
        self.errors_logged: set[str] = set()  # guard.py: names whose first internal error was logged
        self.epoch: bytes | None = None  # seeds every path key; None until the first reset (lifecycle.py)
        self.tree = SpillTree(self, config.kv_events_medium)
        self.warm = WarmStart(self.tree, build.namespace_id)
        self.retention = Retention(self)  # pin, drop, purge hints (retention.py)
        self.write_admission = WriteAdmission(config.admission, config.admission_min_tokens,
                                              self.retention.pin_of)  # what the tier is written  # fmt: skip
        self.clean = CleanCopies(self)  # write-through and clean-ahead (clean_copies.py)
        self.spilling = Spilling(self)  # evict -> spill or drop, insert -> adoption (spilling.py)
        self.matching = Matching(self)  # match, lookups attached, prefetch (matching.py)
        self.restoring = Restoring(self)  # a restore's slots, whole or streaming (restoring.py)
        self.layerwise_flow = LayerwiseFlow(self, self.restoring)  # (layerwise_flow.py)
        self.admission = RestoreAdmission(self, self.restoring, self.layerwise_flow)  # init_load_back
        self.lifecycle = Lifecycle(self, self.layerwise_flow)  # reset, epochs, warm start (lifecycle.py)
        super().__init__(build.params)  # calls reset(), which attaches the tier's extents (warm start)
        if self.controller is not None and self.agreement.size > 1:  # the table is read by agreed
            self.controller.restores.ttl_s = math.inf  # decisions (restores.py): never freed locally
        if config.layerwise_restore and self.controller is not None:
            self.layerwise_flow.start(self.controller)

    @property
    def spilled_tokens(self) -> int:
        return self.tree.spilled_tokens

    @property
    def layerwise(self) -> Layerwise | None:
        """The layer-wise restores in progress (layerwise.py); None with layer-wise restore off."""
        return self.layerwise_flow.table

    @property
    def kv_events(self) -> TierEvents:
        """sglang's KV event recorder (its constructor sets it), kept true for spilled nodes (events.py)."""
        return self._kv_events

    @kv_events.setter
    def kv_events(self, recorder: Any) -> None:
        self._kv_events = recorder if isinstance(recorder, TierEvents) else TierEvents(recorder)

    def set_forward_streams(self, streams: list[Any]) -> None:
        """sglang's forward streams, which every copy of ours is ordered against (device.py)."""
        if self.controller is not None:
            self.controller.engine.set_forward_streams(streams)

    def path_hasher(self, key: RadixKey) -> PathHasher:
        """A hasher of paths of `key`'s tenant in the current epoch, at the root."""
        return PathHasher(self.namespace_id, tenant_of(key.extra_key, key.cache_salt), self.epoch or b"")

    # ---- sglang's tree internals, routed to the tree ---------------------------------------

    def _split_node(self, key: RadixKey, child: TreeNode, split_len: int) -> TreeNode:
        self.clean.changed()
        head = self.tree.split(key, child, split_len)
        self.write_admission.split(head, child)
        return head

    def _update_leaf_status(self, node: TreeNode) -> None:
        """sglang's, but a node taken out of the tree (`SpillTree.detach`: a failed layer-wise
        restore's) is never an evictable leaf: its KV is not its tokens', and it is freed whole once
        no request holds it (`drop_failed_layerwise`)."""
        if getattr(node, "detached", False):
            self.evictable_leaves.discard(node)
            return
        super()._update_leaf_status(node)

    def _match_prefix_helper(self, node: TreeNode, key: RadixKey) -> tuple[list[torch.Tensor], TreeNode]:
        return self.tree.match_resident(node, key)

    def all_values_flatten(self) -> torch.Tensor:
        return self.tree.resident_values()

    def evictable_size(self) -> int:
        """sglang's evictable tokens plus the slots of restores in progress, which `evict` frees first."""
        held = self.controller.restores.held_tokens if self.controller is not None else 0
        return self.evictable_size_ + held

    def _insert_helper(self, node: TreeNode, key: RadixKey, value: Any, priority: int = 0,
                       inserted_len: int = 0) -> tuple[int, TreeNode]:  # fmt: skip
        """sglang's insert, after the spilled nodes on `key`'s path adopted the request's slots
        (their restore was not used: the request recomputed them)."""
        chain = self.spilling.adopt(node, key, value)
        prefix_len, last = RadixCache._insert_helper(self, node, key, value, priority, inserted_len)
        # Adopted tokens are the tail of the matched prefix and now own the request's slots:
        # they must not be reported as duplicates (the caller frees duplicates' slots).
        return prefix_len - sum(len(n.key) for n in chain), last

    # ---- fallbacks (guard.py): sglang's plain radix cache on our tree ------------------------

    def _nothing_matched(self, _params: MatchPrefixParams) -> MatchResult:
        return no_match(self.root_node)

    @last_resort(_nothing_matched)
    def _match_resident_only(self, params: MatchPrefixParams) -> MatchResult:
        """The device-resident prefix only (sglang's match stops at spilled nodes on our tree)."""
        return RadixCache.match_prefix(self, params)

    def _nothing_evicted(self, _params: EvictParams) -> EvictResult:
        return EvictResult()

    @last_resort(_nothing_evicted)
    def _evict_by_dropping(self, params: EvictParams) -> EvictResult:
        """sglang's eviction: LRU leaves dropped, none spilled (a dropped node takes its subtree)."""
        if self.disable:
            return EvictResult()
        evicted = 0
        for node in self.spilling.victims(params.num_tokens):
            evicted += self.spilling.drop_node(node, DropReason.INTERNAL_ERROR)
        return EvictResult(num_tokens_evicted=evicted)

    def _nothing_restored(self, params: InitLoadBackParams) -> tuple[int, Any] | None:
        anchor = getattr(params.req, "last_node", None)
        return 0, anchor if anchor is not None else self.root_node

    @last_resort(_nothing_restored)
    def _no_restore(self, params: InitLoadBackParams) -> tuple[int, Any] | None:
        """Nothing restored: the request recomputes its spilled part; its restore is freed."""
        try:  # the failed method may have failed right here: that must not fail its fallback too
            if self.controller is not None:
                self.controller.restores.drop(owner_of(getattr(params.req, "rid", None)))
        except Exception:
            internal_error(self, "init_load_back (freeing a restore)")
        return self._nothing_restored(params)

    def _nothing_kept(self) -> None:
        self.lifecycle.keep_nothing()

    @last_resort(_nothing_kept)
    def _empty_reset(self) -> None:
        self.lifecycle.empty_reset()

    # ---- what sglang calls -------------------------------------------------------------------

    @contained("evict", _evict_by_dropping)
    def evict(self, params: EvictParams) -> EvictResult:
        if self.disable:
            return EvictResult()
        self._poll()
        return EvictResult(num_tokens_evicted=self.spilling.evict(params.num_tokens))

    @contained("match_prefix", _match_resident_only)
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        self._poll()
        return self.matching.match(params.key)

    @contained("init_load_back", _no_restore)
    def init_load_back(self, params: InitLoadBackParams) -> tuple[int, Any] | None:
        self._poll()
        return self.admission.load_back(params)

    def insert(self, params: InsertParams) -> InsertResult:
        """sglang's insert (both of its callers, a checkpoint and a finished request's release, go
        through it); under the WRITE_THROUGH policy the resident nodes on the inserted path that have
        no copy on the tier are then written (`Spilling.write_through`). `value` None is sglang's
        debug insert of token ids as slots: nothing to write."""
        self.clean.changed()
        result = super().insert(params)
        if self.spill_config.write_policy is WritePolicy.WRITE_THROUGH and params.value is not None:
            self.spilling.write_through(result.last_device_node)
        return result

    @contained("reset", _empty_reset)
    def reset(self) -> None:
        """sglang's reset: an empty tree; at start the tier's extents attached to it (warm restart),
        any later reset a flush into a new key epoch (lifecycle.py)."""
        super().reset()
        self.lifecycle.after_reset()

    # ---- what our hooks call (server/hooks.py) -----------------------------------------------

    def prefetch(self, token_ids: Any, extra_key: str | None = None, cache_salt: str | None = None,
                 rid: str | None = None, hinted: bool = False) -> int:  # fmt: skip
        """Start reading the spilled continuation of this prompt's cached prefix (never blocks on
        I/O); its restore will find the reads under way or done. Where the tree ends before the
        prompt does, on a root other servers use, also start a lookup of their extents (lookups.py,
        `Matching._start_lookup`). `hinted`: a client's resume hint (not a request's arrival), whose
        path the tier is written from now on (write_admission.py). Returns the tokens on their way."""
        if self.disable:
            return 0
        self._poll()
        return self.matching.prefetch(token_ids, extra_key, cache_salt, rid, hinted)

    def lookup_waiting(self, rid: str | None) -> bool:
        """Whether request `rid`'s admission should wait for its running cross-server lookup
        (`RestoreAdmission.lookup_waiting`). Never blocks."""
        return self.admission.lookup_waiting(rid)

    def take_hints(self) -> list[ResumeHint | RetentionHint]:
        """The checked client hints waiting in the inbox, answered "accepted" or refused (a pin over
        the pin budget: `Retention.take`), a bounded number per call; scheduler thread; never
        blocks. Only the scheduler of TP rank 0 has an inbox: the hints ride sglang's request
        broadcast to every rank (`server/hooks.py`), and each rank then `prefetch`es (or applies:
        `Retention.apply`) them in the same iteration, as it does for an arriving request."""
        taken: list[ResumeHint | RetentionHint] = []
        if self.hints is not None:
            self.hints.drain(functools.partial(self.retention.take, taken))
        return taken

    def begin_admission(self, rid: str | None) -> Admission:
        """Start watching one admission attempt of request `rid` (the admission hook's)."""
        return self.admission.begin(rid)

    def end_admission(self, attempt: Admission) -> bool:
        """Whether `init_load_back` deferred the request during `attempt` (its reads are in flight)."""
        return self.admission.end(attempt)

    def new_round(self) -> None:
        """sglang starts a scheduling round (the scheduler's hook): admission holds' budget is whole."""
        self.admission.hold.new_round()

    def after_forward(self, reqs: list[Any]) -> list[Any]:
        """After a forward (the scheduler's hook): every layer-wise restore in progress ends (blocks
        for its last reads); those that failed on any TP rank fail on all (agreed, in admission
        order); returns the requests of `reqs` whose prefix holds a failed restore's nodes: they read
        KV that is not what the tree says, so the caller retracts them (they recompute) and then
        calls `drop_failed_layerwise`. Never raises: an error of ours fails every restore of the
        forward."""
        return self.layerwise_flow.after_forward(reqs)

    def drop_failed_layerwise(self) -> None:
        """Free the nodes of failed layer-wise restores (their slots hold KV of some layers only),
        taken out of the tree by `after_forward`, once no request holds them: after `after_forward`'s
        requests were retracted. A chain still held waits (out of the tree meanwhile) for the next
        call."""
        self.layerwise_flow.drop_failed()

    def start_epoch(self) -> None:
        """A new random seed of every path key (a weight update): nothing named before is found
        after, and nothing named after is attached by a restart. Keeps the tree."""
        self.lifecycle.start_epoch()

    def poll(self) -> None:
        """Take finished I/O and copies (sglang's idle loop calls this through a hook). Never blocks."""
        self._poll()

    @contained("idle (clean ahead)", nothing)
    def clean_ahead(self) -> None:
        """While no request runs or waits (the idle hook): give the next victims of eviction a
        clean copy on the tier, so evicting them later copies nothing (clean_copies.py)."""
        self.clean.clean_ahead()

    def report(self, idle: bool) -> dict[str, Any]:
        """Counters, staging, tier stats and an integrity verdict (for `GET /server_info`: reporting.py)."""
        return reporting.report(self, idle)

    # ---- what our parts call -----------------------------------------------------------------

    def store_node(self, node: TreeNode, background: bool = False) -> SpillRef | DropReason:
        """`Spilling.store_node` (clean_copies.py writes through it)."""
        return self.spilling.store_node(node, background)

    def too_short(self, node: TreeNode, pin: object) -> bool:
        """`Spilling.too_short` (clean_copies.py never writes ahead what eviction would drop)."""
        return self.spilling.too_short(node, pin)

    @contained("poll", nothing)
    def _poll(self) -> None:
        """Take finished I/O and copies (never changes the tree; lookups attach in
        `Matching.attach_lookups`). With spill disabled, the writes in flight still end (ON_TIER or
        LOST, their staging back), so that the removals owed after them run (`Retention.poll`)."""
        if self.controller is None and self.io_to_close is not None:
            self.io_to_close.poll()
            self.retention.poll()
        if self.controller is not None:
            self.controller.poll()
            self.layerwise_flow.advance()
            self.retention.poll()
            self.tree.events.gone.collect(self.controller.tier)
            self.admission.forget_old_deferrals()
            self.spill_metrics.set_tier_stats(self.controller.tier.stats())
            staging = self.controller.staging
            self.spill_metrics.set_staging(
                staging.used_bytes, staging.peak_bytes, staging.capacity_bytes, staging.refused
            )
            self.spill_metrics.set_staging_held(self.controller.staging_held())

    # ---- state and accounting ----------------------------------------------------------------

    def disable_spill(self) -> None:
        """Spill off for good (guard.py: a fallback failed, so our state is not trusted any more):
        without a controller nothing spills, restores, prefetches or looks up, and the cache serves
        as sglang's plain radix cache. Restores in progress free their slots
        (else sglang's idle memory check finds slots nobody owns). Spilled nodes left in the tree are
        never restored (a request matching them recomputes that part; an insert over them adopts
        them), but the tree decisions go on as on every rank: walks that split nodes, evictions'
        agreements. Writes in flight still end (`_poll`): their staging goes back, and a drop or
        purge still removes what they wrote. Logged once."""
        ctl = self.controller
        if ctl is None:
            return
        self.controller = None  # its writes still end (`_poll`); closed at shutdown (`io_to_close`)
        logger.error("sgl_hicache: spill disabled after an internal error in a fallback; serving as "
                     "sglang's plain radix cache from now on")  # fmt: skip
        try:  # restores in progress own slots that nothing would count or free from now on
            ctl.restores.clear()
        except Exception:  # the slots stay lost (never handed out unwaited): counted and logged
            internal_error(self, "disable_spill (freeing restores in progress)")
        if self.layerwise is not None and self.layerwise.active:  # their requests are retracted
            self.layerwise_flow.fail_all()

    def check_integrity(self, held_tokens: int = 0, with_tier: bool = True) -> None:
        """Tree, pool, staging and (`with_tier`) tier accounting agree; AssertionError with the
        numbers if not. Call when idle (`held_tokens`: slots running requests hold); waits for the
        tier's removals of retention hints (a file being unlinked is neither indexed nor gone)."""
        self._poll()
        if with_tier:
            self.retention.wait_jobs()
        restoring = self.controller.restores.held_slots() if self.controller is not None else []
        self.tree.check_integrity(restoring, held_tokens, self.layerwise_flow.detached_nodes())
        if self.controller is not None:
            self.controller.check_integrity(with_tier)
