"""`SpillTree`: every mutation of sglang's radix tree that involves a *spilled* node, and its counter.

The tree is sglang's: `RadixCache`'s nodes, its root, its evictable/protected sizes and its leaf set
(`base`, the cache itself, seen only as sglang's `RadixCache`). What this object adds is the spilled
state and its one owner: a spilled node has `value is None` (sglang's own "evicted") and `spill`, a
`SpillRef` into an extent; `spilled_tokens` is their sum, and nothing else changes it. No I/O and no
policy here (the controller moves bytes, the cache decides).

Invariants (`check_integrity`):
- resident nodes form a root-closed subtree: every descendant of a spilled node is spilled;
- spilled tokens count in neither `evictable_size_` nor `protected_size_` (they hold no device
  memory), and `spill.count == len(node.key)`;
- every slot is owned once: by one resident node, or by a restore in progress, or by a node taken
  out of the tree while a request still holds it (`detach`), or free.

Order of every change that frees slots: the node is detached from its slots first, the slots are
freed last, so a fault midway leaks at worst (counted by `check_integrity`), and never frees a slot
a node still owns (which would hand one slot to two owners: wrong KV).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from sgl_hicache.cache.events import TreeEvents
from sgl_hicache.cache.spill_state import Extent, ExtentState, SpillRef
from sgl_hicache.config import KvEventsMedium
from sgl_hicache.tier.keys import ExtentKey
from sgl_hicache.tier.results import Segment


class SpillTree:
    def __init__(self, base: RadixCache, events_medium: KvEventsMedium = KvEventsMedium.DISK) -> None:
        self.base = base
        self.spilled_tokens = 0
        self.events = TreeEvents(base, events_medium)  # what the router is told of each change (events.py)

    @property
    def root(self) -> TreeNode:
        return self.base.root_node

    @property
    def page_size(self) -> int:
        return int(self.base.page_size)

    def cleared(self) -> None:
        """sglang's reset emptied the tree: no spilled node is left."""
        self.spilled_tokens = 0
        self.events.gone.clear()

    # ---- the one node factory, and the changes of state -------------------------------------

    def add_spilled(self, parent: TreeNode, key: RadixKey, ref: SpillRef) -> TreeNode:
        """A new spilled child of `parent` holding `key`, whose KV is `ref`."""
        assert ref.count == len(key), f"a ref of {ref.count} tokens for a node of {len(key)}"
        node = TreeNode()
        node.parent, node.key, node.value, node.spill = parent, key, None, ref
        parent.children[key.child_key(self.page_size)] = node
        self.spilled_tokens += ref.count
        self.events.spilled(node)
        return node

    def mark_spilled(self, node: TreeNode, ref: SpillRef) -> None:
        """Resident, unlocked `node` keeps its place as spilled, `ref` holding its KV; its slots are
        freed (last)."""
        slots = node.value
        node.value, node.spill = None, ref
        self.base.evictable_size_ -= len(node.key)
        self.spilled_tokens += ref.count
        self.base._update_leaf_status(node)
        self.base._update_leaf_status(node.parent)
        self.events.spilled(node)
        self.base.token_to_kv_pool_allocator.free_segment(slots, start_pos=0)

    def mark_resident(self, nodes: Sequence[TreeNode], values: Sequence[torch.Tensor]) -> None:
        """Spilled `nodes` (a chain, top down) take `values` (slots holding their verified KV); they
        count as used now (a restore is for a request about to run)."""
        now = time.monotonic()
        for node, value in zip(nodes, values, strict=True):
            self._mark_one(node, value, now)

    def _mark_one(self, node: TreeNode, value: torch.Tensor, now: float) -> None:
        assert len(value) == len(node.key) == node.spill.count, "one slot per token"
        node.value = value
        node.last_access_time = now
        self.spilled_tokens -= node.spill.count
        self.base.evictable_size_ += len(node.key)
        if node.lock_ref > 0:  # cannot happen for spilled nodes today; keep accounting exact anyway
            self.base.evictable_size_ -= len(node.key)
            self.base.protected_size_ += len(node.key)
        self.base._update_leaf_status(node)
        self.base._update_leaf_status(node.parent)
        self.events.resident(node)

    def drop(self, node: TreeNode) -> int:
        """Remove resident leaf `node` (and the spilled nodes below it) from the tree; its slots are
        freed last. Returns their number."""
        slots = node.value
        self.events.removed(node)
        self.base._delete_leaf(node)
        self.spilled_tokens -= _spilled_below(node)
        self.base.token_to_kv_pool_allocator.free_segment(slots, start_pos=0)
        return len(slots)

    def prune(self, node: TreeNode) -> int:
        """Remove spilled `node` (its KV is lost) and its spilled subtree; returns their tokens."""
        removed = node.spill.count + _spilled_below(node)
        self.events.removed(node)
        self.spilled_tokens -= removed
        node.parent.children.pop(node.key.child_key(self.page_size), None)
        self.base._update_leaf_status(node.parent)
        return removed

    def split(self, key: RadixKey, child: TreeNode, split_len: int) -> TreeNode:
        """sglang's split, also splitting the spill reference (of spilled nodes, and of resident
        ones that still know their clean copy on the tier)."""
        ref: SpillRef | None = getattr(child, "spill", None)
        spilled = child.evicted
        if spilled:
            child.value = torch.empty(len(child.key), dtype=torch.int64)  # sglang's split slices it
        new_node = RadixCache._split_node(self.base, key, child, split_len)
        if spilled:
            new_node.value = child.value = None
        if ref is not None:
            new_node.spill, child.spill = ref.split(split_len)
        if getattr(child, "layerwise_poisoned", False):  # a failed layer-wise restore's: never matched
            new_node.layerwise_poisoned = True
        self.events.split(new_node, child)
        return new_node

    def detach(self, top: TreeNode) -> list[TreeNode]:
        """Take resident `top` and its subtree out of the tree (a failed layer-wise restore's chain:
        its KV must never be matched, inserted over or evicted), keeping its resident nodes' slots
        for the requests that still hold them: their `parent` links stay, so sglang's lock counts run
        through them as before, and they stay in the evictable / protected sizes until `free_detached`.
        They are never evictable leaves again (`detached`: the cache's `_update_leaf_status`). Spilled
        descendants are pruned. Returns the resident nodes taken out."""
        resident, stack = [], [top]
        while stack:
            node = stack.pop()
            node.detached = True
            self.base.evictable_leaves.discard(node)
            resident.append(node)
            stack.extend(child for child in node.children.values() if not child.evicted)
        for node in resident:
            for child in [c for c in node.children.values() if c.evicted]:
                self.prune(child)
        self.events.removed(top)
        parent = top.parent
        parent.children.pop(top.key.child_key(self.page_size), None)
        self.base._update_leaf_status(parent)
        return resident

    def free_detached(self, nodes: Sequence[TreeNode]) -> int:
        """Free the slots of `detach`ed resident nodes that no request holds any more (they leave
        the evictable size); returns their tokens."""
        assert all(node.lock_ref == 0 for node in nodes), "a detached node is still held"
        for node in nodes:
            self.base.evictable_size_ -= len(node.key)
            self.base.evictable_leaves.discard(node)
        slots = [node.value for node in nodes]
        for node in nodes:
            node.value = None
        for value in slots:  # last: no node owns them now
            self.base.token_to_kv_pool_allocator.free_segment(value, start_pos=0)
        return sum(len(value) for value in slots)

    def spilled_on_path(self, node: TreeNode, key: RadixKey) -> tuple[int, list[TreeNode]]:
        """(resident tokens from `node` on `key`'s path, the spilled nodes that follow them): what an
        insert of `key` adopts (split where `key` leaves one)."""
        values, last = self.match_resident(node, key)
        pos = sum(len(v) for v in values)
        end, _ = self.match_spilled(last, key[pos:], prune_lost=False)
        return pos, self.path_up(end, last) or []

    def attach_segments(
        self, node: TreeNode, pos: int, key: RadixKey, segments: Sequence[Segment]
    ) -> list[TreeNode]:
        """Attach verified, contiguous `segments` (another server's extents, found by a lookup of
        `key`) as spilled nodes below `node`, where `key`'s match ends at `pos`. Stops where the
        tree already holds the next page, or where a segment would not start page-aligned."""
        page, tokens, added = self.page_size, key.raw_token_ids(), []
        extents: dict[ExtentKey, Extent] = {}
        for i, seg in enumerate(segments):
            upto = segments[i + 1].start if i + 1 < len(segments) else seg.end
            start = max(pos, seg.start)
            if seg.start > pos or (start - seg.start) % page or (upto - start) % page:
                break
            if upto <= start:
                continue
            if key[start:].child_key(page) in node.children:
                break
            extent = extents.setdefault(seg.key, Extent(seg.key, seg.extent_tokens, ExtentState.ON_TIER))
            part = RadixKey(tokens[start:upto], key.extra_key, cache_salt=key.cache_salt)
            node = self.add_spilled(node, part, SpillRef(extent, start - seg.start, upto - start))
            added.append(node)
            pos = upto
        return added

    # ---- walks: the device-resident prefix, then the spilled continuation --------------------

    def match_resident(self, node: TreeNode, key: RadixKey) -> tuple[list[torch.Tensor], TreeNode]:
        """sglang's walk, stopping at the first spilled node (the device-resident prefix only)."""
        now = time.monotonic()
        node.last_access_time = now
        values = []
        while len(key) > 0:
            child = node.children.get(key.child_key(self.page_size))
            if child is None or child.evicted or getattr(child, "layerwise_poisoned", False):
                break  # a failed layer-wise restore's node: some layers of its KV are not there
            child.last_access_time = now
            n = child.key.match(key, page_size=self.page_size)
            if n < len(child.key):
                node = self.base._split_node(child.key, child, n)
                values.append(node.value)
                break
            values.append(child.value)
            node, key = child, key[n:]
        return values, node

    def match_spilled(self, node: TreeNode, key: RadixKey, prune_lost: bool) -> tuple[TreeNode, int]:
        """The spilled nodes continuing `key` below `node` (split where `key` leaves one); with
        `prune_lost`, a node whose extent is LOST is pruned where the walk meets it."""
        matched = 0
        while len(key) > 0:
            child = node.children.get(key.child_key(self.page_size))
            if child is None or not child.evicted:
                break
            if child.spill.extent.state is ExtentState.LOST and prune_lost:
                self.prune(child)
                break
            n = child.key.match(key, page_size=self.page_size)
            if n < len(child.key):
                child = self.base._split_node(child.key, child, n)
            matched += n
            node, key = child, key[n:]
        return node, matched

    def attached(self, node: TreeNode) -> bool:
        """Whether `node` is still in the tree (no ancestor was removed)."""
        while node is not self.root:
            parent = node.parent
            if parent is None or parent.children.get(node.key.child_key(self.page_size)) is not node:
                return False
            node = parent
        return True

    def path_up(self, node: TreeNode, anchor: TreeNode | None) -> list[TreeNode] | None:
        """The nodes from below `anchor` down to `node`, top down; None if `anchor` is not above it."""
        chain = []
        while node is not anchor:
            if node is self.root or node is None:
                return None
            chain.append(node)
            node = node.parent
        return chain[::-1]

    def tokens_before(self, node: TreeNode) -> list[Any]:
        """The token ids of each node from the root down to `node`'s parent, top down."""
        path = []
        walk = node.parent
        while walk is not self.root:
            path.append(walk.key.raw_token_ids())
            walk = walk.parent
        return path[::-1]

    def extent_keys_in_use(self) -> set[ExtentKey]:
        """The keys of every extent a node of the tree points into: a spilled node's, and a resident
        node's clean copy (its eviction will point at it again). One walk of the whole tree."""
        keys: set[ExtentKey] = set()
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            ref: SpillRef | None = getattr(node, "spill", None)
            if ref is not None:
                keys.add(ref.extent.key)
            stack.extend(node.children.values())
        return keys

    def resident_values(self) -> torch.Tensor:
        values = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if not node.evicted:
                values.append(node.value)
                stack.extend(node.children.values())
        return torch.cat(values) if values else torch.empty(0, dtype=torch.int64)

    # ---- accounting ---------------------------------------------------------------------------

    def check_integrity(
        self, other_owned: list[torch.Tensor], held_tokens: int = 0, detached: Sequence[TreeNode] = ()
    ) -> None:
        """Tree, sizes and pool agree (see the module doc); `other_owned`: slots owned outside the
        tree (restores in progress); `held_tokens`: slots running requests hold; `detached`: resident
        nodes taken out of the tree and not freed yet (`detach`). AssertionError."""
        device_tokens = sum(len(node.key) for node in detached)
        spilled_tokens, slots = 0, [node.value for node in detached]
        stack = [(child, False) for child in self.root.children.values()]
        while stack:
            node, under_spilled = stack.pop()
            if node.evicted:
                ref = node.spill
                assert ref.count == len(node.key), (
                    f"spilled node of {len(node.key)} tokens refers to {ref.count}"
                )
                assert ref.extent.state is not ExtentState.WRITING or ref.extent.staged is not None, (
                    "writing without staging"
                )
                spilled_tokens += len(node.key)
            else:
                assert not under_spilled, "a device-resident node lies below a spilled one"
                assert len(node.value) == len(node.key), (
                    f"node holds {len(node.value)} slots for {len(node.key)} tokens"
                )
                device_tokens += len(node.key)
                slots.append(node.value)
            stack.extend((child, node.evicted) for child in node.children.values())
        other = sum(len(s) for s in other_owned)
        _check_slots([*slots, *other_owned], device_tokens + other)
        base = self.base
        assert base.evictable_size_ + base.protected_size_ == device_tokens, (
            f"evictable {base.evictable_size_} + protected {base.protected_size_} != device {device_tokens}"
        )
        assert self.spilled_tokens == spilled_tokens, (
            f"spilled counter {self.spilled_tokens} != tree {spilled_tokens}"
        )
        allocator = base.token_to_kv_pool_allocator
        free = allocator.available_size()
        assert free + device_tokens + other + held_tokens == allocator.size, (
            f"free {free} + tree {device_tokens} + restores in progress {other} + held {held_tokens}"
            f" != pool {allocator.size}"
        )


def _spilled_below(node: TreeNode) -> int:
    """Tokens of the (spilled) descendants of `node`."""
    total, stack = 0, list(node.children.values())
    while stack:
        child = stack.pop()
        total += child.spill.count
        stack.extend(child.children.values())
    return total


def _check_slots(slots: list[torch.Tensor], owned: int) -> None:
    if not slots:
        return
    flat = torch.cat([s.cpu() for s in slots])
    unique = int(torch.unique(flat).numel())
    assert unique == owned, f"{owned - unique} slots are owned by more than one node or restore"
    assert int(flat.min()) > 0, "slot 0 (sglang's padding slot) is owned by a node"
