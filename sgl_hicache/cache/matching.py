"""Matching: a prompt's cached prefix, resident and spilled, and the I/O started for it early.

- **Match** (`match`, sglang's `match_prefix`): the device-resident prefix as sglang's, then the
  spilled continuation as a host hit, which makes the scheduler call `init_load_back` when it
  admits the request (admission.py). Where the path ends, a warm restart's orphan extents of the
  request's tenant are attached (warm_start.py).
- **Lookups attached** (`attach_lookups`): the one point where finished cross-server lookups
  change the tree, at the start of a scheduler round's match or prefetch, never inside an eviction
  or a restore (docs/DESIGN.md, "Controller, tree, cache").
- **Prefetch** (`prefetch`, at a request's arrival or a client's resume hint): the reads of the
  spilled continuation start, and a lookup of other servers' extents where the tree ends.
Walks may split nodes: they run on every TP rank alike, whatever each rank's I/O does after.
"""

from __future__ import annotations

from array import array
from typing import Any, Protocol

from sglang.srt.mem_cache.base_prefix_cache import MatchResult
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from sgl_hicache.cache.clean_copies import CleanCopies
from sgl_hicache.cache.guard import GuardedPart, contained, nothing
from sgl_hicache.cache.owning_cache import OwningCache
from sgl_hicache.cache.spill_state import SpillRef
from sgl_hicache.cache.warm_start import WarmStart
from sgl_hicache.cache.write_admission import WriteAdmission
from sgl_hicache.tier.keys import PathHasher, tenant_of


class MatchingCache(OwningCache, Protocol):
    """What matching needs of the cache (`SpillRadixCache` is one)."""

    warm: WarmStart
    clean: CleanCopies
    write_admission: WriteAdmission
    epoch: bytes | None
    root_node: TreeNode
    page_size: int
    disable: bool
    is_eagle: bool

    def path_hasher(self, key: RadixKey) -> PathHasher: ...


def no_match(root: TreeNode) -> MatchResult:
    """Nothing cached: every part of the answer is the root."""
    return MatchResult(device_prefix_len=0, last_device_node=root, last_host_node=root, best_match_node=root)


