"""Clean copies: resident nodes that already have an exact copy on the tier, so that evicting them
only points at their extent (no pack, no write on the critical path of the request that needs the
room).

A node is clean when its `spill` reference covers exactly its tokens and the extent is still
stored (`is_clean`): in staging on its way, or on the tier where only this process could have
evicted it. Three things make clean nodes, all in the background (write-through's share of
staging, `SpillController.store(background=True)`), none of them changing the tree's structure (so
TP ranks whose writes differ still hold identical trees; an eviction agrees on each spill as
before):
- a restore (the nodes keep the range they were restored from: restores.py);
- **write-through** (`write_through`, at insert under `WritePolicy.WRITE_THROUGH`): the resident
  path from the root down;
- **clean-ahead** (`clean_ahead`, from the idle hook) under write-back on a root only we use: the
  coldest evictable nodes, in sglang's eviction order, until they and the free slots make
  `SpillConfig.clean_ahead` of the device pool.
Neither writes a node the write admission rule does not admit (write_admission.py): its eviction
would drop it.
The cache calls these through guarded methods (guard.py: `Spilling.write_through`,
`SpillRadixCache.clean_ahead`): nothing here is called by sglang.
"""

from __future__ import annotations

import heapq
import time
from typing import Any, Protocol

from sglang.srt.mem_cache.radix_cache import TreeNode

from sgl_hicache.cache.controller import SpillController
from sgl_hicache.cache.metrics import DropReason, SpillMetrics
from sgl_hicache.cache.retention import Retention
from sgl_hicache.cache.spill_state import ExtentState, SpillRef
from sgl_hicache.cache.staging_share import Refused
from sgl_hicache.cache.write_admission import WriteAdmission
from sgl_hicache.config import SpillConfig, WritePolicy

LOOK_EVERY_S = 0.1  # an idle loop spins: look for victims to write ahead at most this often


class CleanCopiesCache(Protocol):
    """What clean copies need of the cache (`SpillRadixCache` is one)."""

    controller: SpillController | None
    spill_config: SpillConfig
    spill_metrics: SpillMetrics
    retention: Retention
    write_admission: WriteAdmission
    root_node: TreeNode
    token_to_kv_pool_allocator: Any
    eviction_strategy: Any
    evictable_leaves: Any
    disable: bool

    def store_node(self, node: TreeNode, background: bool = False) -> SpillRef | DropReason: ...

    def too_short(self, node: TreeNode, pin: object) -> bool: ...


