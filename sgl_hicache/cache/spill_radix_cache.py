"""`SpillRadixCache`: sglang's radix cache whose evictions spill to the NVMe tier.

Three pieces, each with one owner (docs/DESIGN.md, "Controller, tree, cache"):
- the **tree** (`SpillTree`, tree.py) makes every change of spilled state and counts it;
- the **controller** (`SpillController`, controller.py) moves every byte: staging, stores, reads,
  restores in progress, lookups' I/O, and the ordering of each copy against sglang's forward;
- this **cache** translates sglang's calls into tree and controller calls and takes the decisions
  (what to spill or drop, when a restore is ready, what TP ranks agree on). When our logic raises
  in a call from sglang it answers with its fallback method instead (guard.py): sglang's plain
  radix cache behaviour on our tree, which never serves unverified KV.

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
import heapq
import logging
import math
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
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from sgl_hicache.cache.agreement import Agreement, SingleRank
from sgl_hicache.cache.clean_copies import CleanCopies
from sgl_hicache.cache.controller import SpillController
from sgl_hicache.cache.events import TierEvents
from sgl_hicache.cache.guard import contained, internal_error, last_resort, nothing
from sgl_hicache.cache.hint_source import HintSource, ResumeHint, RetentionHint
from sgl_hicache.cache.layerwise import LayerCounter, Layerwise, LayerwiseRestore
from sgl_hicache.cache.metrics import DropReason, SpillMetrics, written_per_restored
from sgl_hicache.cache.reads import Readiness
from sgl_hicache.cache.restore_policy import RestorePolicy
from sgl_hicache.cache.restores import EarlyUnpackStats, RestoreProgress
from sgl_hicache.cache.retention import Retention
from sgl_hicache.cache.spill_state import ExtentState, SpillRef
from sgl_hicache.cache.staging_share import Refused
from sgl_hicache.cache.tree import SpillTree
from sgl_hicache.cache.warm_start import WarmStart, tree_digest
from sgl_hicache.cache.write_admission import WriteAdmission
from sgl_hicache.config import SpillConfig, WritePolicy
from sgl_hicache.tier import ExtentKey, NamespaceId, chain_key
from sgl_hicache.tier.keys import PathHasher, tenant_of
from sgl_hicache.tier.path_lookup import alias_marks

logger = logging.getLogger(__name__)

ANONYMOUS = "sgl-hicache:restore"  # the owner of a restore whose request has no id (never deferred)
INTEGRITY_ENV = "SGL_HICACHE_REPORT_INTEGRITY"


class Admission:
    """One admission attempt of a request (`begin_admission` .. `end_admission`): whether
    `init_load_back` deferred it, which sglang reports only as a generic "stop admitting"."""

    def __init__(self, rid: str | None) -> None:
        self.rid = rid
        self.deferred = False


class SpillRadixCache(RadixCache):
    def __init__(self, params: CacheInitParams, config: SpillConfig, metrics: SpillMetrics,
                 controller: SpillController | None, namespace_id: NamespaceId, hints: HintSource | None = None,
                 agreement: Agreement | None = None) -> None:  # fmt: skip
        self.agreement = agreement or SingleRank()
        self.spill_config = config
        self.spill_metrics = metrics
        self.controller = controller
        self.io_to_close = controller  # closed at shutdown, also after `disable_spill`: its writes finish
        self.namespace_id = namespace_id
        self.hints = hints
        self.errors_logged: set[str] = set()  # guard.py: names whose first internal error was logged
        self._deferred_since: dict[str, float] = {}  # rid -> when its admission was first deferred
        self._admission: Admission | None = None
        self.epoch: bytes | None = None  # seeds every path key; None until the first reset()
        self.tree = SpillTree(self, config.kv_events_medium)
        self.warm = WarmStart(self.tree, namespace_id)
        self.retention = Retention(self)  # pin, drop, purge hints (retention.py)
        self.write_admission = WriteAdmission(config.admission, config.admission_min_tokens,
                                              self.retention.pin_of)  # what the tier is written  # fmt: skip
        self.clean = CleanCopies(self)  # write-through and clean-ahead (clean_copies.py)
        self.layerwise: Layerwise | None = None  # layer-wise restores in progress (layerwise.py)
        self._failed_layerwise: list[LayerwiseRestore] = []  # failed: their nodes go once unlocked
        self._waiting_layer = False  # inside the forward's wait (no advance from a nested poll)
        super().__init__(params)  # calls reset(), which attaches the tier's extents (warm start)
        if controller is not None and self.agreement.size > 1:  # the table is read by agreed decisions
            controller.restores.ttl_s = math.inf  # (restores.py): never freed at a local moment
        if config.layerwise_restore and controller is not None:
            self._start_layerwise(controller)

    @property
    def spilled_tokens(self) -> int:
        return self.tree.spilled_tokens

    @property
    def kv_events(self) -> TierEvents:
        """sglang's KV event recorder (its constructor sets it), kept true for spilled nodes (events.py)."""
        return self._kv_events

    @kv_events.setter
    def kv_events(self, recorder: Any) -> None:
        self._kv_events = recorder if isinstance(recorder, TierEvents) else TierEvents(recorder)

    @property
    def prune_lost_on_walk(self) -> bool:
        """Only a single rank may act on a locally LOST extent while walking (agreement.py)."""
        return self.agreement.size == 1

    def set_forward_streams(self, streams: list[Any]) -> None:
        """sglang's forward streams, which every copy of ours is ordered against (device.py)."""
        if self.controller is not None:
            self.controller.engine.set_forward_streams(streams)

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

    # ---- fallbacks (guard.py): sglang's plain radix cache on our tree ------------------------

    def _nothing_matched(self, _params: MatchPrefixParams) -> MatchResult:
        return self._no_match()

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
        for node in self._victims(params.num_tokens):
            evicted += self._drop_node(node, DropReason.INTERNAL_ERROR)
        return EvictResult(num_tokens_evicted=evicted)

    def _nothing_restored(self, params: InitLoadBackParams) -> tuple[int, Any] | None:
        anchor = getattr(params.req, "last_node", None)
        return 0, anchor if anchor is not None else self.root_node

    @last_resort(_nothing_restored)
    def _no_restore(self, params: InitLoadBackParams) -> tuple[int, Any] | None:
        """Nothing restored: the request recomputes its spilled part; its restore is freed."""
        try:  # the failed method may have failed right here: that must not fail its fallback too
            if self.controller is not None:
                self.controller.restores.drop(_owner(getattr(params.req, "rid", None)))
        except Exception:
            internal_error(self, "init_load_back (freeing a restore)")
        return self._nothing_restored(params)

    def _nothing_kept(self) -> None:
        """sglang's own reset (an empty tree; spill is off by then, so no key epoch matters)."""
        RadixCache.reset(self)
        self.tree.cleared()
        self._forget_layerwise()

    def _forget_layerwise(self) -> None:
        """The tree is empty (a reset): no layer-wise restore is left to end (sglang resets when idle)."""
        if getattr(self, "layerwise", None) is not None:
            assert self.layerwise is not None
            self.layerwise.active, self.layerwise.ended = [], []
        self._failed_layerwise = []

    @last_resort(_nothing_kept)
    def _empty_reset(self) -> None:
        """An empty tree in a new key epoch (nothing named before is ever found). Restores in
        progress are forgotten, not freed: sglang clears the allocator right after a flush."""
        self._nothing_kept()
        self.warm.forget()
        if self.controller is not None:
            self.controller.restores.forget()
        self.start_epoch()

    def _attached_nothing(self) -> None:
        """A warm start that failed partway: an empty tree (the tier's extents stay on disk).
        With TP > 1 the warm-start agreement still runs after it, so every rank then starts empty."""
        self._nothing_kept()
        self.warm.forget()

    def _spilled_if_marked(self, node: TreeNode) -> DropReason | None:
        """One node's spill failed: dropped instead, unless it had already become spilled."""
        return None if node.value is None else DropReason.INTERNAL_ERROR

    def _spilled_path_dropped(self, node: TreeNode, key: RadixKey) -> tuple[int, list[TreeNode]]:
        """An insert could not adopt the spilled nodes on its path: the first of them goes, with its
        subtree, so sglang's insert then finds only resident nodes there. Walks with dict lookups
        only, none of our helpers."""
        while len(key) > 0:
            child = node.children.get(key.child_key(self.page_size))
            if child is None:
                break
            if child.evicted:
                self.tree.prune(child)
                break
            n = child.key.match(key, page_size=self.page_size)
            if n < len(child.key):  # the path leaves the tree inside a resident node
                break
            node, key = child, key[n:]
        return 0, []

    def _not_ready(self, *_args: Any) -> Readiness:
        """A restore whose readiness could not be judged recomputes (its verdict is still agreed)."""
        return Readiness.FAILED

    def _pending(self, nodes: list[TreeNode], ready: Readiness) -> Readiness:
        """Layer-wise readiness could not be judged: the restore waits for all its bytes, as without."""
        return Readiness.PENDING if ready is Readiness.LAYERWISE else ready

    def _not_completed(self, owner: object) -> bool:
        """A restore that failed midway: all or nothing, so nothing (its slots stay in the table,
        which the agreement's verdict then frees)."""
        return False

    def _not_opened(self, *_args: Any) -> bool:
        """A streaming restore's slots could not be taken: none kept (the agreement then frees any)."""
        return False

    def _no_reads(self, *_args: Any) -> int:
        """A prefetch whose reads could not start: none are on their way (the restore starts them)."""
        return 0

    # ---- eviction → spill -------------------------------------------------------------------

    @contained("evict", _evict_by_dropping)
    def evict(self, params: EvictParams) -> EvictResult:
        if self.disable:
            return EvictResult()
        self._poll()
        start = time.perf_counter()
        freed = self.controller.restores.evict(params.num_tokens) if self.controller is not None else 0
        evicted = 0
        victims: list[tuple[TreeNode, bool]] = []
        for node in self._victims(params.num_tokens - freed):
            n = len(node.value)
            dropped = self._spill_node(node)
            if dropped is not None:
                self._drop_node(node, dropped)
            victims.append((node, dropped is None))
            evicted += n
        self._agree_on_spills(victims)
        self.update_eviction_metrics(evicted, start)
        self.spill_metrics.inc("evicted_tokens", evicted)
        return EvictResult(num_tokens_evicted=freed + evicted)

    def _victims(self, num_tokens: int) -> Any:
        """sglang's victims, least valuable first, until `num_tokens` slots are freed: each is yielded
        while still resident (the caller spills or drops it), then its parent may become one."""
        heap = [(self.eviction_strategy.get_priority(n), n) for n in self.evictable_leaves]
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_tokens and heap:
            _, node = heapq.heappop(heap)
            evicted += len(node.value)
            parent = node.parent
            yield node
            self.kv_events.record_remove(node)
            if parent in self.evictable_leaves:  # the same whether the victim spilled or dropped
                heapq.heappush(heap, (self.eviction_strategy.get_priority(parent), parent))

    def _agree_on_spills(self, victims: list[tuple[TreeNode, bool]]) -> None:
        """A victim stays spilled only if every rank spilled it; elsewhere it is dropped after all.
        Parents come after their children in `victims`: undo from the end, so a dropped parent takes
        its subtree and its already detached descendants are skipped."""
        if self.agreement.size == 1 or not victims:
            return
        agreed = self.agreement.min([int(spilled) for _, spilled in victims])
        for (node, spilled), ok in reversed(list(zip(victims, agreed, strict=True))):
            if spilled and not ok and self.tree.attached(node):
                self.spill_metrics.drop(self.tree.prune(node), DropReason.TP_DISAGREEMENT)
                self.spill_metrics.inc("tp_disagreements")

    @contained("evict (a node's spill)", _spilled_if_marked)
    def _spill_node(self, node: TreeNode) -> DropReason | None:
        """Spill resident leaf `node` (None), or say why it is to be dropped instead."""
        n = len(node.value)
        pin = self.retention.pin_of(node)  # a pinned conversation's node spills whatever its length
        if self.clean.is_clean(node):  # the range it was restored from, written through or ahead
            assert self.controller is not None  # `is_clean` says so
            self.controller.reused(node.spill.extent)
            self.tree.mark_spilled(node, node.spill)
            self.retention.spilled(node, pin)
            self.spill_metrics.inc("spilled_tokens", n)
            return None
        if self.too_short(node, pin):
            return DropReason.TOO_SHORT
        if self.write_admission.reason(node) is None:  # dropped as sglang's plain cache drops it
            return DropReason.NOT_ADMITTED
        ref = self.store_node(node)
        if isinstance(ref, DropReason):
            return ref
        self.tree.mark_spilled(node, ref)
        self.retention.spilled(node, pin)
        self.spill_metrics.inc("spilled_tokens", n)
        return None

    def too_short(self, node: TreeNode, pin: object) -> bool:
        """Whether eviction drops resident `node` for its length: short nodes are not worth an extent,
        unless dropping them would orphan spilled children, or their conversation is pinned."""
        return len(node.value) < self.spill_config.min_spill_tokens and not node.children and pin is None

    def store_node(self, node: TreeNode, background: bool = False) -> SpillRef | DropReason:
        """Write resident `node`'s KV to the tier as one extent (never blocks: `SpillController.store`;
        `background`: a write-through, within its share of staging); its reference, or why it
        cannot be written now."""
        if self.controller is None:
            return DropReason.NO_TIER
        tokens = np.asarray(node.key.raw_token_ids(), dtype=np.int64)
        try:
            hasher = self.path_hasher(node.key)
            before = self.tree.tokens_before(node)
            for part in before:
                hasher.update(part)
            parent_key = hasher.key()
            key = chain_key(self.namespace_id, parent_key, tokens)
            aliases = alias_marks(hasher, sum(len(p) for p in before), tokens, self.page_size)
        except ValueError:  # an id outside 0..2**32-1 on its path (keys hash u32 ids): never spilled
            return DropReason.UNNAMEABLE
        default_tenant = tenant_of(node.key.extra_key, node.key.cache_salt) == b""  # others: no ids on disk
        extent = self.controller.store(
            key, parent_key, tokens, node.value, default_tenant, aliases, background, node.key.cache_salt
        )
        if isinstance(extent, Refused):
            return DropReason.TOO_LARGE if extent is Refused.TOO_LARGE else DropReason.STAGING_FULL
        return SpillRef(extent, 0, len(node.value))

    def _drop_node(self, node: TreeNode, reason: DropReason) -> int:
        dropped = self.tree.drop(node)
        self.spill_metrics.drop(dropped, reason)
        return dropped

    def _node_keys(self, node: TreeNode) -> tuple[ExtentKey, ExtentKey]:
        """(path key of the tokens before `node`, extent key of `node`'s own tokens after them)."""
        hasher = self.path_hasher(node.key)
        for part in self.tree.tokens_before(node):
            hasher.update(part)
        parent = hasher.key()
        return parent, chain_key(self.namespace_id, parent, node.key.raw_token_ids())

    def path_hasher(self, key: RadixKey) -> PathHasher:
        """A hasher of paths of `key`'s tenant in the current epoch, at the root."""
        return PathHasher(self.namespace_id, tenant_of(key.extra_key, key.cache_salt), self.epoch or b"")

    # ---- insert → adoption, write-through ----------------------------------------------------

    def _insert_helper(self, node: TreeNode, key: RadixKey, value: Any, priority: int = 0,
                       inserted_len: int = 0) -> tuple[int, TreeNode]:  # fmt: skip
        """sglang's insert, after the spilled nodes on `key`'s path adopted the request's slots
        (their restore was not used: the request recomputed them)."""
        pos, chain = self._spilled_on_path(node, key)
        slices = []
        for spilled in chain:
            slices.append(value[pos : pos + len(spilled.key)].clone())
            pos += len(spilled.key)
        self.tree.mark_resident(chain, slices)
        prefix_len, last = RadixCache._insert_helper(self, node, key, value, priority, inserted_len)
        # Adopted tokens are the tail of the matched prefix and now own the request's slots:
        # they must not be reported as duplicates (the caller frees duplicates' slots).
        return prefix_len - sum(len(n.key) for n in chain), last

    @contained("insert (adopting spilled nodes)", _spilled_path_dropped)
    def _spilled_on_path(self, node: TreeNode, key: RadixKey) -> tuple[int, list[TreeNode]]:
        return self.tree.spilled_on_path(node, key)

    def insert(self, params: InsertParams) -> InsertResult:
        """sglang's insert (both of its callers, a checkpoint and a finished request's release, go
        through it); under the WRITE_THROUGH policy the resident nodes on the inserted path that have
        no copy on the tier are then written (`_write_through`). `value` None is sglang's debug
        insert of token ids as slots: nothing to write."""
        self.clean.changed()
        result = super().insert(params)
        if self.spill_config.write_policy is WritePolicy.WRITE_THROUGH and params.value is not None:
            self._write_through(result.last_device_node)
        return result

    @contained("insert (write-through)", nothing)
    def _write_through(self, node: TreeNode) -> None:
        """Write the resident path to `node` that has no copy on the tier (clean_copies.py)."""
        self.clean.write_through(node)

    # ---- match: device prefix + spilled continuation ---------------------------------------

    @contained("match_prefix", _match_resident_only)
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        self._poll()
        self._attach_lookups()
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
        values, last_device = self.tree.match_resident(self.root_node, key)
        device_len = sum(len(v) for v in values)
        last_spilled, host_len = self.tree.match_spilled(
            last_device, key[device_len:], self.prune_lost_on_walk
        )
        end = device_len + host_len
        lazy_attach = self.warm.orphans and self.agreement.size == 1  # TP > 1: a local outcome, not agreed
        if end < len(key) and lazy_attach and self._attach_orphans(last_spilled, key, end):
            last_spilled, more = self.tree.match_spilled(last_spilled, key[end:], self.prune_lost_on_walk)
            host_len += more
        return last_device, device_len, last_spilled, host_len

    def _attach_orphans(self, node: TreeNode, key: RadixKey, pos: int) -> int:
        """`WarmStart.attach_on_match`, or 0 for a key holding an id no extent key can name."""
        tokens = key.raw_token_ids()
        try:
            return self.warm.attach_on_match(node, key, pos, self.path_hasher(key).update(tokens[:pos]))
        except ValueError:
            return 0

    @contained("match (attaching lookups)", nothing)
    def _attach_lookups(self) -> None:
        """The one point where finished cross-server lookups change the tree: at the start of a
        scheduler round's match or prefetch, never inside an eviction or a restore. Each result's
        verified segments become spilled nodes where its prompt's match ends now, and their reads
        start."""
        if self.controller is None:
            return
        self._prune_gone()
        m = self.spill_metrics
        for found, result in self.controller.take_lookups():
            m.inc("lookup_fs_calls", result.fs_calls)
            m.inc("lookup_refused", result.refused)
            m.inc("lookup_stale", result.stale)
            m.inc("lookup_found_tokens", result.end - result.request.start)
            if not found.segments or found.epoch != (self.epoch or b""):
                continue
            key: RadixKey = found.tag  # type: ignore[assignment]
            _, device_len, node, host_len = self._walk(key)
            added = self.tree.attach_segments(node, device_len + host_len, key, found.segments)
            m.inc("lookup_attached_tokens", sum(n.spill.count for n in added))
            if added:
                self.controller.prefetch([n.spill for n in added])

    def _prune_gone(self) -> None:
        """Spilled nodes whose extent the tier evicted or could not write leave the tree with their
        subtree (a restore of them could only miss), and the router hears of it (events.py). Only
        on a single rank: with TP > 1 that is a rank's own outcome, and such nodes go when a
        restore agrees they are lost (agreement.py)."""
        assert self.controller is not None
        gone = self.tree.events.gone.take(self.controller.tier)
        for node in gone if self.prune_lost_on_walk else ():
            if node.evicted and self.tree.attached(node):
                self.tree.prune(node)

    # ---- prefetch at arrival ----------------------------------------------------------------

    def prefetch(self, token_ids: Any, extra_key: str | None = None, cache_salt: str | None = None,
                 rid: str | None = None, hinted: bool = False) -> int:  # fmt: skip
        """Start reading the spilled continuation of this prompt's cached prefix (never blocks on
        I/O); its restore will find the reads under way or done. Where the tree ends before the
        prompt does, on a root other servers use, also start a lookup of their extents (lookups.py,
        `_start_lookup`). `hinted`: a client's resume hint (not a request's arrival), whose path
        the tier is written from now on (write_admission.py). Returns the tokens on their way."""
        if self.disable:
            return 0
        self._poll()
        self._attach_lookups()
        key = RadixKey(array("q", token_ids), extra_key, cache_salt=cache_salt).page_aligned(self.page_size)
        # The walk may split nodes: every TP rank takes it, also one whose spill was disabled.
        last, device_len, end, matched = self._walk(key)
        if hinted:  # the same walk and marks on every rank
            self.write_admission.hinted(self.tree.path_up(end, self.root_node) or [])
            self.clean.changed()
        self._start_lookup(key, device_len + matched, rid)
        if not matched or self.controller is None:
            return 0
        self.spill_metrics.inc("prefetch_requests")
        return self._start_reads([node.spill for node in self.tree.path_up(end, last) or []])

    # The I/O steps of a prefetch fail alone (a rank's own outcome): the walk above, which may split
    # nodes, has run on every rank, so TP ranks keep identical trees whatever these do.
    @contained("prefetch (lookup)", nothing)
    def _start_lookup(self, key: RadixKey, held: int, rid: str | None) -> None:
        """Off with TP > 1 (lookups.py), and on a root no other server uses (`CleanCopies.root_shared`): there a
        lookup could find only our own extents, which the tree or the warm start already holds."""
        if (
            self.controller is None
            or self.agreement.size > 1
            or self.is_eagle
            or not self.clean.root_shared()
        ):
            return
        tenant = tenant_of(key.extra_key, key.cache_salt)
        if self.controller.lookups.start(self.controller.tier, key.raw_token_ids(), held, tenant,
                                         self.epoch or b"", rid, tag=key):  # fmt: skip
            self.spill_metrics.inc("lookups")

    @contained("prefetch (reads)", _no_reads)
    def _start_reads(self, refs: list[SpillRef]) -> int:
        return self.controller.prefetch(refs) if self.controller is not None else 0

    def lookup_waiting(self, rid: str | None) -> bool:
        """Whether request `rid`'s admission should wait for its cross-server lookup: still running,
        within the prefetch policy's limit (`RestorePolicy.lookup_wait_s`; never with best_effort). Off where none is started (on a
        root no other server uses: `_start_lookup`). Never blocks."""
        limit_s = RestorePolicy.of(self.spill_config).lookup_wait_s
        if self.controller is None or limit_s <= 0:
            return False
        waiting = self.controller.lookups.waiting(rid, limit_s)
        self.spill_metrics.inc("lookups_waited", int(waiting))
        return waiting

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

    # ---- restore ----------------------------------------------------------------------------

    def begin_admission(self, rid: str | None) -> Admission:
        """Start watching one admission attempt of request `rid` (the admission hook's)."""
        self._admission = Admission(rid)
        return self._admission

    def end_admission(self, attempt: Admission) -> bool:
        """Whether `init_load_back` deferred the request during `attempt` (its reads are in flight)."""
        if self._admission is attempt:
            self._admission = None
        return attempt.deferred

    @contained("init_load_back", _no_restore)
    def init_load_back(self, params: InitLoadBackParams) -> tuple[int, Any] | None:
        self._poll()
        rid = getattr(params.req, "rid", None)
        answer = self._load_back(params, rid)
        if answer is None:
            if self._admission is not None and self._admission.rid == rid:
                self._admission.deferred = True
            return None
        if self.controller is not None:  # admitted: a restore in progress not consumed now never will be
            self.controller.restores.drop(_owner(rid))
        since = self._deferred_since.pop(rid, None) if rid is not None else None
        if since is not None:  # the admission waited for reads: the resumed turn's "wait" phase
            self.spill_metrics.inc("restore_wait_seconds", time.monotonic() - since)
        return answer

    def _load_back(self, params: InitLoadBackParams, rid: str | None) -> tuple[int, Any] | None:
        anchor = params.req.last_node if params.req is not None else None
        chain = self.tree.path_up(params.best_match_node, anchor)
        if chain is None or sum(len(n.key) for n in chain) != params.host_hit_length:
            return 0, anchor if anchor is not None else self.root_node
        spilled = [n for n in chain if n.evicted]
        if spilled:
            ready = self._agreed_readiness(
                spilled, self._layerwise_ready(spilled, self._restore_readiness(spilled, rid))
            )
            if ready is None:  # a rank found an extent lost: every rank drops the spilled chain
                self._drop_lost(spilled, rid)
                return 0, anchor
            if ready is Readiness.LAYERWISE:  # the prefill starts; each layer waits for its group
                if not self._restore_layerwise(spilled, rid, anchor):
                    return 0, anchor
                if params.req is not None:
                    params.req.host_hit_is_storage = True
                return params.host_hit_length, params.best_match_node
            if ready in (Readiness.PENDING, Readiness.STREAMING):  # unpack what landed, never wait
                if rid is not None:
                    self._stream(spilled, rid, anchor, ready)
                return None  # the scheduler retries admission next round; its loop never waits on I/O
            if ready is Readiness.FAILED:
                self.spill_metrics.inc("restore_failures")
                if self.controller is not None:
                    self.controller.finish_reads([node.spill for node in spilled], _owner(rid))
                return 0, anchor
            if not self._restore(spilled, rid, anchor):
                return 0, anchor
        if params.req is not None:
            params.req.host_hit_is_storage = True  # per-tier cached-token details: ours is the storage tier
        return params.host_hit_length, params.best_match_node

    def _agreed_readiness(self, nodes: list[TreeNode], ready: Readiness) -> Readiness | None:
        """The readiness every rank agrees on (the least ready); None: some rank's extent is LOST."""
        lost = any(node.spill.extent.state is ExtentState.LOST for node in nodes)
        codes = {Readiness.READY: 5, Readiness.LAYERWISE: 4, Readiness.PENDING: 3, Readiness.STREAMING: 2}
        code = codes.get(ready, 0 if lost else 1)
        agreed = self.agreement.min([code])[0]
        self.spill_metrics.inc("tp_disagreements", int(agreed != code))
        if agreed == 0 and self.agreement.size > 1:
            return None
        return {v: k for k, v in codes.items()}.get(agreed, Readiness.FAILED)

    @contained("init_load_back (layer-wise readiness)", _pending)
    def _layerwise_ready(self, nodes: list[TreeNode], ready: Readiness) -> Readiness:
        """PENDING becomes LAYERWISE (with layer-wise restore on) once every read of the restore has
        landed its first layer group: the prefill may start, each layer waiting for its own."""
        if ready is not Readiness.PENDING or self.layerwise is None or self.controller is None:
            return ready
        refs = [node.spill for node in nodes]
        if self.controller.landed_tokens(refs, group=0) == sum(ref.count for ref in refs):
            return Readiness.LAYERWISE
        return ready

    def _drop_lost(self, nodes: list[TreeNode], rid: str | None) -> None:
        """After an agreed loss: the first spilled node of the chain goes, with its subtree."""
        self.spill_metrics.inc("restore_failures")
        if self.controller is not None:
            self.controller.finish_reads([node.spill for node in nodes], _owner(rid))
        if self.tree.attached(nodes[0]):
            self.tree.prune(nodes[0])

    @contained("init_load_back (readiness)", _not_ready)
    def _restore_readiness(self, nodes: list[TreeNode], rid: str | None) -> Readiness:
        """The reads this restore needs (starting any missing ones), within the prefetch policy's
        limit (`RestorePolicy.restore_wait_s`); past it the request recomputes. The wait counts from the oldest read or the request's first deferral, whichever is earlier, so
        reads restarted meanwhile (a TTL expiry, a split) never defer a request forever."""
        if self.controller is None:
            return Readiness.FAILED
        state, waited = self.controller.readiness([node.spill for node in nodes], _owner(rid))
        if state not in (Readiness.PENDING, Readiness.STREAMING):
            return state
        if rid is None and state is Readiness.STREAMING:  # no later attempt to stream it to
            return Readiness.FAILED
        if rid is not None:
            now = time.monotonic()
            waited = max(waited, now - self._deferred_since.setdefault(rid, now))
        if waited < RestorePolicy.of(self.spill_config).restore_wait_s:
            return state
        self.spill_metrics.inc("restores_too_late")
        return Readiness.FAILED

    def _stream(self, nodes: list[TreeNode], rid: str, anchor: TreeNode | None, ready: Readiness) -> None:
        """A deferred restore's progress: what landed is unpacked into its slots and the reads of
        extents unpacked whole go back to staging, so the next attempt starts the reads that found
        no room (docs/DESIGN.md, "Restores stream through staging"). On one rank the slots are taken
        at the first attempt that finds bytes landed (a local moment); with TP > 1 they are taken
        only where every rank agreed the restore must stream (taking slots may evict: the ranks'
        trees must stay equal), and unpacking into them is then each rank's own."""
        if self.agreement.size == 1:
            self._unpack_early(nodes, rid, anchor, ready)
            return
        if ready is Readiness.STREAMING:
            self._open_agreed(nodes, rid, anchor)
        self._unpack_opened(nodes, rid, ready)

    @contained("init_load_back (early unpack)", nothing)
    def _unpack_early(
        self, nodes: list[TreeNode], rid: str, anchor: TreeNode | None, ready: Readiness
    ) -> None:
        """Unpack what has landed of `rid`'s restore of `nodes`, taking its slots at the first call
        that finds verified bytes landed, and (`_give_back`) the reads it unpacked whole. Never blocks."""
        ctl = self.controller
        assert ctl is not None
        refs = tuple(node.spill for node in nodes)
        opened = ctl.restores.current(rid, refs) is not None
        if not opened and not (ctl.landed_tokens(refs) and self._open_restore(rid, nodes, refs, anchor)):
            return
        ctl.unpack_landed(rid)
        self._give_back(rid, ready)

    def _give_back(self, rid: str, ready: Readiness) -> None:
        """The reads `rid`'s restore unpacked whole go back to staging when room is short: its own
        reads did not all start, or another restore waits for room. Otherwise they stay until it
        completes (another restore of the same extents may still use them)."""
        assert self.controller is not None
        if ready is Readiness.STREAMING or self.controller.reads.room_wanted:
            self.controller.release_unpacked(rid)

    def _open_agreed(self, nodes: list[TreeNode], rid: str, anchor: TreeNode | None) -> None:
        """TP > 1: every rank takes the streaming restore's slots in the same attempt, or none keeps them."""
        ctl = self.controller
        assert ctl is not None
        if ctl.restores.current(rid, tuple(node.spill for node in nodes)) is not None:
            return
        ok = self._try_open(nodes, rid, anchor)
        if not self.agreement.all_ok(ok) and self.controller is not None:
            self.spill_metrics.inc("tp_disagreements", int(ok))
            self.controller.restores.drop(rid)

    @contained("init_load_back (streaming slots)", _not_opened)
    def _try_open(self, nodes: list[TreeNode], rid: str, anchor: TreeNode | None) -> bool:
        return self._open_restore(rid, nodes, tuple(node.spill for node in nodes), anchor)

    @contained("init_load_back (early unpack)", nothing)
    def _unpack_opened(self, nodes: list[TreeNode], rid: str, ready: Readiness) -> None:
        """TP > 1: unpack into `rid`'s open restore what landed (copies only: the tree is untouched)."""
        ctl = self.controller
        assert ctl is not None
        if ctl.restores.current(rid, tuple(node.spill for node in nodes)) is not None:
            ctl.unpack_landed(rid)
            self._give_back(rid, ready)

    def _open_restore(self, owner: object, nodes: list[TreeNode], refs: tuple[SpillRef, ...],
                      anchor: TreeNode | None) -> bool:  # fmt: skip
        """Allocate the restore's slots and register them (the table owns them from here); False
        when the pool cannot hold them, or the chain changed while room was made."""
        assert self.controller is not None
        slots = self._alloc_slots(sum(ref.count for ref in refs), anchor)
        if slots is None:
            return False
        if self.controller is None or not all(  # None: the eviction that made room disabled spill
            node.evicted and node.spill is ref and self.tree.attached(node)
            for node, ref in zip(nodes, refs, strict=True)
        ):
            self.token_to_kv_pool_allocator.free(slots)
            return False
        self.controller.restores.open(owner, refs, slots)
        return True

    def _restore(self, nodes: list[TreeNode], rid: str | None, anchor: TreeNode | None) -> bool:
        """All or nothing; every rank verified its bytes, or all recompute. The restore's slots are
        the table's until the nodes take them, so a fault anywhere frees them (the fallback drops
        the owner's restore)."""
        assert self.controller is not None
        ctl, owner = self.controller, _owner(rid)
        refs = tuple(node.spill for node in nodes)
        t0 = time.perf_counter()
        opened = ctl.restores.current(owner, refs) is not None or self._open_restore(
            owner, nodes, refs, anchor
        )
        if not opened:
            self.spill_metrics.inc("restore_failures")
            ctl.finish_reads(refs, owner)  # release their staging now, not after the TTL
        ok = opened and self._complete(owner)
        if not self.agreement.all_ok(ok):
            ctl.restores.drop(owner)
            self.spill_metrics.inc("tp_disagreements", int(ok))
            return False
        progress = ctl.restores.get(owner)
        assert progress is not None  # agreed ok implies this rank's ok
        self.spill_metrics.observe_restore(time.perf_counter() - t0)
        ctl.count_restored(progress)
        values = [slots.clone() for _, _, slots in progress.parts()]
        ctl.restores.hand_over(owner)
        try:
            self.tree.mark_resident(nodes, values)
        except BaseException:  # those marked keep their verified KV; the others' slots are freed
            for node, value in zip(nodes, values, strict=True):
                if node.evicted:
                    self.token_to_kv_pool_allocator.free(value)
            raise
        return True

    # ---- layer-wise restore (layerwise.py) ---------------------------------------------------

    def _start_layerwise(self, ctl: SpillController) -> None:
        """The table of layer-wise restores, and the counter sglang's KV pool consults before
        attention reads a layer (`register_layer_transfer_counter`, as HiCache's)."""
        self.layerwise = Layerwise(
            ctl.layout.group_of, ctl.timeout_s, self.spill_metrics,
            unpack=lambda progress, fence: ctl.unpack_landed(None, progress, fence),
            failed=self._layerwise_read_failed, poll=ctl.poll, forward_waits=ctl.engine.forward_waits,
            settle=self._layerwise_settled, fail=self._layerwise_failed,
        )  # fmt: skip
        kv = self.token_to_kv_pool_allocator.get_kvcache()
        kv.register_layer_transfer_counter(LayerCounter(len(ctl.view.layers), self.layerwise_wait))

    def _restore_layerwise(self, nodes: list[TreeNode], rid: str | None, anchor: TreeNode | None) -> bool:
        """Admit the restore of `nodes` before its later layer groups landed: its slots go to the
        nodes now (locked until it settles), what landed is unpacked, and the rest is unpacked as
        the forward reaches each group (`layerwise_wait`). All or nothing across TP ranks, as
        `_restore`: a rank that cannot take its slots makes every rank recompute."""
        assert self.controller is not None and self.layerwise is not None
        ctl, owner = self.controller, _owner(rid)
        refs = tuple(node.spill for node in nodes)
        opened = ctl.restores.current(owner, refs) is not None or self._open_restore(
            owner, nodes, refs, anchor
        )
        ok = opened and self._unpack_layerwise_start(owner)
        if not self.agreement.all_ok(ok):
            self.spill_metrics.inc("restore_failures")
            ctl.restores.drop(owner)
            ctl.finish_reads(refs)
            self.spill_metrics.inc("tp_disagreements", int(ok))
            return False
        progress = ctl.restores.get(owner)
        assert progress is not None  # agreed ok implies this rank's ok
        fence = ctl.engine.fence()  # every forward that could write these slots is before it
        landed = next((g for g in range(progress.groups) if not progress.group_done(g)), progress.groups)
        values = [slots.clone() for _, _, slots in progress.parts()]
        ctl.restores.hand_over(owner, landing=True)
        try:
            self.tree.mark_resident(nodes, values)
        except BaseException:  # those marked keep their KV's slots: they are dropped as failed below
            ctl.restores.landed(progress)
            for node, value in zip(nodes, values, strict=True):
                if node.evicted:
                    self.token_to_kv_pool_allocator.free(value)
            raise
        self.inc_lock_ref(nodes[-1])  # never evicted (packed) nor dropped while it lands
        self.layerwise.start(owner, nodes, progress, fence, landed)
        return True

    @contained("init_load_back (layer-wise unpack)", _not_completed)
    def _unpack_layerwise_start(self, owner: object) -> bool:
        assert self.controller is not None
        self.controller.unpack_landed(owner)
        return True

    def _layerwise_read_failed(self, progress: RestoreProgress) -> str | None:
        """Why a read the restore still needs can never land (None while all may). A ref unpacked
        whole needs none: its bytes are in the slots (a write's staging, unpacked at admission and
        given back when the write completed, has no read to ask about)."""
        assert self.controller is not None
        for i, ref, _ in progress.parts():
            if not progress.ref_done(i) and self.controller.reads.failed(ref.extent):
                return f"read of extent {ref.extent.key.hex()} failed"
        return None

    def _layerwise_settled(self, restore: LayerwiseRestore) -> None:
        """Every group unpacked: the reads' staging goes back, later forwards wait for the last copy,
        and the nodes are ordinary resident nodes (their lock released)."""
        ctl = self.controller
        if ctl is not None:
            ctl.engine.forward_waits(restore.progress.last_copy)
            ctl.restores.landed(restore.progress)
            ctl.finish_reads(restore.progress.refs)
        self.spill_metrics.observe_restore(time.monotonic() - restore.progress.started)
        self._unlock_layerwise(restore)

    def _layerwise_failed(self, restore: LayerwiseRestore) -> None:
        """A group cannot land: nothing more is unpacked; its nodes stay locked and are never
        matched (`poisoned`) until `after_forward` takes them out of the tree (`_detach_failed`) and
        has their readers retracted; `drop_failed_layerwise` frees them once nobody holds them."""
        ctl = self.controller
        if ctl is not None:
            ctl.engine.forward_waits(ctl.engine.load_barrier())
            ctl.restores.landed(restore.progress)
            ctl.finish_reads(restore.progress.refs)
        self.spill_metrics.inc("restore_failures")
        self.spill_metrics.inc("layerwise_failed_restores")
        self._poison(restore)

    def _poison(self, restore: LayerwiseRestore) -> None:
        for node in self._layerwise_chain(restore):
            node.layerwise_poisoned = True
        if restore not in self._failed_layerwise:
            self._failed_layerwise.append(restore)

    def _unlock_layerwise(self, restore: LayerwiseRestore) -> None:
        if not restore.unlocked:
            restore.unlocked = True
            self.dec_lock_ref(restore.nodes[-1])

    def _layerwise_chain(self, restore: LayerwiseRestore) -> list[TreeNode]:
        """The nodes holding the restore's slots now: its chain, with any node split from one since."""
        return self.tree.path_up(restore.nodes[-1], restore.anchor) or list(restore.nodes)

    def layerwise_wait(self, layer: int) -> None:
        """sglang's KV pool, before attention reads local layer `layer` (`LayerCounter`): every
        layer-wise restore in progress has that layer's group unpacked (or failed). Never raises:
        an error of ours fails every restore in progress (their requests recompute)."""
        lw = self.layerwise
        if lw is None or not lw.active:
            return
        self._waiting_layer = True
        try:
            lw.wait_layer(layer)
        except Exception:
            internal_error(self, "layer-wise wait")
            self._fail_all_layerwise()
        finally:
            self._waiting_layer = False

    def _fail_all_layerwise(self) -> None:
        assert self.layerwise is not None
        try:
            self.layerwise.fail_all("internal error")
        except Exception:
            internal_error(self, "layer-wise wait (failing its restores)")
            for restore in self.layerwise.active:  # at least never served: retracted, dropped
                restore.failed = restore.failed or "internal error"
                self._poison(restore)
                if self.controller is not None:  # its reads go with their last user or their TTL
                    self.controller.restores.landed(restore.progress)
                self.layerwise.ended.append(restore)
            self.layerwise.active = []

    def after_forward(self, reqs: list[Any]) -> list[Any]:
        """After a forward (the scheduler's hook): every layer-wise restore in progress ends (blocks
        for its last reads); those that failed on any TP rank fail on all (agreed, in admission
        order); returns the requests of `reqs` whose prefix holds a failed restore's nodes: they read
        KV that is not what the tree says, so the caller retracts them (they recompute) and then
        calls `drop_failed_layerwise`. Never raises: an error of ours fails every restore of the
        forward."""
        lw = self.layerwise
        if lw is None:
            return []
        try:
            lw.settle_all()
        except Exception:
            internal_error(self, "after forward (layer-wise settle)")
            self._fail_all_layerwise()
        ended = lw.take_ended()
        if ended:
            ok = [int(r.failed is None) for r in ended]
            agreed = self.agreement.min(ok) if self.agreement.size > 1 else ok
            for restore, mine, all_ok in zip(ended, ok, agreed, strict=True):
                if mine and not all_ok:  # another rank's failed: this rank's KV is right, but all retract
                    self.spill_metrics.inc("tp_disagreements")
                    restore.failed = "failed on another TP rank"
                    self._poison(restore)
                elif all_ok and self.controller is not None:  # settled on every rank: restored
                    self.controller.count_restored(restore.progress)
        if not self._failed_layerwise:
            return []
        self._detach_failed()
        poisoned = {id(node) for r in self._failed_layerwise for node in self._layerwise_chain(r)}
        affected = [req for req in reqs if self._path_holds(getattr(req, "last_node", None), poisoned)]
        self.spill_metrics.inc("layerwise_retracted_requests", len(affected))
        return affected

    def _path_holds(self, node: TreeNode | None, ids: set[int]) -> bool:
        while node is not None and node is not self.root_node:
            if id(node) in ids:
                return True
            node = node.parent
        return False

    def _detach_failed(self) -> None:
        """Take the chains of failed layer-wise restores out of the tree (`SpillTree.detach`), at a
        point every TP rank reaches with the same failures (after their agreement): from here no
        match, insert or eviction sees them (an insert of the same tokens, by a request that
        recomputed them, makes new nodes of its own slots: sglang's checkpoint re-match then covers
        its key), while the requests still holding them keep their slots until they let go."""
        for restore in self._failed_layerwise:
            if restore.detached is not None:
                continue
            top = self._layerwise_chain(restore)[0]
            attached = self.tree.attached(top) and not top.evicted
            restore.detached = self.tree.detach(top) if attached else []

    def drop_failed_layerwise(self) -> None:
        """Free the nodes of failed layer-wise restores (their slots hold KV of some layers only),
        taken out of the tree by `after_forward`, once no request holds them: after `after_forward`'s
        requests were retracted. A chain still held waits (out of the tree meanwhile) for the next
        call."""
        self._detach_failed()
        keep = []
        for restore in self._failed_layerwise:
            self._unlock_layerwise(restore)
            nodes = restore.detached or []
            if any(node.lock_ref > 0 for node in nodes):
                keep.append(restore)
                continue
            self.spill_metrics.inc("layerwise_dropped_tokens", self.tree.free_detached(nodes))
        self._failed_layerwise = keep

    @contained("init_load_back (restore)", _not_completed)
    def _complete(self, owner: object) -> bool:
        return self.controller is not None and self.controller.complete(owner)

    def _forget_old_deferrals(self) -> None:
        """Requests deferred long ago and never seen again (aborted) leave no state behind."""
        cutoff = time.monotonic() - 2 * (self.spill_config.io_timeout_s + self.spill_config.prefetch_ttl_s)
        for rid in [r for r, t in self._deferred_since.items() if t < cutoff]:
            del self._deferred_since[rid]

    def _alloc_slots(self, n: int, anchor: TreeNode | None = None) -> torch.Tensor | None:
        """n fresh slots, evicting to make room (with `anchor`'s path locked: the restore's chain
        hangs from it), or None."""
        allocator = self.token_to_kv_pool_allocator
        if allocator.available_size() < n:
            lock = anchor is not None and anchor is not self.root_node
            if lock:
                self.inc_lock_ref(anchor)
            try:
                self.evict(EvictParams(num_tokens=n - allocator.available_size()))
            finally:
                if lock:
                    self.dec_lock_ref(anchor)
        return allocator.alloc(n) if allocator.available_size() >= n else None

    # ---- reset, epochs, warm start ----------------------------------------------------------

    @contained("reset", _empty_reset)
    def reset(self) -> None:
        """sglang's reset: an empty tree. At start, the tier's published extents are attached to it
        as spilled nodes (warm restart). Any later reset is a flush (`/flush_cache`, a weight update
        with flush_cache): it starts a new epoch, a random seed of every path key, so no extent named
        before it can ever be found again (those age out of the tier by LRU), and none named after it
        is attached by a restart (the weights in memory may no longer be the ones on disk)."""
        super().reset()
        self.tree.cleared()
        self._forget_layerwise()
        self.warm.forget()
        if self.controller is not None:
            self.controller.clear()
        if self.epoch is None:
            self.epoch = b""
            self._attach_tier_extents()
            self._agree_on_warm_start()  # reached whatever the attach did: ranks pair collectives
            return
        self.start_epoch()
        self.spill_metrics.inc("flushes")
        logger.info("sgl_hicache: cache flushed; spilled KV from before the flush will not be served")

    @contained("reset (warm start)", _attached_nothing)
    def _attach_tier_extents(self) -> None:
        if self.controller is not None:
            self.warm.attach_all(self.controller.tier, self.epoch or b"")

    def start_epoch(self) -> None:
        """A new random seed of every path key (a flush, a weight update): nothing named before is
        found after, and nothing named after is attached by a restart. Keeps the tree."""
        self.epoch = os.urandom(16)
        self.warm.forget()

    def _agree_on_warm_start(self) -> None:
        """With TP > 1 every rank must start from the same tree: if the trees their tiers gave
        differ (a file missing or corrupt on one rank), all start empty."""
        if self.agreement.size == 1:
            return
        digest = tree_digest(self.root_node)
        low, neg_high = self.agreement.min([digest, -digest])
        if low != -neg_high:
            logger.warning("sgl_hicache: the TP ranks' tiers hold different trees; all start empty")
            self.spill_metrics.inc("tp_disagreements")
            self._attached_nothing()

    def disable_spill(self) -> None:
        """Spill off for good (guard.py: a fallback failed, so our state is not trusted any more):
        without a controller nothing spills, restores, prefetches or looks up, and the cache serves
        as sglang's plain radix cache. Restores in progress free their slots
        (else sglang's idle memory check finds slots nobody owns). Spilled nodes left in the tree are
        never restored (a request matching them recomputes that part; an insert over them adopts
        them), but the tree decisions go on as on every rank: walks that split nodes, evictions'
        agreements. Logged once."""
        ctl = self.controller
        if ctl is None:
            return
        self.controller = None  # the tier finishes its writes unwatched (closed at shutdown: `io_to_close`)
        logger.error("sgl_hicache: spill disabled after an internal error in a fallback; serving as "
                     "sglang's plain radix cache from now on")  # fmt: skip
        try:  # restores in progress own slots that nothing would count or free from now on
            ctl.restores.clear()
        except Exception:  # the slots stay lost (never handed out unwaited): counted and logged
            internal_error(self, "disable_spill (freeing restores in progress)")
        if self.layerwise is not None and self.layerwise.active:  # their requests are retracted
            self._fail_all_layerwise()

    # ---- state and accounting ----------------------------------------------------------------

    def report(self, idle: bool) -> dict[str, Any]:
        """Counters, staging, tier stats and an integrity verdict (for `GET /server_info`)."""
        io = self.controller.report() if self.controller is not None else _NO_CONTROLLER
        written = io["tier"]["written_bytes"] if io["tier"] is not None else 0
        return {
            "spilled_tokens_in_tree": self.tree.spilled_tokens,
            "counters": dict(self.spill_metrics.totals),
            **io,
            "tier_written_per_restored_byte": written_per_restored(
                written, self.spill_metrics.totals["restored_bytes"]
            ),
            "integrity": self._integrity_verdict(idle),
            "tp_agreement": {
                "ranks": self.agreement.size,
                "collectives": self.agreement.calls,
                "seconds": round(self.agreement.seconds, 6),
            },
        }

    def _integrity_verdict(self, idle: bool) -> str:
        """Opt-in (`SGL_HICACHE_REPORT_INTEGRITY=1`; else "off"): the check runs on the scheduler
        thread and lists every file of the tier, so any client polling `/server_info` could stall
        the scheduler. "skipped: ..." unless idle (running requests hold slots outside the tree),
        else "ok" or "failed: ..." (a tier file another process removed meanwhile is an OSError)."""
        if os.environ.get(INTEGRITY_ENV) != "1":
            return "off"
        if not idle:
            return "skipped: requests in flight"
        try:
            self.check_integrity()
        except (AssertionError, OSError) as e:
            return f"failed: {e}"
        return "ok"

    def check_integrity(self, held_tokens: int = 0, with_tier: bool = True) -> None:
        """Tree, pool, staging and (`with_tier`) tier accounting agree; AssertionError with the
        numbers if not. Call when idle (`held_tokens`: slots running requests hold); waits for the
        tier's removals of retention hints (a file being unlinked is neither indexed nor gone)."""
        self._poll()
        if with_tier:
            self.retention.wait_jobs()
        restoring = self.controller.restores.held_slots() if self.controller is not None else []
        detached = [node for r in self._failed_layerwise for node in r.detached or ()]
        self.tree.check_integrity(restoring, held_tokens, detached)
        if self.controller is not None:
            self.controller.check_integrity(with_tier)

    def poll(self) -> None:
        """Take finished I/O and copies (sglang's idle loop calls this through a hook). Never blocks."""
        self._poll()

    @contained("idle (clean ahead)", nothing)
    def clean_ahead(self) -> None:
        """While no request runs or waits (the idle hook): give the next victims of eviction a
        clean copy on the tier, so evicting them later copies nothing (clean_copies.py)."""
        self.clean.clean_ahead()

    @contained("poll", nothing)
    def _poll(self) -> None:
        """Take finished I/O and copies (never changes the tree; lookups attach in `_attach_lookups`)."""
        if self.controller is not None:
            self.controller.poll()
            if self.layerwise is not None and not self._waiting_layer:
                self.layerwise.advance()
            self.retention.poll()
            self.tree.events.gone.collect(self.controller.tier)
            self._forget_old_deferrals()
            self.spill_metrics.set_tier_stats(self.controller.tier.stats())
            staging = self.controller.staging
            self.spill_metrics.set_staging(
                staging.used_bytes, staging.peak_bytes, staging.capacity_bytes, staging.refused
            )


def _owner(rid: str | None) -> object:
    return rid if rid is not None else ANONYMOUS


_NO_CONTROLLER: dict[str, Any] = {
    "staging_used_bytes": 0, "staging_capacity_bytes": 0, "staging_peak_bytes": 0, "staging_refused": 0,
    "staging_pinned": False, "writes_in_flight": 0, "partial_restores": 0,
    "early_unpack": vars(EarlyUnpackStats()), "tier": None,
}  # fmt: skip
