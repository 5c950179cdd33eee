"""The retention hints on the cache: pin a conversation's prefix, drop it, purge a cache_salt.

Hints reach every TP rank in the same scheduler iteration, as resume hints do (server/hooks.py, 3):
the scheduler of rank 0 takes them from its inbox (`take`: a pin over the budget is refused there,
before the broadcast), and every rank then `apply`s each to its own tree and tier. Tree changes
are the same on every rank (same walk, same splits, same locks); tier changes are each rank's own
(its namespace, its files).

- **pin** (`ttl_s`): the prefix is covered by a pin (pins.py) until the deadline. Eviction spills a
  covered node whatever its length (`min_spill_tokens` does not apply) and the tier keeps the
  extent holding it (`Tier.retain`) until the deadline; extents of the prefix already on the tier
  are kept from now. A covered node is still dropped where it cannot be written (staging full,
  larger than staging, no tier, a TP rank that failed to spill it). Pins live in memory: a
  restart forgets them (the extents stay on the tier under its LRU).
- **drop**: the prefix's own branch goes now, with everything cached after it (its later turns):
  walking the prefix, from where it leaves what other cached sequences share (a system prompt
  other conversations continue) to its end and below. Spilled nodes are pruned, device nodes freed,
  their extents removed from the tier (`Tier.submit_remove`; one still being written is removed
  once written: `poll`), their prefetched reads released, their pins ended. An extent a node left
  in the tree still points into stays (a split leaves a kept head and a dropped tail in one
  extent): it goes with the last node pointing into it. A device node in use
  by a running request (locked) stays, with its ancestors: that request's KV is cached again when
  it finishes, like any request's.
- **purge** (`cache_salt`): every node of that salt is dropped as above, its pins end, and the tier
  removes every extent of the salt under its root or in its store, in every namespace
  (`Tier.submit_purge`: tier/file/purge.py, tier/mooncake/purge.py), and those of its stores in
  flight once written; a purge the tier failed is retried by the tier until done.
"""

from __future__ import annotations

import contextlib
import logging
from array import array
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from sgl_hicache.cache.agreement import Agreement
from sgl_hicache.cache.controller import SpillController
from sgl_hicache.cache.hint_source import HintRefused, ResumeHint, RetentionHint
from sgl_hicache.cache.metrics import SpillMetrics
from sgl_hicache.cache.pins import Pin, Pins, tier_bytes
from sgl_hicache.cache.spill_state import Extent, ExtentState, SpillRef
from sgl_hicache.cache.tree import SpillTree
from sgl_hicache.config import SpillConfig
from sgl_hicache.tier.base import Tier
from sgl_hicache.tier.keys import ExtentKey, tenant_of
from sgl_hicache.tier.results import Ticket

logger = logging.getLogger(__name__)


class RetentionCache(Protocol):
    """What retention needs of the cache (`SpillRadixCache` is one)."""

    controller: SpillController | None
    io_to_close: SpillController | None  # the controller also after spill was disabled (its tier stays open)
    tree: SpillTree
    spill_config: SpillConfig
    spill_metrics: SpillMetrics
    agreement: Agreement
    page_size: int
    root_node: TreeNode


