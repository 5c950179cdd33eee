"""`SpillRadixCache`: the radix cache whose evictions spill to the NVMe tier (I/O and policy; the
tree mechanics of spilled nodes are `SpilledTree`'s, in spilled_tree.py).

Why sglang's `RadixCache` and not the default `UnifiedRadixCache`: in sglang 0.5.23 the unified cache keeps
its tree in a Rust core (nodes are opaque ids), so no Python subclass can keep a node *spilled* or
walk a cold subtree; `RadixCache` is the pure-Python tree that sglang's own FlexKV backend extends
the same way. See docs/DESIGN.md.

What changes, and where sglang calls it:
- `evict` (the allocator's `evict_for_alloc` forwards here): victims are chosen exactly as sglang
  does (eviction policy over unlocked device leaves), but each victim's KV is packed into staging and
  written to the tier as one extent; the node stays in the tree as *spilled* (`node.value is None`,
  `node.spill` set) and its slots are freed. Victims that cannot be spilled are dropped as before.
- `match_prefix`: the device-resident part is reported as usual; the spilled continuation is
  reported as a host hit (`host_hit_length`, `best_match_node`), which makes the scheduler call
  `init_load_back` when it admits the request.
- `init_load_back`: allocates slots, restores the spilled nodes on the path (all or nothing) and
  turns them back into device-resident nodes, so prefill sees them as cached prefix. While the
  reads are in flight it answers "retry" and unpacks the verified chunks early (restore.py).
- `prefetch` / `take_hints`: start the reads of a prompt's spilled prefix ahead of its restore.
Everything else (locking, accounting of evictable/protected sizes, scheduling) is sglang's, with
spilled nodes counted in neither: they hold no device memory.
"""

from __future__ import annotations

import heapq
import logging
import os
import time
from array import array
from typing import Any

import numpy as np
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
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from sgl_hicache.cache import fallbacks
from sgl_hicache.cache.agreement import Agreement, SingleRank
from sgl_hicache.cache.cross_attach import CrossServerLookups
from sgl_hicache.cache.guard import contained, nothing
from sgl_hicache.cache.hint_source import HintSource, ResumeHint
from sgl_hicache.cache.metrics import SpillMetrics
from sgl_hicache.cache.partial_restore import PartialRestores, RestoreProgress
from sgl_hicache.cache.reads import Readiness
from sgl_hicache.cache.spill_io import SpillIO
from sgl_hicache.cache.spill_state import Extent, ExtentState, SpillRef
from sgl_hicache.cache.spilled_tree import SpilledTree
from sgl_hicache.config import PrefetchPolicy, SpillConfig, WritePolicy
from sgl_hicache.tier import ExtentInfo, ExtentKey, NamespaceId, chain_key
from sgl_hicache.tier.keys import PathHasher, tenant_of
from sgl_hicache.tier.lookup import alias_marks

logger = logging.getLogger(__name__)