class CleanCopies:
    def __init__(self, cache: CleanCopiesCache) -> None:
        self.cache = cache
        self._looked_at = 0.0  # when `clean_ahead` last looked (monotonic)
        self._changes = 0  # inserts and splits so far: what can leave a resident node unwritten
        self._walked_changes = -1  # `_changes` when `clean_ahead` last walked to its end

    def changed(self) -> None:
        """The tree gained or split a resident node (an insert, a split): it may have no copy."""
        self._changes += 1

    def root_shared(self) -> bool:
        """Whether other servers may use the tier's root (evict our files, hold extents a lookup
        can find): write-through assumes so; otherwise once the tier has seen one (`Tier.shared`)."""
        ctl = self.cache.controller
        assert ctl is not None
        shared = self.cache.spill_config.write_policy is WritePolicy.WRITE_THROUGH
        return shared or bool(getattr(ctl.tier, "shared", False))

    def is_clean(self, node: TreeNode) -> bool:
        """Whether resident `node` has an exact copy that its eviction may simply point to: in
        staging on its way, or on the tier where only this process could have evicted it. Where
        another process may evict our files (the root is shared, as write-through assumes), an
        index entry proves nothing, so the node is stored again: the tier writes nothing when the
        file is still there (it only refreshes its age), and writes it anew when it is gone."""
        ref: SpillRef | None = getattr(node, "spill", None)
        ctl = self.cache.controller
        if ref is None or ref.count != len(node.value) or ctl is None:
            return False
        if ref.extent.state is ExtentState.ON_TIER and self.root_shared():
            return False
        return ctl.still_stored(ref.extent)

    def write_through(self, node: TreeNode) -> None:
        """Write the resident nodes from the root to `node` that have no copy on the tier, top down,
        and keep them resident with a clean reference. Stops at the first that cannot be written
        (write-through's share of staging full) or is not admitted (write_admission.py): its
        descendants' extents would follow a gap no warm start or lookup can cross."""
        cache, ctl = self.cache, self.cache.controller
        if cache.disable or ctl is None:
            return
        todo = []
        while node is not cache.root_node and not node.evicted:
            ref: SpillRef | None = getattr(node, "spill", None)
            if ref is None or ref.count != len(node.value) or not ctl.still_stored(ref.extent):
                todo.append(node)
            node = node.parent
        for node in reversed(todo):
            if cache.write_admission.reason(node) is None:
                return
            if self._write(node, "written_through_tokens") is not None:
                return

    def clean_ahead(self) -> None:
        """Write-back on a root only we use, while no request runs or waits (the idle hook calls
        this only then: on the CPU the packs are copies on the scheduler thread): write the coldest
        evictable nodes that have no copy on the tier, in sglang's eviction order (a parent after
        its last child), until they and the free slots make `clean_ahead` of the device pool,
        within write-through's share of staging (a node larger than that share is left to its
        eviction). Not on a shared root (an eviction there stores again anyway: another process may
        have evicted the file) nor under write-through (done at insert)."""
        cache = self.cache
        now = time.monotonic()
        share = cache.spill_config.clean_ahead
        if (
            cache.disable
            or cache.controller is None
            or share <= 0
            or now - self._looked_at < LOOK_EVERY_S
            or self._changes == self._walked_changes  # the last walk left nothing to write since
        ):
            return
        self._looked_at = now
        if cache.spill_config.write_policy is not WritePolicy.WRITE_BACK or self.root_shared():
            return
        allocator, priority = cache.token_to_kv_pool_allocator, cache.eviction_strategy.get_priority
        room, target = allocator.available_size(), int(share * allocator.size)
        changes = self._changes
        heap = [(priority(n), id(n), n) for n in cache.evictable_leaves]
        heapq.heapify(heap)
        unseen: dict[int, int] = {}  # per parent: its resident children not walked yet
        while room < target and heap:
            _, _, node = heapq.heappop(heap)
            written = self._write_ahead(node)
            if written is DropReason.STAGING_FULL:
                return  # the next look goes on, once writes in flight gave staging back
            if written is None:
                room += len(node.value)
            parent = node.parent
            if parent is cache.root_node or parent.evicted or parent.lock_ref > 0:
                continue
            left = unseen.get(id(parent), sum(not c.evicted for c in parent.children.values())) - 1
            unseen[id(parent)] = left
            if left == 0:  # its last child walked: eviction would take it next
                heapq.heappush(heap, (priority(parent), id(parent), parent))
        self._walked_changes = changes

    def _write_ahead(self, node: TreeNode) -> DropReason | None:
        """Give resident `node` a clean copy on the tier (None: it has one now, or its eviction will
        drop it anyway: too short, or not admitted), or say why it has none: STAGING_FULL (not now:
        the walk stops), TOO_LARGE (larger than write-through's share of staging: written at its
        eviction), or why it cannot be stored at all."""
        cache, ctl = self.cache, self.cache.controller
        assert ctl is not None
        if self.is_clean(node) or cache.too_short(node, cache.retention.pin_of(node)):
            return None
        if cache.write_admission.reason(node) is None:
            return None
        refused = ctl.background_fit(len(node.value))
        if refused is not None:
            return DropReason.TOO_LARGE if refused is Refused.TOO_LARGE_FOR_SHARE else DropReason.STAGING_FULL
        return self._write(node, "written_ahead_tokens")

    def _write(self, node: TreeNode, counter: str) -> DropReason | None:
        """Write resident `node` to the tier in the background and keep it resident with a clean
        reference, counted in `counter`; or why it was not written."""
        ref = self.cache.store_node(node, background=True)
        if isinstance(ref, DropReason):
            return ref
        node.spill = ref
        self.cache.spill_metrics.inc(counter, ref.count)
        return None
