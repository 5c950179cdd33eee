"""KV cache events that stay true when nodes spill to the tier (issue 27, "Tier-aware routing").

sglang publishes `BlockStored` / `BlockRemoved` / `AllBlocksCleared`, one hash per page, from its
radix cache's recorder (`kv_events`, taken by `take_events()` each scheduler round and sent on
`--kv-events-config`'s ZMQ socket). A KV-aware router indexes them per worker and per medium (smg's
relay keeps one record per hash and tier). sglang's plain cache removes an evicted page; ours keeps
it on the tier, so:

- every node's pages are announced under exactly one medium, the node's state: `GPU` while
  resident, the tier's medium while spilled (`node.kv_medium`: what the router was last told; None:
  nothing). The tier's medium is `DISK`, or `CPU_PINNED` with `--hicache-spill-kv-events-medium
  cpu_pinned`, for a router that indexes only device and host blocks (smg 1.13);
- a spill stores the tier's medium, then removes GPU; a restore or an insert adopting a spilled
  node stores GPU, then removes the tier's (a store before its removal: the router never sees the
  pages nowhere);
- a node that leaves the tree (dropped, pruned: lost, evicted from the tier, a TP disagreement)
  is removed under its medium, with its spilled subtree;
- a reset (a flush: a new key epoch) is sglang's `AllBlocksCleared`; the extents a warm start
  attaches after it are stored under the tier's medium.

Hashes are sglang's own: its recorder computes each page's hash from the node's tokens and its
parent's last page hash, as for its plain tree (tests/cache/test_events.py checks they are equal).
A split announces nothing: pages keep their hashes, the new head takes its child's medium.

`GoneExtents` finds the spilled nodes whose extent the tier evicted (reported by
`Tier.take_evicted`, on the scheduler thread) or whose write failed, without walking the tree, so
that the cache prunes them (and their removal is published) at the start of its next match.
"""

from __future__ import annotations

import weakref
from typing import Any

from sglang.srt.disaggregation.kv_events import StorageMedium
from sglang.srt.mem_cache.events import KVCacheEventRecorder
from sglang.srt.mem_cache.radix_cache import RadixCache, TreeNode

from sgl_hicache.cache.spill_state import Extent, ExtentState
from sgl_hicache.config import KvEventsMedium
from sgl_hicache.tier import ExtentKey, Tier

DEVICE = StorageMedium.GPU
TIER = StorageMedium.DISK  # the file tier: an NVMe / NVMe-oF directory
# the medium of spilled nodes, by `kv_events_medium` (`StorageMedium.CPU` is `CPU_PINNED` on the wire)
TIER_MEDIA = {KvEventsMedium.DISK: TIER, KvEventsMedium.CPU_PINNED: StorageMedium.CPU}


def medium_of(node: TreeNode) -> str | None:
    """The medium `node`'s pages were last announced under (None: not announced, or removed)."""
    return getattr(node, "kv_medium", None)


class TierEvents(KVCacheEventRecorder):
    """sglang's recorder, made idempotent per node and medium: storing a node under the medium it
    is announced under, or removing it under another, publishes nothing; storing it under a new
    medium removes the old one after. So sglang's own calls (its insert's store, its eviction's
    removal) and ours compose, whatever the order. Disabled: nothing is recorded or tracked."""

    def __init__(self, base: KVCacheEventRecorder) -> None:
        super().__init__(enabled=base.enabled, page_size=base.page_size,
                         dynamo_format=base.dynamo_format, lora_names=base.lora_names)  # fmt: skip
        for event in base.take():
            self.enqueue(event)

    def record_store(self, node: Any, medium: Any = None, *, session_id: str | None = None) -> None:
        medium = medium or DEVICE
        before = medium_of(node)
        if not self.enabled or before == medium:
            return
        super().record_store(node, medium, session_id=session_id)
        node.kv_medium = medium
        if before is not None:
            super().record_remove(node, before)

    def record_remove(self, node: Any, medium: Any = None) -> None:
        if not self.enabled or medium_of(node) != (medium or DEVICE):
            return
        super().record_remove(node, medium or DEVICE)
        node.kv_medium = None

    def removed(self, node: TreeNode) -> None:
        """`node` and its subtree leave the tree: each is removed under its medium."""
        stack = [node]
        while self.enabled and stack:
            node = stack.pop()
            medium = medium_of(node)
            if medium is not None:
                self.record_remove(node, medium)
            stack.extend(node.children.values())