class Matching(GuardedPart[MatchingCache]):
    @property
    def prune_lost_on_walk(self) -> bool:
        """Only a single rank may act on a locally LOST extent while walking (agreement.py)."""
        return self.cache.agreement.size == 1

    def match(self, key: RadixKey) -> MatchResult:
        """sglang's `match_prefix` of `key`, the spilled continuation as its host hit."""
        cache = self.cache
        self.attach_lookups()
        cache.spill_metrics.inc("match_requests")
        key, _ = key.maybe_to_bigram_view(cache.is_eagle)
        if cache.disable or len(key) == 0:
            return no_match(cache.root_node)
        key = key.page_aligned(cache.page_size)
        if len(key) == 0:
            return no_match(cache.root_node)
        last_device, device_len, last_spilled, host_len = self.walk(key)
        return MatchResult(device_prefix_len=device_len, last_device_node=last_device, last_host_node=last_spilled,
                           best_match_node=last_spilled, host_hit_length=host_len)  # fmt: skip

    def walk(self, key: RadixKey) -> tuple[TreeNode, int, TreeNode, int]:
        """(deepest device node, device tokens, deepest spilled node, spilled tokens) on `key`'s
        path, attaching orphan tier extents (warm restart of salted tenants) where the path ends."""
        cache = self.cache
        values, last_device = cache.tree.match_resident(cache.root_node, key)
        device_len = sum(len(v) for v in values)
        last_spilled, host_len = cache.tree.match_spilled(
            last_device, key[device_len:], self.prune_lost_on_walk
        )
        end = device_len + host_len
        lazy_attach = cache.warm.orphans and cache.agreement.size == 1  # TP > 1: a local outcome, not agreed
        if end < len(key) and lazy_attach and self._attach_orphans(last_spilled, key, end):
            last_spilled, more = cache.tree.match_spilled(last_spilled, key[end:], self.prune_lost_on_walk)
            host_len += more
        return last_device, device_len, last_spilled, host_len

    def _attach_orphans(self, node: TreeNode, key: RadixKey, pos: int) -> int:
        """`WarmStart.attach_on_match`, or 0 for a key holding an id no extent key can name."""
        tokens = key.raw_token_ids()
        try:
            return self.cache.warm.attach_on_match(
                node, key, pos, self.cache.path_hasher(key).update(tokens[:pos])
            )
        except ValueError:
            return 0

    @contained("match (attaching lookups)", nothing)
    def attach_lookups(self) -> None:
        """The one point where finished cross-server lookups change the tree: at the start of a
        scheduler round's match or prefetch, never inside an eviction or a restore. Each result's
        verified segments become spilled nodes where its prompt's match ends now, and their reads
        start."""
        cache = self.cache
        if cache.controller is None:
            return
        self._prune_gone()
        m = cache.spill_metrics
        for found, result in cache.controller.take_lookups():
            m.inc("lookup_fs_calls", result.fs_calls)
            m.inc("lookup_refused", result.refused)
            m.inc("lookup_stale", result.stale)
            m.inc("lookup_found_tokens", result.end - result.request.start)
            if not found.segments or found.epoch != (cache.epoch or b""):
                continue
            key: RadixKey = found.tag  # type: ignore[assignment]
            _, device_len, node, host_len = self.walk(key)
            added = cache.tree.attach_segments(node, device_len + host_len, key, found.segments)
            m.inc("lookup_attached_tokens", sum(n.spill.count for n in added))
            if added:
                cache.controller.prefetch([n.spill for n in added])

    def _prune_gone(self) -> None:
        """Spilled nodes whose extent the tier evicted or could not write leave the tree with their
        subtree (a restore of them could only miss), and the router hears of it (events.py). Only
        on a single rank: with TP > 1 that is a rank's own outcome, and such nodes go when a
        restore agrees they are lost (agreement.py)."""
        cache = self.cache
        assert cache.controller is not None
        gone = cache.tree.events.gone.take(cache.controller.tier)
        for node in gone if self.prune_lost_on_walk else ():
            if node.evicted and cache.tree.attached(node):
                cache.tree.prune(node)

    # ---- prefetch at arrival ----------------------------------------------------------------

    def prefetch(self, token_ids: Any, extra_key: str | None, cache_salt: str | None, rid: str | None,
                 hinted: bool) -> int:  # fmt: skip
        """`SpillRadixCache.prefetch` after its poll (see there): the tokens on their way."""
        cache = self.cache
        self.attach_lookups()
        key = RadixKey(array("q", token_ids), extra_key, cache_salt=cache_salt).page_aligned(cache.page_size)
        # The walk may split nodes: every TP rank takes it, also one whose spill was disabled.
        last, device_len, end, matched = self.walk(key)
        if hinted:  # the same walk and marks on every rank
            cache.write_admission.hinted(cache.tree.path_up(end, cache.root_node) or [])
            cache.clean.changed()
        self._start_lookup(key, device_len + matched, rid)
        if not matched or cache.controller is None:
            return 0
        cache.spill_metrics.inc("prefetch_requests")
        return self._start_reads([node.spill for node in cache.tree.path_up(end, last) or []])

    # The I/O steps of a prefetch fail alone (a rank's own outcome): the walk above, which may split
    # nodes, has run on every rank, so TP ranks keep identical trees whatever these do.
    @contained("prefetch (lookup)", nothing)
    def _start_lookup(self, key: RadixKey, held: int, rid: str | None) -> None:
        """Off with TP > 1 (lookups.py), and on a root no other server uses (`CleanCopies.root_shared`): there a
        lookup could find only our own extents, which the tree or the warm start already holds."""
        cache = self.cache
        if (
            cache.controller is None
            or cache.agreement.size > 1
            or cache.is_eagle
            or not cache.clean.root_shared()
        ):
            return
        tenant = tenant_of(key.extra_key, key.cache_salt)
        if cache.controller.lookups.start(cache.controller.tier, key.raw_token_ids(), held, tenant,
                                         cache.epoch or b"", rid, tag=key, cache_salt=key.cache_salt):  # fmt: skip
            cache.spill_metrics.inc("lookups")

    def _no_reads(self, *_args: Any) -> int:
        """A prefetch whose reads could not start: none are on their way (the restore starts them)."""
        return 0

    @contained("prefetch (reads)", _no_reads)
    def _start_reads(self, refs: list[SpillRef]) -> int:
        return self.cache.controller.prefetch(refs) if self.cache.controller is not None else 0
