"""Warm restart: turn the tier's published extents back into spilled nodes of a fresh tree.

An extent's key is `chain_key(ns, parent path key, tokens)` (tier/keys.py). At start, the default
tenant's tree is rebuilt by walking from the root's path key: the children of a node are the extents
whose parent equals the node's path key, and each is attached only if its key equals the chain key
of that path and its stored tokens (the tier also refuses a file whose own parent, token count and
token digest do not hash to its key, or whose MAC fails), so an extent is attached exactly where it
starts, with exactly its tokens.
Everything else stays an *orphan*, indexed by parent key: extents of salted tenants (the salt is
never stored on disk) and extents under such orphans. A request brings its own tokens and tenant, so
when its match ends where an orphan's parent key says it starts, and the orphan's key equals the hash
of the request's next tokens, the orphan is attached then (`attach_on_match`), without a disk read.
"""

from __future__ import annotations

import logging
from array import array
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import xxhash
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from sgl_hicache.cache.spill_state import Extent, ExtentState, SpillRef
from sgl_hicache.tier import ExtentInfo, ExtentKey, chain_key
from sgl_hicache.tier.keys import PathHasher, tokens_to_bytes

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
    root = PathHasher(cache.namespace_id, b"", cache.epoch or b"")  # the default tenant
    stack: list[tuple[TreeNode, PathHasher]] = [(cache.root_node, root)]
    attached = 0
    while stack:
        node, hasher = stack.pop()
        for info in children.pop(hasher.key(), []):
            child = _attach(cache, node, hasher, info)
            if child is not None:
                attached += info.token_count
                stack.append(child)
    cache.spilled_tokens += attached
    cache.tier_orphans = dict(children)
    if attached:
        logger.info("sgl_hicache: warm start attached %d spilled tokens from the tier", attached)
    return attached


def attach_on_match(cache: SpillRadixCache, node: TreeNode, key: RadixKey, pos: int) -> int:
    """Attach orphan extents that continue `key` after its first `pos` tokens (where `node` ends);
    returns the tokens attached (as spilled nodes under `node`)."""
    tokens = key.raw_token_ids()
    hasher = cache.path_hasher(key).update(tokens[:pos])
    attached = 0
    while pos < len(key):
        candidates = cache.tier_orphans.get(hasher.key(), [])
        found = next((c for c in candidates if _continues(cache, c, hasher, tokens, pos)), None)
        if found is None or key[pos:].child_key(cache.page_size) in node.children:
            break
        candidates.remove(found)
        n = found.token_count
        node = _new_spilled(
            node,
            RadixKey(tokens[pos : pos + n], key.extra_key, cache_salt=key.cache_salt),
            found.key,
            cache.page_size,
        )
        hasher.update(tokens[pos : pos + n])
        pos, attached = pos + n, attached + n
    cache.spilled_tokens += attached
    return attached


def _continues(cache: SpillRadixCache, info: ExtentInfo, hasher: PathHasher, tokens: Any, pos: int) -> bool:
    n = info.token_count
    return (
        0 < n <= len(tokens) - pos
        and n % cache.page_size == 0
        and chain_key(cache.namespace_id, hasher.key(), tokens[pos : pos + n]) == info.key
    )


def _new_spilled(parent: TreeNode, key: RadixKey, extent_key: ExtentKey, page_size: int) -> TreeNode:
    node = TreeNode()
    node.parent, node.key, node.value = parent, key, None
    node.spill = SpillRef(Extent(extent_key, len(key), ExtentState.ON_TIER), 0, len(key))
    parent.children[key.child_key(page_size)] = node
    return node


def _attach(
    cache: SpillRadixCache, parent: TreeNode, hasher: PathHasher, info: ExtentInfo
) -> tuple[TreeNode, PathHasher] | None:
    tokens = cache.spill_io.tier.read_tokens(info.key) if cache.spill_io is not None else None
    if tokens is None or len(tokens) == 0 or len(tokens) % cache.page_size:
        return None
    if chain_key(cache.namespace_id, hasher.key(), tokens) != info.key:
        return None  # does not start where this node ends: leave it alone
    child_hasher = hasher.copy().update(tokens)
    key = RadixKey(array("q", tokens.tolist()))
    if key.child_key(cache.page_size) in parent.children:
        return None
    return _new_spilled(parent, key, info.key, cache.page_size), child_hasher


def tree_digest(cache: SpillRadixCache) -> int:
    """A 62-bit digest of the tree's shape and tokens (children in key order): equal on two ranks
    exactly when their trees hold the same token paths, split the same way."""
    h = xxhash.xxh3_64()
    stack = [cache.root_node]
    while stack:
        node = stack.pop()
        children = sorted(node.children.values(), key=lambda c: list(c.key.raw_token_ids()))
        h.update(len(children).to_bytes(4, "little"))
        for child in children:
            h.update(tokens_to_bytes(child.key.raw_token_ids()) + b"\xff\xff\xff\xff")
        stack.extend(reversed(children))
    return h.intdigest() >> 2