class Retention:
    def __init__(self, cache: RetentionCache) -> None:
        self.cache = cache
        self._pins: Pins | None = None
        self._doomed: list[Extent] = []  # extents of dropped nodes still being written
        self.jobs: deque[Ticket] = deque(maxlen=256)  # the tier's latest removals and purges (`wait_jobs`)
        self._purge_refusal_logged = False

    @property
    def pins(self) -> Pins | None:
        """The pins, once there is a tier to keep them (None without one: pins are refused)."""
        ctl = self.cache.controller
        if self._pins is None and ctl is not None:
            cfg, ranks, layout = self.cache.spill_config, self.cache.agreement.size, ctl.layout
            budget = int(cfg.pin_share * cfg.tier.capacity_bytes)
            self._pins = Pins(budget, tier_bytes(layout, cfg.tier.chunk_bytes, self.cache.page_size, ranks))
        return self._pins

    # ---- taking hints (the scheduler of TP rank 0) --------------------------------------------

    def take(self, taken: list[Any], ids: list[int], extra_key: str | None, cache_salt: str | None,
             kind: str = "prefetch", ttl_s: float | None = None) -> HintRefused | None:  # fmt: skip
        """The inbox's handler: queue one checked hint for the broadcast, or refuse it (a pin
        that does not fit the pin budget, or with spill off)."""
        if kind == "prefetch":
            taken.append(ResumeHint(list(ids), extra_key, cache_salt))
            return None
        if kind == "pin":
            key = _key(ids, extra_key, cache_salt, self.cache.page_size)
            pins = self.pins
            if pins is None:
                return HintRefused("spill is off on this server: there is no tier to pin to")
            reason = pins.admit(_tenant(key), key.cache_salt, key.raw_token_ids(), float(ttl_s or 0))
            if reason is not None:
                self.cache.spill_metrics.inc("pins_refused")
                return HintRefused(reason)
        taken.append(RetentionHint(kind, list(ids), extra_key, cache_salt, ttl_s))
        return None

    # ---- applying them (every rank, same iteration) ------------------------------------------

    def apply(self, hint: RetentionHint) -> None:
        m = self.cache.spill_metrics
        if hint.kind == "purge" and hint.cache_salt:
            m.inc("purges")
            self.purge(hint.cache_salt)
            return
        key = _key(hint.token_ids, hint.extra_key, hint.cache_salt, self.cache.page_size)
        if hint.kind == "pin" and len(key):
            m.inc("pins")
            self.pin(key, float(hint.ttl_s or 0))
        elif hint.kind == "drop" and len(key):
            m.inc("drops")
            self.drop(key)

    def pin(self, key: RadixKey, ttl_s: float) -> None:
        path = self._path(key)  # splits: taken on every rank, one whose spill is off too
        pins = self.pins
        if pins is None:
            return
        pin = pins.add(_tenant(key), key.cache_salt, key.raw_token_ids(), ttl_s)  # again on rank 0: same pin
        for node in path:
            if node.evicted:
                self.spilled(node, pin)

    def drop(self, key: RadixKey) -> None:
        path = self._path(key)
        if self.pins is not None:
            self.pins.forget(tenant=_tenant(key), tokens=key.raw_token_ids())
        if not path:
            return
        top = path[-1]
        if sum(len(n.key) for n in path) < len(key) and top.children:
            return  # the conversation runs off the tree here: what is cached is shared with others
        while top.parent is not self.cache.root_node and len(top.parent.children) == 1:
            top = top.parent  # the parent is this conversation's alone: it goes too
        self._forget(*self._drop_subtree(top))

    def purge(self, cache_salt: str) -> None:
        """Every node and extent of `cache_salt` (see the module doc)."""
        if self.pins is not None:
            self.pins.forget(salt=cache_salt)
        stack, tops = list(self.cache.root_node.children.values()), []
        while stack:
            node = stack.pop()
            if node.key.cache_salt == cache_salt:
                tops.append(node)
            else:
                stack.extend(node.children.values())
        released: list[SpillRef] = []
        extents: list[Extent] = []
        for top in tops:
            refs, more = self._drop_subtree(top)
            released, extents = released + refs, extents + more
        self._forget(released, extents)
        tier = self._tier
        if tier is None:
            return
        try:
            self.jobs.append(tier.submit_purge(cache_salt))
        except NotImplementedError as e:  # a backend that cannot find a salt's extents (none of ours now)
            self.cache.spill_metrics.inc("purges_incomplete")
            if not self._purge_refusal_logged:
                self._purge_refusal_logged = True
                logger.error("sgl_hicache: a purge removed the salt's KV from this server's device and tree "
                             "only: %s; its extents stay until the store evicts them (logged once; counted "
                             "in purges_incomplete)", e)  # fmt: skip

    # ---- eviction of covered nodes (`Spilling._spill_node`) ------------------------------------

    def pin_of(self, node: TreeNode) -> Pin | None:
        """The pin covering resident `node` about to be evicted, if any."""
        pins = self._pins
        if pins is None or not len(pins):
            return None
        return pins.covering(_tenant(node.key), self.cache.tree.tokens_before(node), node.key.raw_token_ids())

    def spilled(self, node: TreeNode, pin: Pin | None) -> None:
        """`node` (now spilled) is covered by `pin`: the tier keeps its extent until the deadline,
        within the pin budget."""
        if pin is None or self._pins is None or self.cache.controller is None:
            return
        extent = node.spill.extent
        if self._pins.retain(extent.key, extent.tokens, pin.until):
            self.cache.controller.tier.retain([extent.key], self._pins.deadline(extent.key))
            self.cache.spill_metrics.inc("pinned_spilled_tokens", node.spill.count)
        else:
            self.cache.spill_metrics.inc("pin_over_budget")

    def poll(self) -> None:
        """Remove the files of dropped extents whose writes have finished since (also after spill
        was disabled: a deletion asked for is still owed). Never blocks."""
        if not self._doomed or self._tier is None:
            return
        done = [e for e in self._doomed if e.state is not ExtentState.WRITING]
        self._doomed = [e for e in self._doomed if e.state is ExtentState.WRITING]
        in_use = self._extents_in_use() if done else set()
        self._remove([e for e in done if e.state is ExtentState.ON_TIER and e.key not in in_use])

    def wait_jobs(self, timeout_s: float = 30.0) -> None:
        """Block until the tier has finished the removals and purges submitted so far (tests: a
        tier's integrity is checked only when nothing is in flight)."""
        tier = self._tier
        while self.jobs and tier is not None:
            with contextlib.suppress(KeyError):  # already taken by a poll: finished
                tier.wait(self.jobs.popleft(), timeout_s)

    # ---- helpers -----------------------------------------------------------------------------

    @property
    def _tier(self) -> Tier | None:
        """The tier that removals and purges go to: also after spill was disabled (a deletion asked
        for is still owed; with TP > 1 no other rank purges this rank's namespace)."""
        ctl = self.cache.controller or self.cache.io_to_close
        return ctl.tier if ctl is not None else None

    def _path(self, key: RadixKey) -> list[TreeNode]:
        """The nodes holding `key`'s tokens, top down (split where it ends inside one, as a match
        does: the same on every rank)."""
        tree = self.cache.tree
        values, last = tree.match_resident(self.cache.root_node, key)
        end, _ = tree.match_spilled(last, key[sum(len(v) for v in values) :], prune_lost=False)
        return tree.path_up(end, self.cache.root_node) or []

    def _drop_subtree(self, top: TreeNode) -> tuple[list[SpillRef], list[Extent]]:
        """Remove `top` and every node below it but those in use by a running request (and their
        ancestors); returns the refs of the spilled ones and the extents the removed ones pointed
        into (`_forget` them)."""
        tree, order = self.cache.tree, []
        stack = [top]
        while stack:
            node = stack.pop()
            order.append(node)
            if not node.evicted:  # below a spilled node everything is spilled: pruned with it
                stack.extend(node.children.values())
        gone: set[int] = set()
        extents: list[Extent] = []
        released: list[SpillRef] = []
        dropped = 0
        for node in reversed(order):  # every node after its descendants
            ref: SpillRef | None = getattr(node, "spill", None)
            if node.evicted:
                released += _spilled_refs(node)
                extents += [r.extent for r in _spilled_refs(node)]
                dropped += tree.prune(node)
            elif node.lock_ref > 0 or any(id(c) not in gone for c in node.children.values()):
                self.cache.spill_metrics.inc("drop_kept_tokens", len(node.key))
                continue
            else:
                extents += [ref.extent] if ref is not None else []
                dropped += tree.drop(node)
            gone.add(id(node))
        self.cache.spill_metrics.inc("hint_dropped_tokens", dropped)
        return released, extents

    def _extents_in_use(self) -> set[ExtentKey]:
        """Keys of the extents a node left in the tree still points into. After a split, the kept
        half and the dropped half of a node share one extent: it goes only with the last node
        pointing into it (a later drop of that one). A restore in progress of nodes still in the tree
        is covered by them; one of dropped nodes is never handed over (its chain changed)."""
        return self.cache.tree.extent_keys_in_use()

    def _forget(self, released: list[SpillRef], extents: Sequence[Extent] = ()) -> None:
        """Release the reads of removed nodes' refs and remove `extents` from the tier, but for those
        a node left still points into (`_extents_in_use`: those stay, and so do their reads)."""
        in_use = self._extents_in_use()
        if self.cache.controller is not None:
            self.cache.controller.finish_reads([r for r in released if r.extent.key not in in_use])
        unique = [e for e in {id(e): e for e in extents}.values() if e.key not in in_use]
        self._doomed += [e for e in unique if e.state is ExtentState.WRITING]
        self._remove([e for e in unique if e.state is ExtentState.ON_TIER])

    def _remove(self, extents: list[Extent]) -> None:
        tier = self._tier
        if not extents or tier is None:
            return
        keys = [e.key for e in extents]
        if self._pins is not None:
            self._pins.forget_extents(keys)
        self.jobs.append(tier.submit_remove(keys))


def _key(ids: list[int], extra_key: str | None, cache_salt: str | None, page_size: int) -> RadixKey:
    return RadixKey(array("q", ids), extra_key, cache_salt=cache_salt).page_aligned(page_size)


def _tenant(key: RadixKey) -> bytes:
    return tenant_of(key.extra_key, key.cache_salt)


def _spilled_refs(node: TreeNode) -> list[SpillRef]:
    """The refs of spilled `node` and its (spilled) descendants."""
    refs, stack = [], [node]
    while stack:
        n = stack.pop()
        refs.append(n.spill)
        stack.extend(n.children.values())
    return refs
