"""State of spilled radix-tree nodes.

A spilled node keeps its place in the tree (key, parent, children) but holds no device slots
(`node.value is None`); `node.spill` is a `SpillRef` saying which tokens of which `Extent` hold its KV.
One eviction writes one extent per node; splitting a spilled node later leaves both halves pointing
into the same extent at different offsets. Extents are shared, mutable records: their state moves
WRITING → ON_TIER when the tier confirms the write, or → LOST when it fails, is found corrupt or was
evicted from the tier; nodes pointing into a LOST extent are pruned on their next visit.

Invariant (root-closed): the device-resident nodes form a subtree containing the root; every
descendant of a spilled node is spilled.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from sgl_hicache.cache.device import Copy
from sgl_hicache.tier import ExtentKey


class ExtentState(enum.Enum):
    WRITING = "writing"  # packed KV held in staging; the tier's write is in flight
    ON_TIER = "on_tier"  # published in the tier
    LOST = "lost"  # write failed, or a read found it missing/corrupt: recompute


@dataclass(eq=False)
class Extent:
    key: ExtentKey
    tokens: int
    state: ExtentState = ExtentState.WRITING
    staged: torch.Tensor | None = field(default=None, repr=False)  # packed bytes while WRITING
    pack: Copy | None = field(default=None, repr=False)  # the copy filling `staged`, until it is done


@dataclass(frozen=True)
class SpillRef:
    """Tokens [offset, offset + count) of `extent` are this node's KV."""

    extent: Extent
    offset: int
    count: int

    def split(self, at: int) -> tuple[SpillRef, SpillRef]:
        return SpillRef(self.extent, self.offset, at), SpillRef(
            self.extent, self.offset + at, self.count - at
        )

    @property
    def whole(self) -> bool:
        return self.offset == 0 and self.count == self.extent.tokens
