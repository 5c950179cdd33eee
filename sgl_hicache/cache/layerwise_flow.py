"""The cache's side of layer-wise restores (`--hicache-spill-layerwise`; the table and its waits:
layerwise.py): when one is admitted, how it ends, and what a failed one leaves behind.

- **Admitted** (`ready`, `restore`): a restore whose every read has landed its first layer group is
  admitted at once: its slots go to the nodes (locked until it settles), what landed is unpacked,
  and the rest as the forward reaches each group (`wait_layer`, through the KV pool's
  `LayerCounter`). All or nothing across TP ranks, as a whole restore (restoring.py).
- **Ended** (`after_forward`, the scheduler's post-forward hook): every restore of the forward
  settles or fails; one that failed on any TP rank fails on all; the requests whose prefix holds a
  failed restore's nodes are named for retraction (they read KV that is not what the tree says).
- **Failed** (`_failed_one`, `drop_failed`): its nodes are never matched (`layerwise_poisoned`),
  taken out of the tree at the post-forward step, where every rank has the same failures
  (`SpillTree.detach`), and freed once no request holds them.
Nothing here raises into sglang: an error of ours fails every restore in progress.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from sglang.srt.mem_cache.radix_cache import TreeNode

from sgl_hicache.cache.controller import SpillController
from sgl_hicache.cache.guard import GuardedPart, contained, internal_error
from sgl_hicache.cache.layerwise import LayerCounter, Layerwise, LayerwiseRestore
from sgl_hicache.cache.owning_cache import OwningCache
from sgl_hicache.cache.reads import Readiness
from sgl_hicache.cache.restores import RestoreProgress
from sgl_hicache.cache.restoring import Restoring, owner_of


class LayerwiseFlowCache(OwningCache, Protocol):
    """What layer-wise restores need of the cache (`SpillRadixCache` is one)."""

    root_node: TreeNode
    token_to_kv_pool_allocator: Any

    def inc_lock_ref(self, node: TreeNode) -> Any: ...

    def dec_lock_ref(self, node: TreeNode) -> Any: ...


class LayerwiseFlow(GuardedPart[LayerwiseFlowCache]):
    def __init__(self, cache: LayerwiseFlowCache, restoring: Restoring) -> None:
        super().__init__(cache)
        self.restoring = restoring
        self.table: Layerwise | None = None  # the restores in progress (None: layer-wise restore off)
        self.failed: list[LayerwiseRestore] = []  # failed: their nodes go once unlocked
        self._waiting_layer = False  # inside the forward's wait (no advance from a nested poll)

    def start(self, ctl: SpillController) -> None:
        """The table of layer-wise restores, and the counter sglang's KV pool consults before
        attention reads a layer (`register_layer_transfer_counter`, as HiCache's)."""
        self.table = Layerwise(
            ctl.layout.group_of, ctl.timeout_s, self.cache.spill_metrics,
            unpack=lambda progress, fence: ctl.unpack_landed(None, progress, fence),
            failed=self._read_failed, poll=ctl.poll, forward_waits=ctl.engine.forward_waits,
            settle=self._settled, fail=self._failed_one,
        )  # fmt: skip
        kv = self.cache.token_to_kv_pool_allocator.get_kvcache()
        kv.register_layer_transfer_counter(LayerCounter(len(ctl.view.layers), self.wait_layer))

    def forget(self) -> None:
        """The tree is empty (a reset): no layer-wise restore is left to end (sglang resets when idle)."""
        if self.table is not None:
            self.table.active, self.table.ended = [], []
        self.failed = []

    def advance(self) -> None:
        """The scheduler's poll: unpack what landed (never from inside the forward's wait)."""
        if self.table is not None and not self._waiting_layer:
            self.table.advance()

    def detached_nodes(self) -> list[TreeNode]:
        """The nodes of failed restores taken out of the tree that requests still hold."""
        return [node for r in self.failed for node in r.detached or ()]

    # ---- admission ---------------------------------------------------------------------------

    def _pending(self, nodes: list[TreeNode], ready: Readiness) -> Readiness:
        """Layer-wise readiness could not be judged: the restore waits for all its bytes, as without."""
        return Readiness.PENDING if ready is Readiness.LAYERWISE else ready

    @contained("init_load_back (layer-wise readiness)", _pending)
    def ready(self, nodes: list[TreeNode], ready: Readiness) -> Readiness:
        """PENDING becomes LAYERWISE (with layer-wise restore on) once every read of the restore has
        landed its first layer group: the prefill may start, each layer waiting for its own."""
        ctl = self.cache.controller
        if ready is not Readiness.PENDING or self.table is None or ctl is None:
            return ready
        refs = [node.spill for node in nodes]
        if ctl.reads.landed_tokens(refs, group=0) == sum(ref.count for ref in refs):
            return Readiness.LAYERWISE
        return ready

    def restore(self, nodes: list[TreeNode], rid: str | None, anchor: TreeNode | None) -> bool:
        """Admit the restore of `nodes` before its later layer groups landed: its slots go to the
        nodes now (locked until it settles), what landed is unpacked, and the rest is unpacked as
        the forward reaches each group (`wait_layer`). All or nothing across TP ranks, as
        `Restoring.restore`: a rank that cannot take its slots makes every rank recompute."""
        cache = self.cache
        assert cache.controller is not None and self.table is not None
        ctl, owner = cache.controller, owner_of(rid)
        refs = tuple(node.spill for node in nodes)
        opened = ctl.restores.current(owner, refs) is not None or self.restoring.open_restore(
            owner, nodes, refs, anchor
        )
        ok = opened and self._unpack_start(owner)
        if not cache.agreement.all_ok(ok):
            cache.spill_metrics.inc("restore_failures")
            ctl.restores.drop(owner)
            ctl.finish_reads(refs, owner)
            cache.spill_metrics.inc("tp_disagreements", int(ok))
            return False
        progress = ctl.restores.get(owner)
        assert progress is not None  # agreed ok implies this rank's ok
        fence = ctl.engine.fence()  # every forward that could write these slots is before it
        landed = next((g for g in range(progress.groups) if not progress.group_done(g)), progress.groups)
        values = [slots.clone() for _, _, slots in progress.parts()]
        ctl.restores.hand_over(owner, landing=True)
        try:
            cache.tree.mark_resident(nodes, values)
        except BaseException:  # those marked keep their KV's slots: they are dropped as failed below
            ctl.restores.landed(progress)
            for node, value in zip(nodes, values, strict=True):
                if node.evicted:
                    cache.token_to_kv_pool_allocator.free(value)
            raise
        cache.inc_lock_ref(nodes[-1])  # never evicted (packed) nor dropped while it lands
        self.table.start(owner, nodes, progress, fence, landed)
        return True

    def _not_started(self, owner: object) -> bool:
        """The first unpack failed: nothing admitted (the agreement's verdict frees the slots)."""
        return False

    @contained("init_load_back (layer-wise unpack)", _not_started)
    def _unpack_start(self, owner: object) -> bool:
        assert self.cache.controller is not None
        self.cache.controller.unpack_landed(owner)
        return True

    # ---- while the forward runs --------------------------------------------------------------

    def _read_failed(self, progress: RestoreProgress) -> str | None:
        """Why a read the restore still needs can never land (None while all may). A ref unpacked
        whole needs none: its bytes are in the slots (a write's staging, unpacked at admission and
        given back when the write completed, has no read to ask about)."""
        assert self.cache.controller is not None
        for i, ref, _ in progress.parts():
            if not progress.ref_done(i) and self.cache.controller.reads.failed(ref.extent):
                return f"read of extent {ref.extent.key.hex()} failed"
        return None

    def _settled(self, restore: LayerwiseRestore) -> None:
        """Every group unpacked: the reads' staging goes back, later forwards wait for the last copy,
        and the nodes are ordinary resident nodes (their lock released)."""
        ctl = self.cache.controller
        if ctl is not None:
            ctl.engine.forward_waits(restore.progress.last_copy)
            ctl.restores.landed(restore.progress)
            ctl.reads.count_read_span({id(ref.extent) for ref in restore.progress.refs})
            ctl.finish_reads(restore.progress.refs, restore.owner)
        self.cache.spill_metrics.observe_restore(time.monotonic() - restore.progress.started)
        self._unlock(restore)

    def _failed_one(self, restore: LayerwiseRestore) -> None:
        """A group cannot land: nothing more is unpacked; its nodes stay locked and are never
        matched (`poisoned`) until `after_forward` takes them out of the tree (`_detach_failed`) and
        has their readers retracted; `drop_failed` frees them once nobody holds them."""
        ctl = self.cache.controller
        if ctl is not None:
            ctl.engine.forward_waits(ctl.engine.load_barrier())
            ctl.restores.landed(restore.progress)
            ctl.finish_reads(restore.progress.refs, restore.owner)
        self.cache.spill_metrics.inc("restore_failures")
        self.cache.spill_metrics.inc("layerwise_failed_restores")
        self._poison(restore)

    def _poison(self, restore: LayerwiseRestore) -> None:
        for node in self._chain(restore):
            node.layerwise_poisoned = True
        if restore not in self.failed:
            self.failed.append(restore)

    def _unlock(self, restore: LayerwiseRestore) -> None:
        if not restore.unlocked:
            restore.unlocked = True
            self.cache.dec_lock_ref(restore.nodes[-1])

    def _chain(self, restore: LayerwiseRestore) -> list[TreeNode]:
        """The nodes holding the restore's slots now: its chain, with any node split from one since."""
        return self.cache.tree.path_up(restore.nodes[-1], restore.anchor) or list(restore.nodes)

    def wait_layer(self, layer: int) -> None:
        """sglang's KV pool, before attention reads local layer `layer` (`LayerCounter`): every
        layer-wise restore in progress has that layer's group unpacked (or failed). Never raises:
        an error of ours fails every restore in progress (their requests recompute)."""
        table = self.table
        if table is None or not table.active:
            return
        self._waiting_layer = True
        try:
            table.wait_layer(layer)
        except Exception:
            internal_error(self, "layer-wise wait")
            self.fail_all()
        finally:
            self._waiting_layer = False

    def fail_all(self) -> None:
        """Every restore in progress fails (an error of ours, or spill disabled): their requests
        are retracted."""
        assert self.table is not None
        try:
            self.table.fail_all("internal error")
        except Exception:
            internal_error(self, "layer-wise wait (failing its restores)")
            for restore in self.table.active:  # at least never served: retracted, dropped
                restore.failed = restore.failed or "internal error"
                self._poison(restore)
                if self.cache.controller is not None:  # its reads go with their last user or their TTL
                    self.cache.controller.restores.landed(restore.progress)
                self.table.ended.append(restore)
            self.table.active = []

    # ---- after the forward -------------------------------------------------------------------

    def after_forward(self, reqs: list[Any]) -> list[Any]:
        """`SpillRadixCache.after_forward` (see there)."""
        cache, table = self.cache, self.table
        if table is None:
            return []
        try:
            table.settle_all()
        except Exception:
            internal_error(self, "after forward (layer-wise settle)")
            self.fail_all()
        ended = table.take_ended()
        if ended:
            ok = [int(r.failed is None) for r in ended]
            agreed = cache.agreement.min(ok) if cache.agreement.size > 1 else ok
            for restore, mine, all_ok in zip(ended, ok, agreed, strict=True):
                if mine and not all_ok:  # another rank's failed: this rank's KV is right, but all retract
                    cache.spill_metrics.inc("tp_disagreements")
                    restore.failed = "failed on another TP rank"
                    self._poison(restore)
                elif all_ok and cache.controller is not None:  # settled on every rank: restored
                    cache.controller.count_restored(restore.progress)
        if not self.failed:
            return []
        self._detach_failed()
        poisoned = {id(node) for r in self.failed for node in self._chain(r)}
        affected = [req for req in reqs if self._path_holds(getattr(req, "last_node", None), poisoned)]
        cache.spill_metrics.inc("layerwise_retracted_requests", len(affected))
        return affected

    def _path_holds(self, node: TreeNode | None, ids: set[int]) -> bool:
        while node is not None and node is not self.cache.root_node:
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
        tree = self.cache.tree
        for restore in self.failed:
            if restore.detached is not None:
                continue
            top = self._chain(restore)[0]
            attached = tree.attached(top) and not top.evicted
            restore.detached = tree.detach(top) if attached else []

    def drop_failed(self) -> None:
        """`SpillRadixCache.drop_failed_layerwise` (see there)."""
        self._detach_failed()
        keep = []
        for restore in self.failed:
            self._unlock(restore)
            nodes = restore.detached or []
            if any(node.lock_ref > 0 for node in nodes):
                keep.append(restore)
                continue
            self.cache.spill_metrics.inc("layerwise_dropped_tokens", self.cache.tree.free_detached(nodes))
        self.failed = keep