class SpillRadixCache(SpilledTree):
    def __init__(self, params: CacheInitParams, config: SpillConfig, metrics: SpillMetrics,
                 io: SpillIO | None, namespace_id: NamespaceId, hints: HintSource | None = None,
                 agreement: Agreement | None = None) -> None:  # fmt: skip
        self.agreement = agreement or SingleRank()
        self.spill_config = config
        self.spill_metrics = metrics
        self.spill_io = io
        self.namespace_id = namespace_id
        self.hints = hints
        self.errors_logged: set[str] = set()  # guard.py: names whose first internal error was logged
        self.tier_orphans: dict[ExtentKey, list[ExtentInfo]] = {}  # see warm_start.py
        self.deferred_rid: str | None = None  # the request the last init_load_back deferred
        self._deferred_since: dict[str, float] = {}  # rid -> when its admission was first deferred
        self.partial_restores = PartialRestores(params.token_to_kv_pool_allocator, config.prefetch_ttl_s)
        self.spilled_tokens = 0
        self.cross_lookups = CrossServerLookups()  # other servers' extents, found by path key
        self.epoch: bytes | None = None  # seeds every path key; None until the first reset()
        super().__init__(params)  # calls reset(), which attaches the tier's extents (warm start)

    @property
    def prune_lost_on_walk(self) -> bool:  # type: ignore[override]
        """Only a single rank may act on a locally LOST extent while walking (agreement.py)."""
        return self.agreement.size == 1

    # ---- eviction → spill -------------------------------------------------------------------

    @contained("evict", fallbacks.evict_by_dropping)
    def evict(self, params: EvictParams) -> EvictResult:
        if self.disable:
            return EvictResult()
        self._poll()
        start = time.perf_counter()
        freed = self.partial_restores.evict(params.num_tokens)  # the cheapest to give up: see restore.py
        heap = [(self.eviction_strategy.get_priority(n), n) for n in self.evictable_leaves]
        heapq.heapify(heap)
        evicted = 0
        victims: list[tuple[TreeNode, bool]] = []
        while freed + evicted < params.num_tokens and heap:
            _, node = heapq.heappop(heap)
            evicted += len(node.value)
            parent = node.parent
            spilled = self._spill_node(node)
            if not spilled:
                self._drop_node(node)
            victims.append((node, spilled))
            self.kv_events.record_remove(node)
            if parent in self.evictable_leaves:  # the same whether the victim spilled or dropped
                heapq.heappush(heap, (self.eviction_strategy.get_priority(parent), parent))
        self._agree_on_spills(victims)
        self.update_eviction_metrics(evicted, start)
        self.spill_metrics.inc("evicted_tokens", evicted)
        return EvictResult(num_tokens_evicted=freed + evicted)

    def _agree_on_spills(self, victims: list[tuple[TreeNode, bool]]) -> None:
        """A victim stays spilled only if every rank spilled it; elsewhere it is dropped after all.
        Parents come after their children in `victims`: undo from the end, so a dropped parent takes
        its subtree and its already detached descendants are skipped."""
        if self.agreement.size == 1 or not victims:
            return
        agreed = self.agreement.min([int(spilled) for _, spilled in victims])
        for (node, spilled), ok in reversed(list(zip(victims, agreed, strict=True))):
            if spilled and not ok and self._attached(node):
                self._prune_spilled(node)
                self.spill_metrics.inc("tp_disagreements")

    def evictable_size(self) -> int:
        """sglang's evictable tokens plus the slots of partial restores, which `evict` frees first."""
        return self.evictable_size_ + self.partial_restores.held_tokens

    @contained("evict (a node's spill)", fallbacks.spilled_if_marked)
    def _spill_node(self, node: TreeNode) -> bool:
        n = len(node.value)
        if self._stored_clean(node):  # the exact range it was restored from or written through
            self._mark_spilled(node, node.spill)
            return True
        # Short nodes are not worth an extent, unless dropping them would orphan spilled children.
        if n < self.spill_config.min_spill_tokens and not node.children:
            return False
        ref = self._store(node)
        if ref is None:
            return False
        self._mark_spilled(node, ref)
        self.spill_metrics.inc("spilled_tokens", n)
        return True

    def _store(self, node: TreeNode, background: bool = False) -> SpillRef | None:
        """Write resident `node`'s KV to the tier as one extent (never blocks on I/O: `SpillIO.store`;
        `background`: a write-through, within its share of staging); its reference, or None when it
        cannot be written now (no tier, staging full, an id no key names)."""
        if self.spill_io is None:
            return None
        tokens = np.asarray(node.key.raw_token_ids(), dtype=np.int64)
        try:
            hasher, start = self._path_to(node)
            parent_key = hasher.key()
            key = chain_key(self.namespace_id, parent_key, tokens)
            aliases = alias_marks(hasher, start, tokens, self.page_size)  # found by path key: cross_attach.py
        except ValueError:  # an id outside 0..2**32-1 on its path (keys hash u32 ids): never spilled
            return None
        default_tenant = tenant_of(node.key.extra_key, node.key.cache_salt) == b""  # others: no ids on disk
        extent = self.spill_io.store(key, parent_key, tokens, node.value, default_tenant, aliases, background)
        return None if extent is None else SpillRef(extent, 0, len(node.value))

    def _stored_clean(self, node: TreeNode) -> bool:
        """Whether resident `node` has an exact copy on the tier (or in staging, on its way)."""
        ref: SpillRef | None = getattr(node, "spill", None)
        return ref is not None and ref.count == len(node.value) and self._still_stored(ref.extent)

    def _still_stored(self, extent: Extent) -> bool:
        if self.spill_io is None:
            return False
        if extent.state is ExtentState.WRITING:
            return extent.staged is not None
        return extent.state is ExtentState.ON_TIER and self.spill_io.tier.contains(extent.key)

    def _drop_node(self, node: TreeNode) -> None:
        """Detach first, free last: a failure midway leaves the node in the tree with its slots (a
        fallback may drop it again) or out of it, never in it with its slots freed (freed twice)."""
        value = node.value
        self._forget_spilled(node)
        self._delete_leaf(node)
        self.token_to_kv_pool_allocator.free_segment(value, start_pos=0)
        self.spill_metrics.inc("dropped_tokens", len(value))

    def _node_keys(self, node: TreeNode) -> tuple[ExtentKey, ExtentKey]:
        """(path key of the tokens before `node`, extent key of `node`'s own tokens after them)."""
        parent = self._path_to(node)[0].key()
        return parent, chain_key(self.namespace_id, parent, node.key.raw_token_ids())

    def _path_to(self, node: TreeNode) -> tuple[PathHasher, int]:
        """(a hasher fed the tokens before `node`, how many tokens that is)."""
        path = []
        walk = node.parent
        while walk is not self.root_node:
            path.append(walk.key.raw_token_ids())
            walk = walk.parent
        hasher = self.path_hasher(node.key)
        for tokens in reversed(path):
            hasher.update(tokens)
        return hasher, sum(len(t) for t in path)

    def path_hasher(self, key: RadixKey) -> PathHasher:
        """A hasher of paths of `key`'s tenant in the current epoch, at the root."""
        return PathHasher(self.namespace_id, tenant_of(key.extra_key, key.cache_salt), self.epoch or b"")

    # ---- insert → write-through --------------------------------------------------------------

    def insert(self, params: InsertParams) -> InsertResult:
        """sglang's insert (both of its callers, a checkpoint and a finished request's release, go
        through it); under the WRITE_THROUGH policy the resident nodes on the inserted path that have
        no copy on the tier are then written (`_write_through`). `value` None is sglang's debug
        insert of token ids as slots: nothing to write."""
        result = super().insert(params)
        if self.spill_config.write_policy is WritePolicy.WRITE_THROUGH and params.value is not None:
            self._write_through(result.last_device_node)
        return result

    @contained("insert (write-through)", nothing)
    def _write_through(self, node: TreeNode) -> None:
        """Write the resident nodes from the root to `node` that have no copy on the tier, top down,
        and keep them resident with a clean reference (a later eviction then writes nothing). Stops
        at the first that cannot be written (write-through's share of staging full: the rest is
        kept for evictions and restores): its descendants' extents would follow a gap no warm start
        or lookup can cross. The tree's structure is untouched, so TP ranks whose
        writes differ still hold identical trees (an eviction agrees on each spill as before)."""
        if self.disable or self.spill_io is None:
            return
        todo = []
        while node is not self.root_node and not node.evicted:
            if not self._stored_clean(node):
                todo.append(node)
            node = node.parent
        for node in reversed(todo):
            ref = self._store(node, background=True)
            if ref is None:
                return
            node.spill = ref
            self.spill_metrics.inc("written_through_tokens", ref.count)

    # ---- match: device prefix + spilled continuation ---------------------------------------

    @contained("match_prefix", fallbacks.resident_match)
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        self._poll()
        self.spill_metrics.inc("match_requests")
        key, _ = params.key.maybe_to_bigram_view(self.is_eagle)
        if self.disable or len(key) == 0:
            return self._no_match()
        key = key.page_aligned(self.page_size)
        if len(key) == 0:
            return self._no_match()
        last_device, device_len, last_spilled, host_len = self._walk(key)
        return MatchResult(device_prefix_len=device_len, last_device_node=last_device, last_host_node=last_spilled,
                           best_match_node=last_spilled, host_hit_length=host_len)  # fmt: skip

    def _no_match(self) -> MatchResult:
        root = self.root_node
        return MatchResult(
            device_prefix_len=0, last_device_node=root, last_host_node=root, best_match_node=root
        )

    def _walk(self, key: RadixKey) -> tuple[TreeNode, int, TreeNode, int]:
        """(deepest device node, device tokens, deepest spilled node, spilled tokens) on `key`'s
        path, attaching orphan tier extents (warm restart of salted tenants) where the path ends."""
        values, last_device = self._match_prefix_helper(self.root_node, key)
        device_len = sum(len(v) for v in values)
        last_spilled, host_len = self._match_spilled(last_device, key[device_len:])
        end = device_len + host_len
        lazy_attach = self.tier_orphans and self.agreement.size == 1  # TP > 1: a local outcome, not agreed
        if end < len(key) and lazy_attach and _attached_on_match(self, last_spilled, key, end):
            last_spilled, more = self._match_spilled(last_spilled, key[end:])
            host_len += more
        return last_device, device_len, last_spilled, host_len

    @contained("insert (adopting spilled nodes)", fallbacks.spilled_path_dropped)
    def _spilled_on_path(self, node: TreeNode, key: RadixKey) -> tuple[int, list[TreeNode]]:
        return super()._spilled_on_path(node, key)

    # ---- prefetch at arrival ----------------------------------------------------------------

    def prefetch(self, token_ids: Any, extra_key: str | None = None, cache_salt: str | None = None,
                 rid: str | None = None) -> int:  # fmt: skip
        """Start reading the spilled continuation of this prompt's cached prefix (never blocks on
        I/O); its restore will find the reads under way or done. Where the tree ends before the
        prompt does, also start a lookup of other servers' extents (cross_attach.py). Returns the
        tokens on their way."""
        if self.disable or self.spill_io is None:
            return 0
        self._poll()
        key = RadixKey(array("q", token_ids), extra_key, cache_salt=cache_salt).page_aligned(self.page_size)
        last, device_len, end, matched = self._walk(key)  # the same on every TP rank (splits too)
        self._start_lookup(key, device_len + matched, rid)
        if not matched:
            return 0
        self.spill_metrics.inc("prefetch_requests")
        return self._start_reads([node.spill for node in self._path_up(end, last) or []])

    # The I/O steps of a prefetch fail alone (a rank's own outcome): the walk above, which may split
    # nodes, has run on every rank, so TP ranks keep identical trees whatever these do.
    @contained("prefetch (lookup)", nothing)
    def _start_lookup(self, key: RadixKey, covered: int, rid: str | None) -> None:
        self.cross_lookups.start(self, key, covered, rid)

    @contained("prefetch (reads)", fallbacks.no_reads)
    def _start_reads(self, refs: list[SpillRef]) -> int:
        return self.spill_io.reads.prefetch(refs) if self.spill_io is not None else 0

    def lookup_waiting(self, rid: str | None) -> bool:
        """Whether request `rid`'s admission should wait for its cross-server lookup (never blocks)."""
        return self.cross_lookups.waiting(self, rid)

    def take_hints(self) -> list[ResumeHint]:
        """The checked client resume hints waiting in the inbox, answered "accepted" (a bounded number
        per call; scheduler thread; never blocks). Only the scheduler of TP rank 0 has an inbox:
        the hints ride sglang's request broadcast to every rank (`server/hooks.py`), and each rank
        then `prefetch`es them in the same iteration, as it does for an arriving request."""
        taken: list[ResumeHint] = []
        if self.hints is not None:
            self.hints.drain(
                lambda ids, extra_key, salt: taken.append(ResumeHint(list(ids), extra_key, salt))
            )
        return taken

    # ---- restore ----------------------------------------------------------------------------

    @contained("init_load_back", fallbacks.no_restore)
    def init_load_back(self, params: InitLoadBackParams) -> tuple[int, Any] | None:
        self._poll()
        rid = getattr(params.req, "rid", None)
        answer = self._load_back(params, rid)
        self.deferred_rid = rid if answer is None else None  # read by hooks.skip_deferred_admission
        if answer is not None:  # admitted: a partial restore not consumed now never will be
            self.partial_restores.drop(rid)
            if rid is not None:
                self._deferred_since.pop(rid, None)
        return answer

    def take_deferral(self, rid: str | None) -> bool:
        """Whether the last `init_load_back` deferred request `rid` (consumed: answers once)."""
        deferred = rid is not None and self.deferred_rid == rid
        self.deferred_rid = None
        return deferred

    def _load_back(self, params: InitLoadBackParams, rid: str | None) -> tuple[int, Any] | None:
        anchor = params.req.last_node if params.req is not None else None
        chain = self._path_up(params.best_match_node, anchor)
        if chain is None or sum(len(n.key) for n in chain) != params.host_hit_length:
            return 0, anchor if anchor is not None else self.root_node
        spilled = [n for n in chain if n.evicted]
        if spilled:
            ready = self._agreed_readiness(spilled, self._restore_readiness(spilled, rid))
            if ready is None:  # a rank found an extent lost: every rank drops the spilled chain
                self._drop_lost(spilled)
                return 0, anchor
            if ready is Readiness.PENDING:  # unpack what landed meanwhile (restore.py), never wait
                single = self.agreement.size == 1  # early unpack takes slots at a local moment
                if single and rid is not None and self.spill_io is not None:
                    refs = tuple(node.spill for node in spilled)
                    self.partial_restores.advance(rid, refs, self.spill_io, self._alloc_slots)
                return None  # the scheduler retries admission next round; its loop never waits on I/O
            if ready is Readiness.FAILED:
                self.spill_metrics.inc("restore_failures")
                if self.spill_io is not None:
                    self.spill_io.reads.finish([node.spill for node in spilled])
                return 0, anchor
            if not self._restore(spilled, rid):
                return 0, anchor
        if params.req is not None:
            params.req.host_hit_is_storage = True  # per-tier cached-token details: ours is the storage tier
        return params.host_hit_length, params.best_match_node

    def _agreed_readiness(self, nodes: list[TreeNode], ready: Readiness) -> Readiness | None:
        """The readiness every rank agrees on (the least ready); None: some rank's extent is LOST."""
        lost = any(node.spill.extent.state is ExtentState.LOST for node in nodes)
        code = {Readiness.READY: 3, Readiness.PENDING: 2}.get(ready, 0 if lost else 1)
        agreed = self.agreement.min([code])[0]
        self.spill_metrics.inc("tp_disagreements", int(agreed != code))
        if agreed == 0 and self.agreement.size > 1:
            return None
        return {3: Readiness.READY, 2: Readiness.PENDING}.get(agreed, Readiness.FAILED)

    def _drop_lost(self, nodes: list[TreeNode]) -> None:
        """After an agreed loss: the first spilled node of the chain goes, with its subtree."""
        self.spill_metrics.inc("restore_failures")
        if self.spill_io is not None:
            self.spill_io.reads.finish([node.spill for node in nodes])
        if self._attached(nodes[0]):
            self._prune_spilled(nodes[0])

    @contained("init_load_back (readiness)", fallbacks.not_ready)
    def _restore_readiness(self, nodes: list[TreeNode], rid: str | None) -> Readiness:
        """Apply the prefetch policy to the reads this restore needs (starting any missing ones):
        WAIT defers admission until they land (up to the I/O timeout), TIMEOUT up to
        `prefetch_timeout_s`, BEST_EFFORT not at all; past the limit the request recomputes. The
        wait counts from the oldest read or the request's first deferral, whichever is earlier, so
        reads restarted meanwhile (a TTL expiry, a split) never defer a request forever."""
        if self.spill_io is None:
            return Readiness.FAILED
        refs = [node.spill for node in nodes]
        state, waited = self.spill_io.reads.readiness(refs)
        if state is not Readiness.PENDING:
            return state
        if rid is not None:
            now = time.monotonic()
            waited = max(waited, now - self._deferred_since.setdefault(rid, now))
        policy = self.spill_config.prefetch_policy
        limit = {PrefetchPolicy.WAIT: self.spill_io.timeout_s, PrefetchPolicy.TIMEOUT: self.spill_config.prefetch_timeout_s,
                 PrefetchPolicy.BEST_EFFORT: 0.0}[policy]  # fmt: skip
        if waited < limit:
            return Readiness.PENDING
        self.spill_metrics.inc("restores_too_late")
        return Readiness.FAILED

    def _restore(self, nodes: list[TreeNode], rid: str | None) -> bool:
        refs = tuple(node.spill for node in nodes)
        progress = self.partial_restores.take(rid, refs)
        self.partial_restores.stats.finished += progress is not None
        if progress is None:
            slots = self._alloc_slots(sum(ref.count for ref in refs))
            if slots is not None and self.spill_io is not None:
                progress = RestoreProgress(refs, slots)
            elif slots is not None:
                self.token_to_kv_pool_allocator.free(slots)
        t0 = time.perf_counter()
        ok = progress is not None and self._restore_io(progress)
        if not self.agreement.all_ok(ok):  # every rank verified its bytes, or all recompute
            if progress is None:
                self.spill_metrics.inc("restore_failures")
                if self.spill_io is not None:  # release their staging now, not after the TTL
                    self.spill_io.reads.finish(refs)
            else:
                self.token_to_kv_pool_allocator.free(progress.slots)
            self.spill_metrics.inc("tp_disagreements", int(ok))
            return False
        assert progress is not None  # agreed ok implies this rank's ok
        try:
            self.spill_metrics.observe_restore(time.perf_counter() - t0)
            for node, (_, node_slots) in zip(nodes, progress.parts(), strict=True):
                self._mark_resident(node, node_slots.clone())
        except Exception:
            self._free_unowned(nodes, progress)
            raise
        return True

    def _free_unowned(self, nodes: list[TreeNode], progress: RestoreProgress) -> None:
        """After a verified restore failed while marking `nodes` resident: the slots of the nodes
        still spilled are freed. Those already marked keep theirs: their KV is verified and complete,
        and a resident prefix of the chain is a valid tree (the rest stays spilled, restorable)."""
        start = 0
        for node, ref in zip(nodes, progress.refs, strict=True):
            if node.evicted:
                self.token_to_kv_pool_allocator.free(progress.slots[start : start + ref.count])
            start += ref.count

    @contained("init_load_back (restore)", fallbacks.not_restored)
    def _restore_io(self, progress: RestoreProgress) -> bool:
        return self.spill_io is not None and self.spill_io.restore(progress)

    def _forget_old_deferrals(self) -> None:
        """Requests deferred long ago and never seen again (aborted) leave no state behind."""
        cutoff = time.monotonic() - 2 * (self.spill_config.io_timeout_s + self.spill_config.prefetch_ttl_s)
        for rid in [r for r, t in self._deferred_since.items() if t < cutoff]:
            del self._deferred_since[rid]

    def _alloc_slots(self, n: int) -> torch.Tensor | None:
        allocator = self.token_to_kv_pool_allocator
        if allocator.available_size() < n:
            self.evict(EvictParams(num_tokens=n - allocator.available_size()))
        return allocator.alloc(n) if allocator.available_size() >= n else None

    # ---- accounting -------------------------------------------------------------------------

    @contained("reset", fallbacks.empty_reset)
    def reset(self) -> None:
        """sglang's reset: an empty tree. At start, the tier's published extents are attached to it
        as spilled nodes (warm restart). Any later reset is a flush (`/flush_cache`, a weight update
        with flush_cache): it starts a new epoch, a random seed of every path key, so no extent named
        before it can ever be found again (those age out of the tier by LRU), and none named after it
        is attached by a restart (the weights in memory may no longer be the ones on disk)."""
        super().reset()
        self.partial_restores.clear()
        self.cross_lookups.clear()
        self.spilled_tokens = 0
        self.tier_orphans = {}
        if self.spill_io is not None:
            self.spill_io.reads.clear()
        if self.epoch is None:
            self.epoch = b""
            self._attach_tier_extents()
            self._agree_on_warm_start()  # reached whatever the attach did: ranks pair collectives
            return
        self.start_epoch()
        self.spill_metrics.inc("flushes")
        logger.info("sgl_hicache: cache flushed; spilled KV from before the flush will not be served")

    @contained("reset (warm start)", fallbacks.attached_nothing)
    def _attach_tier_extents(self) -> None:
        from sgl_hicache.cache.warm_start import attach_tier_extents

        attach_tier_extents(self)

    def start_epoch(self) -> None:
        """A new random seed of every path key (a flush, a weight update): nothing named before is
        found after, and nothing named after is attached by a restart. Keeps the tree."""
        self.epoch = os.urandom(16)
        self.tier_orphans = {}

    def _agree_on_warm_start(self) -> None:
        """With TP > 1 every rank must start from the same tree: if the trees their tiers gave
        differ (a file missing or corrupt on one rank), all start empty."""
        from sgl_hicache.cache.warm_start import tree_digest

        if self.agreement.size == 1:
            return
        digest = tree_digest(self)
        low, neg_high = self.agreement.min([digest, -digest])
        if low != -neg_high:
            logger.warning("sgl_hicache: the TP ranks' tiers hold different trees; all start empty")
            self.spill_metrics.inc("tp_disagreements")
            super().reset()
            self.spilled_tokens = 0
            self.tier_orphans = {}

    def disable_spill(self) -> None:
        """Spill off for good (guard.py: a fallback failed, so our state is not trusted any more):
        without `spill_io` nothing spills, restores, prefetches or looks up, and the cache serves as
        sglang's plain radix cache. Spilled nodes left in the tree are never restored (a request
        matching them recomputes that part; an insert over them adopts them). Logged once."""
        if self.spill_io is None:
            return
        self.spill_io = None  # the tier finishes its writes unwatched; nothing reads it again
        logger.error("sgl_hicache: spill disabled after an internal error in a fallback; serving as "
                     "sglang's plain radix cache from now on")  # fmt: skip

    def report(self, idle: bool) -> dict[str, Any]:
        """Counters, staging, tier stats and an integrity verdict (for `GET /server_info`)."""
        from sgl_hicache.cache.report import spill_report

        return spill_report(self, idle)

    def check_integrity(self, held_tokens: int = 0, with_tier: bool = True) -> None:
        """Tree, pool, staging and (`with_tier`) tier accounting agree; AssertionError with the
        numbers if not."""
        from sgl_hicache.cache.integrity import check_cache_integrity

        self._poll()
        check_cache_integrity(self, held_tokens, with_tier)

    @contained("poll", nothing)
    def _poll(self) -> None:
        if self.spill_io is not None:
            self.spill_io.poll()
            self.cross_lookups.finish(self)
            self.partial_restores.expire()
            self._forget_old_deferrals()
            self.spill_metrics.set_tier_stats(self.spill_io.tier.stats())


def _attached_on_match(cache: SpillRadixCache, node: TreeNode, key: RadixKey, pos: int) -> int:
    """`warm_start.attach_on_match`, or 0 for a key holding an id no extent key can name (>= 2**32)."""
    from sgl_hicache.cache.warm_start import attach_on_match

    try:
        return attach_on_match(cache, node, key, pos)
    except ValueError:
        return 0