class GoneExtents:
    """Which spilled nodes point into each extent, to find those whose extent is gone.

    Scheduler thread only. Nodes are held weakly (a pruned node is not kept alive). An extent is
    gone when its write failed (LOST) or the tier reported evicting its key and does not hold it
    again (a store of the same key may have published it since: then it is kept)."""

    def __init__(self) -> None:
        self._nodes: dict[ExtentKey, weakref.WeakSet[TreeNode]] = {}
        self._writing: list[Extent] = []
        self._suspects: set[ExtentKey] = set()
        self._sweep_at = 1024

    def spilled(self, node: TreeNode) -> None:
        """`node` is spilled now, into `node.spill.extent`."""
        extent: Extent = node.spill.extent
        self._nodes.setdefault(extent.key, weakref.WeakSet()).add(node)
        if extent.state is ExtentState.WRITING:
            self._writing.append(extent)
        if len(self._nodes) >= self._sweep_at:
            self._sweep()

    def collect(self, tier: Tier) -> None:
        """Take the tier's evictions and the writes that failed since the last call. Never blocks."""
        for key in tier.take_evicted():
            if key in self._nodes:
                self._suspects.add(key)
        writing = []
        for extent in self._writing:
            if extent.state is ExtentState.LOST:
                self._suspects.add(extent.key)
            elif extent.state is ExtentState.WRITING:
                writing.append(extent)
        self._writing = writing

    def take(self, tier: Tier) -> list[TreeNode]:
        """The spilled nodes whose extent is gone, found since the last call (the caller prunes
        the attached ones)."""
        gone = []
        for key in self._suspects:
            nodes = self._nodes.get(key, ())
            gone += [
                n for n in nodes if n.evicted and n.spill.extent.key == key and _gone(n.spill.extent, tier)
            ]
        self._suspects.clear()
        return gone

    def clear(self) -> None:
        """The tree was emptied (a reset)."""
        self._nodes.clear()
        self._writing.clear()
        self._suspects.clear()

    def _sweep(self) -> None:
        """Forget extents no live node points into; the next sweep when twice as many are known."""
        self._nodes = {key: nodes for key, nodes in self._nodes.items() if len(nodes)}
        self._sweep_at = max(1024, 2 * len(self._nodes))


def _gone(extent: Extent, tier: Tier) -> bool:
    return extent.state is ExtentState.LOST or (
        extent.state is ExtentState.ON_TIER and not tier.contains(extent.key)
    )


class TreeEvents:
    """What `SpillTree` tells the router and `GoneExtents` of each change it makes. Spilled nodes are
    announced under `tier_medium`, the `kv_events_medium` of the cache's config."""

    def __init__(self, base: RadixCache, medium: KvEventsMedium = KvEventsMedium.DISK) -> None:
        self.base = base
        self.gone = GoneExtents()
        self.tier_medium = TIER_MEDIA[medium]

    @property
    def recorder(self) -> TierEvents | None:
        recorder = getattr(self.base, "kv_events", None)  # set by sglang's constructor, after the tree
        return recorder if isinstance(recorder, TierEvents) else None

    def spilled(self, node: TreeNode) -> None:
        self.gone.spilled(node)
        if self.recorder is not None:
            self.recorder.record_store(node, self.tier_medium)

    def resident(self, node: TreeNode) -> None:
        if self.recorder is not None:
            self.recorder.record_store(node, DEVICE)

    def removed(self, node: TreeNode) -> None:
        if self.recorder is not None:
            self.recorder.removed(node)

    def split(self, head: TreeNode, child: TreeNode) -> None:
        """`head` took the first pages of `child`: announced as they were, under the same medium."""
        if medium_of(child) is not None:
            head.kv_medium = medium_of(child)
        if head.evicted:
            self.gone.spilled(head)
