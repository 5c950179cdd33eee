"""Warm restart: turn the tier's published extents back into spilled nodes of a fresh tree.

Extents name their prefix by `prefix_key` (see prefix_keys.py), so the tree is rebuilt by walking
from the default tenant's root key: the children of a node are the extents whose parent key equals
the node's key, and each child's key is re-derived from its stored tokens and checked. What cannot be
attached is left on the tier (aged out by its LRU): extents of salted tenants (the salt is not stored
on disk), and a second extent starting with the same first token under one parent (the radix tree
keeps one child per first token; the first one found wins).
"""

from __future__ import annotations

import logging
from array import array
from collections import defaultdict
from typing import TYPE_CHECKING

from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from sgl_hicache.cache.prefix_keys import PrefixHasher
from sgl_hicache.cache.spill_state import Extent, ExtentState, SpillRef
from sgl_hicache.tier import ExtentInfo, ExtentKey

if TYPE_CHECKING:
    from sgl_hicache.cache.spill_radix_cache import SpillRadixCache

logger = logging.getLogger(__name__)


def attach_tier_extents(cache: SpillRadixCache) -> int:
    """Attach every reachable extent as a spilled node; returns the number of tokens attached."""
    if cache.spill_io is None:
        return 0
    tier = cache.spill_io.tier
    children: dict[ExtentKey, list[ExtentInfo]] = defaultdict(list)
    for info in tier.extents():
        children[info.parent].append(info)
    root = PrefixHasher(cache.namespace_id, b"")
    stack: list[tuple[TreeNode, PrefixHasher]] = [(cache.root_node, root)]
    attached = 0
    while stack:
        node, hasher = stack.pop()
        for info in children.get(hasher.key(), []):
            child = _attach(cache, node, hasher, info)
            if child is not None:
                attached += info.token_count
                stack.append(child)
    cache.spilled_tokens += attached
    if attached:
        logger.info("sgl_hicache: warm start attached %d spilled tokens from the tier", attached)
    return attached


def _attach(
    cache: SpillRadixCache, parent: TreeNode, hasher: PrefixHasher, info: ExtentInfo
) -> tuple[TreeNode, PrefixHasher] | None:
    tokens = cache.spill_io.tier.read_tokens(info.key) if cache.spill_io is not None else None
    if tokens is None or len(tokens) == 0 or len(tokens) % cache.page_size:
        return None
    child_hasher = hasher.copy().update(tokens)
    if child_hasher.key() != info.key:
        return None  # not a prefix extent of this tree (e.g. another key scheme): leave it alone
    key = RadixKey(array("q", tokens.tolist()))
    child_key = key.child_key(cache.page_size)
    if child_key in parent.children:
        return None
    node = TreeNode()
    node.parent, node.key, node.value = parent, key, None
    node.spill = SpillRef(Extent(info.key, len(tokens), ExtentState.ON_TIER), 0, len(tokens))
    parent.children[child_key] = node
    return node, child_hasher
