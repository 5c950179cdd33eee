"""Spilling: sglang's evictions write their victims to the tier, and inserts take spilled nodes back.

- **Evict** (`evict`): restores in progress give their slots back first (restores.py); then the
  victims as sglang picks them (its eviction policy over unlocked device leaves, `victims`), each
  spilled as one extent and kept in the tree as spilled (`_spill_node`), or dropped: too short
  (`too_short`), not admitted (write_admission.py), not nameable, staging full. A victim with a
  clean copy (clean_copies.py) only points at it. With TP > 1 a victim stays spilled only where
  every rank spilled it (`_agree_on_spills`).
- **Store** (`store_node`): a resident node's KV written as one extent, never blocking
  (`SpillController.store`); eviction's and the clean copies' one way to the tier.
- **Insert** (`adopt`, `write_through`): spilled nodes on an inserted path adopt the request's
  slots (their restore was not used: the request recomputed them); under write-through the
  resident path is then written (clean_copies.py).
Every step a fault may stop is contained here (guard.py) with its own fallback: a node dropped
instead of spilled, a spilled path dropped instead of adopted.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from sgl_hicache.cache.clean_copies import CleanCopies
from sgl_hicache.cache.guard import GuardedPart, contained, nothing
from sgl_hicache.cache.metrics import DropReason
from sgl_hicache.cache.owning_cache import OwningCache
from sgl_hicache.cache.retention import Retention
from sgl_hicache.cache.spill_state import SpillRef
from sgl_hicache.cache.staging_share import Refused
from sgl_hicache.cache.write_admission import WriteAdmission
from sgl_hicache.config import SpillConfig
from sgl_hicache.tier import ExtentKey, NamespaceId, chain_key
from sgl_hicache.tier.keys import PathHasher, tenant_of
from sgl_hicache.tier.path_lookup import alias_marks


class SpillingCache(OwningCache, Protocol):
    """What spilling needs of the cache (`SpillRadixCache` is one)."""

    spill_config: SpillConfig
    namespace_id: NamespaceId
    retention: Retention
    write_admission: WriteAdmission
    clean: CleanCopies
    page_size: int
    eviction_strategy: Any
    evictable_leaves: Any
    kv_events: Any

    def path_hasher(self, key: RadixKey) -> PathHasher: ...

    def update_eviction_metrics(self, num_evicted: int, start_time: float) -> None: ...


class Spilling(GuardedPart[SpillingCache]):
    def evict(self, num_tokens: int) -> int:
        """Free `num_tokens` slots (or all there are): restores in progress first, then victims
        spilled or dropped; the tokens freed."""
        cache = self.cache
        start = time.perf_counter()
        freed = cache.controller.restores.evict(num_tokens) if cache.controller is not None else 0
        evicted = 0
        victims: list[tuple[TreeNode, bool]] = []
        for node in self.victims(num_tokens - freed):
            n = len(node.value)
            dropped = self._spill_node(node)
            if dropped is not None:
                self.drop_node(node, dropped)
            victims.append((node, dropped is None))
            evicted += n
        self._agree_on_spills(victims)
        cache.update_eviction_metrics(evicted, start)
        cache.spill_metrics.inc("evicted_tokens", evicted)
        return freed + evicted

    def victims(self, num_tokens: int) -> Iterator[TreeNode]:
        """sglang's victims, least valuable first, until `num_tokens` slots are freed: each is yielded
        while still resident (the caller spills or drops it), then its parent may become one."""
        cache = self.cache
        heap = [(cache.eviction_strategy.get_priority(n), n) for n in cache.evictable_leaves]
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_tokens and heap:
            _, node = heapq.heappop(heap)
            evicted += len(node.value)
            parent = node.parent
            yield node
            cache.kv_events.record_remove(node)
            if parent in cache.evictable_leaves:  # the same whether the victim spilled or dropped
                heapq.heappush(heap, (cache.eviction_strategy.get_priority(parent), parent))

    def _agree_on_spills(self, victims: list[tuple[TreeNode, bool]]) -> None:
        """A victim stays spilled only if every rank spilled it; elsewhere it is dropped after all.
        Parents come after their children in `victims`: undo from the end, so a dropped parent takes
        its subtree and its already detached descendants are skipped."""
        cache = self.cache
        if cache.agreement.size == 1 or not victims:
            return
        agreed = cache.agreement.min([int(spilled) for _, spilled in victims])
        for (node, spilled), ok in reversed(list(zip(victims, agreed, strict=True))):
            if spilled and not ok and cache.tree.attached(node):
                cache.spill_metrics.drop(cache.tree.prune(node), DropReason.TP_DISAGREEMENT)
                cache.spill_metrics.inc("tp_disagreements")

    def _spilled_if_marked(self, node: TreeNode) -> DropReason | None:
        """One node's spill failed: dropped instead, unless it had already become spilled."""
        return None if node.value is None else DropReason.INTERNAL_ERROR

    @contained("evict (a node's spill)", _spilled_if_marked)
    def _spill_node(self, node: TreeNode) -> DropReason | None:
        """Spill resident leaf `node` (None), or say why it is to be dropped instead."""
        cache = self.cache
        n = len(node.value)
        pin = cache.retention.pin_of(node)  # a pinned conversation's node spills whatever its length
        if cache.clean.is_clean(node):  # the range it was restored from, written through or ahead
            assert cache.controller is not None  # `is_clean` says so
            cache.controller.reused(node.spill.extent)
            cache.tree.mark_spilled(node, node.spill)
            cache.retention.spilled(node, pin)
            cache.spill_metrics.inc("spilled_tokens", n)
            return None
        if self.too_short(node, pin):
            return DropReason.TOO_SHORT
        if cache.write_admission.reason(node) is None:  # dropped as sglang's plain cache drops it
            return DropReason.NOT_ADMITTED
        # a drop that would lose more than the node (its pin's promise, its spilled children) does
        # not yield to a waiting restore's read
        ref = self.store_node(node, yields=pin is None and not node.children)
        if isinstance(ref, DropReason):
            return ref
        cache.tree.mark_spilled(node, ref)
        cache.retention.spilled(node, pin)
        cache.spill_metrics.inc("spilled_tokens", n)
        return None

    def too_short(self, node: TreeNode, pin: object) -> bool:
        """Whether eviction drops resident `node` for its length: short nodes are not worth an extent,
        unless dropping them would orphan spilled children, or their conversation is pinned."""
        return (
            len(node.value) < self.cache.spill_config.min_spill_tokens and not node.children and pin is None
        )

    def store_node(
        self, node: TreeNode, background: bool = False, yields: bool = True
    ) -> SpillRef | DropReason:
        """Write resident `node`'s KV to the tier as one extent (never blocks: `SpillController.store`;
        `background`: a write-through, within its share of staging; `yields`: leaves a waiting
        restore's read its room); its reference, or why it cannot be written now."""
        cache = self.cache
        if cache.controller is None:
            return DropReason.NO_TIER
        tokens = np.asarray(node.key.raw_token_ids(), dtype=np.int64)
        try:
            hasher = cache.path_hasher(node.key)
            before = cache.tree.tokens_before(node)
            for part in before:
                hasher.update(part)
            parent_key = hasher.key()
            key = chain_key(cache.namespace_id, parent_key, tokens)
            aliases = alias_marks(hasher, sum(len(p) for p in before), tokens, cache.page_size)
        except ValueError:  # an id outside 0..2**32-1 on its path (keys hash u32 ids): never spilled
            return DropReason.UNNAMEABLE
        default_tenant = tenant_of(node.key.extra_key, node.key.cache_salt) == b""  # others: no ids on disk
        extent = cache.controller.store(key, parent_key, tokens, node.value, default_tenant, aliases,
                                        background, node.key.cache_salt, yields)  # fmt: skip
        if isinstance(extent, Refused):
            return DropReason.TOO_LARGE if extent is Refused.TOO_LARGE else DropReason.STAGING_FULL
        return SpillRef(extent, 0, len(node.value))

    def drop_node(self, node: TreeNode, reason: DropReason) -> int:
        """Drop resident `node` (with its subtree) for `reason`; the tokens dropped."""
        dropped = self.cache.tree.drop(node)
        self.cache.spill_metrics.drop(dropped, reason)
        return dropped

    def node_keys(self, node: TreeNode) -> tuple[ExtentKey, ExtentKey]:
        """(path key of the tokens before `node`, extent key of `node`'s own tokens after them)."""
        hasher = self.cache.path_hasher(node.key)
        for part in self.cache.tree.tokens_before(node):
            hasher.update(part)
        parent = hasher.key()
        return parent, chain_key(self.cache.namespace_id, parent, node.key.raw_token_ids())

    # ---- insert → adoption, write-through ----------------------------------------------------

    def adopt(self, node: TreeNode, key: RadixKey, value: Any) -> list[TreeNode]:
        """Before sglang's insert of `key` below `node`: the spilled nodes on its path adopt the
        request's slots `value`; returns them (the tail of the matched prefix, which now owns the
        request's slots: the caller must not report their tokens as duplicates)."""
        pos, chain = self._spilled_on_path(node, key)
        slices = []
        for spilled in chain:
            slices.append(value[pos : pos + len(spilled.key)].clone())
            pos += len(spilled.key)
        self.cache.tree.mark_resident(chain, slices)
        return chain

    def _spilled_path_dropped(self, node: TreeNode, key: RadixKey) -> tuple[int, list[TreeNode]]:
        """An insert could not adopt the spilled nodes on its path: the first of them goes, with its
        subtree, so sglang's insert then finds only resident nodes there. Walks with dict lookups
        only, none of our helpers."""
        page_size = self.cache.page_size
        while len(key) > 0:
            child = node.children.get(key.child_key(page_size))
            if child is None:
                break
            if child.evicted:
                self.cache.tree.prune(child)
                break
            n = child.key.match(key, page_size=page_size)
            if n < len(child.key):  # the path leaves the tree inside a resident node
                break
            node, key = child, key[n:]
        return 0, []

    @contained("insert (adopting spilled nodes)", _spilled_path_dropped)
    def _spilled_on_path(self, node: TreeNode, key: RadixKey) -> tuple[int, list[TreeNode]]:
        return self.cache.tree.spilled_on_path(node, key)

    @contained("insert (write-through)", nothing)
    def write_through(self, node: TreeNode) -> None:
        """Write the resident path to `node` that has no copy on the tier (clean_copies.py)."""
        self.cache.clean.write_through(node)
