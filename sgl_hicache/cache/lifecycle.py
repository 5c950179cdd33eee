"""The cache's lifecycle: resets (the start, a flush), key epochs, the warm start from the tier.

- **The first reset** (sglang's constructor calls it): an empty tree, then the tier's published
  extents attached to it as spilled nodes (warm restart, warm_start.py); with TP > 1 every rank
  then starts from the same tree or all start empty (`_agree_on_warm_start`).
- **Any later reset** is a flush (`/flush_cache`, a weight update with flush_cache): an empty tree in
  a new **epoch**, a random seed of every path key, so no extent named before can ever be found
  again (those age out of the tier by LRU), and none named after it is attached by a restart (the
  weights in memory may no longer be the ones on disk). A weight update without a flush starts a
  new epoch too (`start_epoch`, server/hooks.py).
This object is the one writer of the cache's `epoch`. The fallbacks of a reset (`keep_nothing`,
`empty_reset`: sglang's own reset on our tree) are here as well; the cache's guarded `reset` calls
them (guard.py).
"""

from __future__ import annotations

import logging
import os
from typing import Protocol

from sglang.srt.mem_cache.radix_cache import RadixCache, TreeNode

from sgl_hicache.cache.guard import GuardedPart, contained
from sgl_hicache.cache.layerwise_flow import LayerwiseFlow
from sgl_hicache.cache.owning_cache import OwningCache
from sgl_hicache.cache.warm_start import WarmStart, tree_digest

logger = logging.getLogger(__name__)


class LifecycleCache(OwningCache, Protocol):
    """What the lifecycle needs of the cache (`SpillRadixCache` is one)."""

    warm: WarmStart
    epoch: bytes | None  # seeds every path key; None until the first reset
    root_node: TreeNode


class Lifecycle(GuardedPart[LifecycleCache]):
    def __init__(self, cache: LifecycleCache, layerwise: LayerwiseFlow) -> None:
        super().__init__(cache)
        self.layerwise = layerwise

    def after_reset(self) -> None:
        """After sglang's reset emptied the tree: a warm start (the first) or a flush (any later)."""
        cache = self.cache
        cache.tree.cleared()
        self.layerwise.forget()
        cache.warm.forget()
        if cache.controller is not None:
            cache.controller.clear()
        if cache.epoch is None:
            cache.epoch = b""
            self._attach_tier_extents()
            self._agree_on_warm_start()  # reached whatever the attach did: ranks pair collectives
            return
        self.start_epoch()
        cache.spill_metrics.inc("flushes")
        logger.info("sgl_hicache: cache flushed; spilled KV from before the flush will not be served")

    def start_epoch(self) -> None:
        """A new random seed of every path key (a flush, a weight update): nothing named before is
        found after, and nothing named after is attached by a restart. Keeps the tree."""
        self.cache.epoch = os.urandom(16)
        self.cache.warm.forget()

    def _attached_nothing(self) -> None:
        """A warm start that failed partway: an empty tree (the tier's extents stay on disk).
        With TP > 1 the warm-start agreement still runs after it, so every rank then starts empty."""
        self.keep_nothing()
        self.cache.warm.forget()

    @contained("reset (warm start)", _attached_nothing)
    def _attach_tier_extents(self) -> None:
        cache = self.cache
        if cache.controller is not None:
            cache.warm.attach_all(cache.controller.tier, cache.epoch or b"")

    def _agree_on_warm_start(self) -> None:
        """With TP > 1 every rank must start from the same tree: if the trees their tiers gave
        differ (a file missing or corrupt on one rank), all start empty."""
        cache = self.cache
        if cache.agreement.size == 1:
            return
        digest = tree_digest(cache.root_node)
        low, neg_high = cache.agreement.min([digest, -digest])
        if low != -neg_high:
            logger.warning("sgl_hicache: the TP ranks' tiers hold different trees; all start empty")
            cache.spill_metrics.inc("tp_disagreements")
            self._attached_nothing()

    # ---- the fallbacks of a reset ------------------------------------------------------------

    def keep_nothing(self) -> None:
        """sglang's own reset (an empty tree; spill is off by then, so no key epoch matters)."""
        RadixCache.reset(self.cache)
        self.cache.tree.cleared()
        self.layerwise.forget()

    def empty_reset(self) -> None:
        """An empty tree in a new key epoch (nothing named before is ever found). Restores in
        progress are forgotten, not freed: sglang clears the allocator right after a flush."""
        self.keep_nothing()
        self.cache.warm.forget()
        if self.cache.controller is not None:
            self.cache.controller.restores.forget()
        self.start_epoch()
