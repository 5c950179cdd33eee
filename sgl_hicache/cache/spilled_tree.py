"""`SpilledTree`: sglang's pure-Python `RadixCache` whose evicted nodes can stay in the tree as *spilled*.

The structure only, no I/O and no policy (those are `SpillRadixCache`'s): how a node becomes spilled
and resident again, how the walks treat spilled nodes, and how splits and inserts keep their
references right. A spilled node has `value is None` (sglang's own "evicted") and `spill`, a
`SpillRef` into an extent. Invariants (checked by `integrity.check_cache_integrity`):

- resident nodes form a root-closed subtree: every descendant of a spilled node is spilled;
- spilled tokens count in neither `evictable_size_` nor `protected_size_` (they hold no device
  memory); `spilled_tokens` is their sum;
- a spilled node's `spill.count == len(node.key)`.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from sgl_hicache.cache.spill_state import ExtentState, SpillRef


class SpilledTree(RadixCache):
    spilled_tokens: int = 0
    # A walk drops spilled nodes whose extent was found LOST. With TP > 1 a LOST extent is one rank's
    # local state, so the walks leave them and only an agreed restore failure prunes (agreement.py).
    prune_lost_on_walk: bool = True

    # ---- becoming spilled / resident --------------------------------------------------------

    def _mark_spilled(self, node: TreeNode, ref: SpillRef) -> None:
        self.token_to_kv_pool_allocator.free_segment(node.value, start_pos=0)
        self.evictable_size_ -= len(node.key)
        node.value = None
        node.spill = ref
        self.spilled_tokens += ref.count
        self._update_leaf_status(node)
        self._update_leaf_status(node.parent)

    def _mark_resident(self, node: TreeNode, value: torch.Tensor) -> None:
        node.value = value
        self.spilled_tokens -= node.spill.count
        self.evictable_size_ += len(node.key)
        if node.lock_ref > 0:  # cannot happen for spilled nodes today; keep accounting exact anyway
            self.evictable_size_ -= len(node.key)
            self.protected_size_ += len(node.key)
        self._update_leaf_status(node)
        self._update_leaf_status(node.parent)

    def _forget_spilled(self, node: TreeNode) -> None:
        """Account for the spilled descendants of `node` leaving the tree with it."""
        stack = list(node.children.values())
        while stack:
            child = stack.pop()
            self.spilled_tokens -= child.spill.count
            stack.extend(child.children.values())

    def _prune_spilled(self, node: TreeNode) -> None:
        """Remove a spilled node whose KV is lost, and its (spilled) subtree."""
        self.spilled_tokens -= node.spill.count
        self._forget_spilled(node)
        node.parent.children.pop(node.key.child_key(self.page_size), None)
        self._update_leaf_status(node.parent)

    def _attached(self, node: TreeNode) -> bool:
        """Whether `node` is still in the tree (no ancestor was removed)."""
        while node is not self.root_node:
            parent = node.parent
            if parent is None or parent.children.get(node.key.child_key(self.page_size)) is not node:
                return False
            node = parent
        return True

    def _path_up(self, node: TreeNode, anchor: TreeNode | None) -> list[TreeNode] | None:
        chain = []
        while node is not anchor:
            if node is self.root_node or node is None:
                return None
            chain.append(node)
            node = node.parent
        return chain[::-1]

    # ---- walks: the device-resident prefix, then the spilled continuation ---------------------

    def _match_prefix_helper(self, node: TreeNode, key: RadixKey) -> tuple[list[torch.Tensor], TreeNode]:
        """sglang's walk, stopping at the first spilled node (device-resident prefix only)."""
        now = time.monotonic()
        node.last_access_time = now
        values = []
        while len(key) > 0:
            child = node.children.get(key.child_key(self.page_size))
            if child is None or child.evicted:
                break
            child.last_access_time = now
            n = child.key.match(key, page_size=self.page_size)
            if n < len(child.key):
                node = self._split_node(child.key, child, n)
                values.append(node.value)
                break
            values.append(child.value)
            node, key = child, key[n:]
        return values, node

    def _match_spilled(self, node: TreeNode, key: RadixKey) -> tuple[TreeNode, int]:
        matched = 0
        while len(key) > 0:
            child = node.children.get(key.child_key(self.page_size))
            if child is None or not child.evicted:
                break
            if child.spill.extent.state is ExtentState.LOST and self.prune_lost_on_walk:
                self._prune_spilled(child)
                break
            n = child.key.match(key, page_size=self.page_size)
            if n < len(child.key):
                child = self._split_node(child.key, child, n)
            matched += n
            node, key = child, key[n:]
        return node, matched

    def _split_node(self, key: RadixKey, child: TreeNode, split_len: int) -> TreeNode:
        """sglang's split, also splitting the spill reference (spilled nodes, and resident ones that
        still know their clean copy on the tier)."""
        ref: SpillRef | None = getattr(child, "spill", None)
        spilled = child.evicted
        if spilled:
            child.value = torch.empty(len(child.key), dtype=torch.int64)  # sglang's split slices it
        new_node = super()._split_node(key, child, split_len)
        if spilled:
            new_node.value = child.value = None
        if ref is not None:
            new_node.spill, child.spill = ref.split(split_len)
        return new_node

    # ---- insert over spilled nodes ----------------------------------------------------------

    def _insert_helper(self, node: TreeNode, key: RadixKey, value: Any, priority: int = 0,
                       inserted_len: int = 0) -> tuple[int, TreeNode]:  # fmt: skip
        adopted = self._adopt_spilled(node, key, value)
        prefix_len, last = super()._insert_helper(node, key, value, priority, inserted_len)
        # Adopted tokens are the tail of the matched prefix and now own the request's slots:
        # they must not be reported as duplicates (the caller frees duplicates' slots).
        return prefix_len - adopted, last

    def _adopt_spilled(self, node: TreeNode, key: RadixKey, value: torch.Tensor) -> int:
        """Give the spilled nodes on `key`'s path the request's slots; returns how many tokens."""
        pos, chain = self._spilled_on_path(node, key)
        for spilled in chain:
            self._mark_resident(spilled, value[pos : pos + len(spilled.key)].clone())
            pos += len(spilled.key)
        return sum(len(n.key) for n in chain)

    def _spilled_on_path(self, node: TreeNode, key: RadixKey) -> tuple[int, list[TreeNode]]:
        """(resident tokens from `node` on `key`'s path, the spilled nodes that follow them)."""
        values, last = self._match_prefix_helper(node, key)
        pos = sum(len(v) for v in values)
        end, _ = self._match_spilled(last, key[pos:])
        return pos, self._path_up(end, last) or []

    # ---- accounting -------------------------------------------------------------------------

    def all_values_flatten(self) -> torch.Tensor:
        values = []
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            if not node.evicted:
                values.append(node.value)
                stack.extend(node.children.values())
        return torch.cat(values) if values else torch.empty(0, dtype=torch.int64)
