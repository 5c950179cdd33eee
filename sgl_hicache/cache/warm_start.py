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
This object owns the orphans; the tree owns the nodes it attaches.
"""

from __future__ import annotations

import logging
from array import array
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import xxhash
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from sgl_hicache.cache.spill_state import Extent, ExtentState, SpillRef
from sgl_hicache.cache.tree import SpillTree
from sgl_hicache.tier import ExtentInfo, ExtentKey, NamespaceId, Tier, chain_key
from sgl_hicache.tier.keys import PathHasher, tokens_to_bytes

logger = logging.getLogger(__name__)


class WarmStart:
    def __init__(self, tree: SpillTree, namespace_id: NamespaceId) -> None:
        self.tree = tree
        self.namespace_id = namespace_id
        self.orphans: dict[ExtentKey, list[ExtentInfo]] = {}
        self._present: Callable[[ExtentKey], bool] = lambda key: True  # the tier's index (`attach_all`)

    def forget(self) -> None:
        """A flush or a new epoch: no orphan can be named any more."""
        self.orphans = {}

    def attach_all(self, tier: Tier, epoch: bytes) -> int:
        """Attach every extent reachable from the root as a spilled node (the default tenant);
        keep the rest as orphans. Returns the tokens attached. Blocks (reads headers)."""
        self._present = tier.contains  # an orphan purged or evicted since is never attached
        children: dict[ExtentKey, list[ExtentInfo]] = defaultdict(list)
        for info in tier.extents():
            children[info.parent].append(info)
        stack: list[tuple[TreeNode, PathHasher]] = [
            (self.tree.root, PathHasher(self.namespace_id, b"", epoch))
        ]
        attached = 0
        while stack:
            node, hasher = stack.pop()
            for info in children.pop(hasher.key(), []):
                child = self._attach(tier, node, hasher, info)
                if child is not None:
                    attached += info.token_count
                    stack.append(child)
        self.orphans = dict(children)
        if attached:
            logger.info("sgl_hicache: warm start attached %d spilled tokens from the tier", attached)
        return attached

    def attach_on_match(self, node: TreeNode, key: RadixKey, pos: int, hasher: PathHasher) -> int:
        """Attach orphan extents that continue `key` after its first `pos` tokens (where `node`
        ends; `hasher` has been fed those tokens); returns the tokens attached. Never blocks."""
        tokens = key.raw_token_ids()
        attached = 0
        while pos < len(key):
            candidates = self.orphans.get(hasher.key(), [])
            found = next((c for c in candidates if self._continues(c, hasher, tokens, pos)), None)
            if found is None or key[pos:].child_key(self.tree.page_size) in node.children:
                break
            candidates.remove(found)
            n = found.token_count
            part = RadixKey(tokens[pos : pos + n], key.extra_key, cache_salt=key.cache_salt)
            node = self.tree.add_spilled(node, part, _whole(found.key, n))
            hasher.update(tokens[pos : pos + n])
            pos, attached = pos + n, attached + n
        return attached

    def _continues(self, info: ExtentInfo, hasher: PathHasher, tokens: Any, pos: int) -> bool:
        n = info.token_count
        return (
            0 < n <= len(tokens) - pos
            and n % self.tree.page_size == 0
            and chain_key(self.namespace_id, hasher.key(), tokens[pos : pos + n]) == info.key
            and self._present(info.key)
        )

    def _attach(
        self, tier: Tier, parent: TreeNode, hasher: PathHasher, info: ExtentInfo
    ) -> tuple[TreeNode, PathHasher] | None:
        tokens = tier.read_tokens(info.key)
        if tokens is None or len(tokens) == 0 or len(tokens) % self.tree.page_size:
            return None
        if chain_key(self.namespace_id, hasher.key(), tokens) != info.key:
            return None  # does not start where this node ends: leave it alone
        key = RadixKey(array("q", tokens.tolist()))
        if key.child_key(self.tree.page_size) in parent.children:
            return None
        return self.tree.add_spilled(parent, key, _whole(info.key, len(key))), hasher.copy().update(tokens)


def _whole(key: ExtentKey, tokens: int) -> SpillRef:
    return SpillRef(Extent(key, tokens, ExtentState.ON_TIER), 0, tokens)


def tree_digest(root: TreeNode) -> int:
    """A 62-bit digest of the tree's shape and tokens (children in key order): equal on two ranks
    exactly when their trees hold the same token paths, split the same way."""
    h = xxhash.xxh3_64()
    stack = [root]
    while stack:
        node = stack.pop()
        children = sorted(node.children.values(), key=lambda c: list(c.key.raw_token_ids()))
        h.update(len(children).to_bytes(4, "little"))
        for child in children:
            h.update(tokens_to_bytes(child.key.raw_token_ids()) + b"\xff\xff\xff\xff")
        stack.extend(reversed(children))
    return h.intdigest() >> 2
