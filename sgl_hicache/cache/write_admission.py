"""Write admission: which resident nodes the tier is written (`SpillAdmission`, issue 37).

An SSD wears with what is written, and a tier that writes every evicted node (and, with clean-ahead
or write-through, every cached one) can write far more than it ever reads back. Under
`SpillAdmission.REUSED` a node is written only for one of the reasons of `Reason`; the models are
HiCache's `write_through_selective` (a node goes to the host once its hit count reaches 2) and
Dynamo's frequency filter (blocks seen more than once are offloaded). Under `ALL` every node is
(today's behaviour). The cache asks `reason` where a write would happen: before an eviction's store
(`Spilling._spill_node`, spilling.py: a node not admitted is dropped, as sglang's plain cache drops it),
and before a write-through or a write-ahead (`clean_copies.py`: skipped). An eviction that only
points at a clean copy writes nothing and asks nothing.

The first law holds whatever this answers: a node not admitted is dropped and, if needed again,
recomputed; nothing here is ever served.

TP ranks: every input but the pins is the same on every rank (sglang's hit counts, the hints, which
reach every rank in the same iteration, the tree's shape and lengths). A pin may expire on one rank
a moment before another; an eviction's spills are agreed anyway (`Spilling._agree_on_spills`: a victim one
rank dropped is dropped on all), and write-throughs and write-aheads change no tree structure.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable

from sglang.srt.mem_cache.radix_cache import TreeNode

from sgl_hicache.config import SpillAdmission

REUSED_HITS = 2  # sglang counts a node's hits per request that inserted through it: its own is 1
HINTED = "spill_hinted"  # the node attribute a resume hint sets (kept by splits: `split`)


class Reason(enum.StrEnum):
    """Why a node is written to the tier."""

    ALL = "all"  # the rule is ALL
    WRITTEN = "written"  # its copy was written before (written through, or restored): storing it
    # again writes nothing unless another server evicted the file
    REUSED = "reused"  # a later request matched it (sglang's hit count >= REUSED_HITS)
    HINTED = "hinted"  # on the path of a resume hint (POST /hicache/prefetch)
    LONG = "long"  # at least `min_tokens` tokens
    HOLDS_SPILLED = "holds_spilled"  # it has spilled children: dropping it would drop them
    PINNED = "pinned"  # a pin covers it (POST /hicache/pin)


class WriteAdmission:
    def __init__(self, rule: SpillAdmission, min_tokens: int, pin_of: Callable[[TreeNode], object]) -> None:
        """`pin_of(node)`: the pin covering resident `node`, or None (retention.py)."""
        self.rule = rule
        self.min_tokens = min_tokens
        self._pin_of = pin_of

    def reason(self, node: TreeNode) -> Reason | None:
        """Why resident `node` is to be written to the tier; None: it is not (dropped at eviction,
        skipped ahead of it). Cheapest reasons first."""
        if self.rule is SpillAdmission.ALL:
            return Reason.ALL
        ref = getattr(node, "spill", None)
        if ref is not None and ref.count == len(node.key):
            return Reason.WRITTEN
        if node.hit_count >= REUSED_HITS:
            return Reason.REUSED
        if getattr(node, HINTED, False):
            return Reason.HINTED
        if self.min_tokens and len(node.key) >= self.min_tokens:
            return Reason.LONG
        if any(child.evicted for child in node.children.values()):
            return Reason.HOLDS_SPILLED
        if self._pin_of(node) is not None:
            return Reason.PINNED
        return None

    @staticmethod
    def hinted(nodes: Iterable[TreeNode]) -> None:
        """A resume hint's path (resident and spilled nodes): each is admitted from now on."""
        for node in nodes:
            setattr(node, HINTED, True)

    @staticmethod
    def split(head: TreeNode, tail: TreeNode) -> None:
        """`head` was split off `tail`: both keep the mark (sglang's split copies the hit count)."""
        if getattr(tail, HINTED, False):
            setattr(head, HINTED, True)
