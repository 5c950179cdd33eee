"""Restoring: a restore's slots taken from the pool and filled with its verified KV, all or nothing.

- **Slots** (`open_restore`): allocated (evicting for room with the restore's anchor locked, and the
  chain checked again after) and registered at once in the controller's restores table, which owns
  them until the tree nodes take them (`restore`) or the restore is dropped: a fault anywhere in
  between frees them (docs/DESIGN.md, "Controller, tree, cache").
- **Whole** (`restore`): every read the restore needs completed and verified, the rest unpacked, the
  slots handed to the nodes; with TP > 1 only where every rank succeeded.
- **Streaming** (`stream`): while admission is deferred for reads, what landed is unpacked into the
  restore's slots and reads unpacked whole go back to staging, so a restore larger than staging
  streams through it (docs/DESIGN.md, "Restores stream through staging").
Which restore runs, when, and how long it may wait is admission's (admission.py); layer-wise
restores take their slots here too (layerwise_flow.py).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult
from sglang.srt.mem_cache.radix_cache import TreeNode

from sgl_hicache.cache.guard import GuardedPart, contained, nothing
from sgl_hicache.cache.owning_cache import OwningCache
from sgl_hicache.cache.reads import Readiness
from sgl_hicache.cache.spill_state import SpillRef

ANONYMOUS = "sgl-hicache:restore"  # the owner of a restore whose request has no id (never deferred)


def owner_of(rid: str | None) -> object:
    """The key of request `rid`'s restore in the controller's restores table."""
    return rid if rid is not None else ANONYMOUS


class RestoringCache(OwningCache, Protocol):
    """What restoring needs of the cache (`SpillRadixCache` is one)."""

    root_node: TreeNode
    token_to_kv_pool_allocator: Any

    def evict(self, params: EvictParams) -> EvictResult: ...

    def inc_lock_ref(self, node: TreeNode) -> Any: ...

    def dec_lock_ref(self, node: TreeNode) -> Any: ...


class Restoring(GuardedPart[RestoringCache]):
    def restore(self, nodes: list[TreeNode], rid: str | None, anchor: TreeNode | None) -> bool:
        """All or nothing; every rank verified its bytes, or all recompute. The restore's slots are
        the table's until the nodes take them, so a fault anywhere frees them (the fallback drops
        the owner's restore)."""
        cache = self.cache
        assert cache.controller is not None
        ctl, owner = cache.controller, owner_of(rid)
        refs = tuple(node.spill for node in nodes)
        t0 = time.perf_counter()
        opened = ctl.restores.current(owner, refs) is not None or self.open_restore(
            owner, nodes, refs, anchor
        )
        if not opened:
            cache.spill_metrics.inc("restore_failures")
            ctl.finish_reads(refs, owner)  # release their staging now, not after the TTL
        ok = opened and self._complete(owner)
        if not cache.agreement.all_ok(ok):
            ctl.restores.drop(owner)
            cache.spill_metrics.inc("tp_disagreements", int(ok))
            return False
        progress = ctl.restores.get(owner)
        assert progress is not None  # agreed ok implies this rank's ok
        cache.spill_metrics.observe_restore(time.perf_counter() - t0)
        ctl.count_restored(progress)
        values = [slots.clone() for _, _, slots in progress.parts()]
        ctl.restores.hand_over(owner)
        try:
            cache.tree.mark_resident(nodes, values)
        except BaseException:  # those marked keep their verified KV; the others' slots are freed
            for node, value in zip(nodes, values, strict=True):
                if node.evicted:
                    cache.token_to_kv_pool_allocator.free(value)
            raise
        return True

    def _not_completed(self, owner: object) -> bool:
        """A restore that failed midway: all or nothing, so nothing (its slots stay in the table,
        which the agreement's verdict then frees)."""
        return False

    @contained("init_load_back (restore)", _not_completed)
    def _complete(self, owner: object) -> bool:
        return self.cache.controller is not None and self.cache.controller.complete(owner)

    def open_restore(self, owner: object, nodes: list[TreeNode], refs: tuple[SpillRef, ...],
                     anchor: TreeNode | None) -> bool:  # fmt: skip
        """Allocate the restore's slots and register them (the table owns them from here); False
        when the pool cannot hold them, or the chain changed while room was made."""
        cache = self.cache
        assert cache.controller is not None
        slots = self._alloc_slots(sum(ref.count for ref in refs), anchor)
        if slots is None:
            return False
        if cache.controller is None or not all(  # None: the eviction that made room disabled spill
            node.evicted and node.spill is ref and cache.tree.attached(node)
            for node, ref in zip(nodes, refs, strict=True)
        ):
            cache.token_to_kv_pool_allocator.free(slots)
            return False
        cache.controller.restores.open(owner, refs, slots)
        return True

    def _alloc_slots(self, n: int, anchor: TreeNode | None = None) -> torch.Tensor | None:
        """n fresh slots, evicting to make room (with `anchor`'s path locked: the restore's chain
        hangs from it), or None."""
        cache = self.cache
        allocator = cache.token_to_kv_pool_allocator
        if allocator.available_size() < n:
            lock = anchor is not None and anchor is not cache.root_node
            if lock:
                cache.inc_lock_ref(anchor)
            try:
                cache.evict(EvictParams(num_tokens=n - allocator.available_size()))
            finally:
                if lock:
                    cache.dec_lock_ref(anchor)
        return allocator.alloc(n) if allocator.available_size() >= n else None

    # ---- streaming: a deferred restore's progress -------------------------------------------

    def stream(self, nodes: list[TreeNode], rid: str, anchor: TreeNode | None, ready: Readiness) -> None:
        """A deferred restore's progress: what landed is unpacked into its slots and the reads of
        extents unpacked whole go back to staging, so the next attempt starts the reads that found
        no room (docs/DESIGN.md, "Restores stream through staging"). On one rank the slots are taken
        at the first attempt that finds bytes landed (a local moment); with TP > 1 they are taken
        only where every rank agreed the restore must stream (taking slots may evict: the ranks'
        trees must stay equal), and unpacking into them is then each rank's own."""
        if self.cache.agreement.size == 1:
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
        ctl = self.cache.controller
        assert ctl is not None
        refs = tuple(node.spill for node in nodes)
        opened = ctl.restores.current(rid, refs) is not None
        if not opened and not (ctl.reads.landed_tokens(refs) and self.open_restore(rid, nodes, refs, anchor)):
            return
        ctl.unpack_landed(rid)
        self._give_back(rid, ready)

    def _give_back(self, rid: str, ready: Readiness) -> None:
        """The reads `rid`'s restore unpacked whole go back to staging when room is short: its own
        reads did not all start, or another restore waits for room. Otherwise they stay until it
        completes (another restore of the same extents may still use them)."""
        ctl = self.cache.controller
        assert ctl is not None
        if ready is Readiness.STREAMING or ctl.reads.room_wanted:
            ctl.release_unpacked(rid)

    def _open_agreed(self, nodes: list[TreeNode], rid: str, anchor: TreeNode | None) -> None:
        """TP > 1: every rank takes the streaming restore's slots in the same attempt, or none keeps them."""
        cache = self.cache
        ctl = cache.controller
        assert ctl is not None
        if ctl.restores.current(rid, tuple(node.spill for node in nodes)) is not None:
            return
        ok = self._try_open(nodes, rid, anchor)
        if not cache.agreement.all_ok(ok) and cache.controller is not None:
            cache.spill_metrics.inc("tp_disagreements", int(ok))
            cache.controller.restores.drop(rid)

    def _not_opened(self, *_args: Any) -> bool:
        """A streaming restore's slots could not be taken: none kept (the agreement then frees any)."""
        return False

    @contained("init_load_back (streaming slots)", _not_opened)
    def _try_open(self, nodes: list[TreeNode], rid: str, anchor: TreeNode | None) -> bool:
        return self.open_restore(rid, nodes, tuple(node.spill for node in nodes), anchor)

    @contained("init_load_back (early unpack)", nothing)
    def _unpack_opened(self, nodes: list[TreeNode], rid: str, ready: Readiness) -> None:
        """TP > 1: unpack into `rid`'s open restore what landed (copies only: the tree is untouched)."""
        ctl = self.cache.controller
        assert ctl is not None
        if ctl.restores.current(rid, tuple(node.spill for node in nodes)) is not None:
            ctl.unpack_landed(rid)
            self._give_back(rid, ready)
