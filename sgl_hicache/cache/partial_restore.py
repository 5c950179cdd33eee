"""Restores whose reads are still landing: slots taken early, verified chunks unpacked as they land.

An admitted request whose spilled prefix is still being read is deferred (`init_load_back` answers
"retry"). At each retry that finds verified bytes landed, its restore takes its slots (once) and
unpacks what landed (`SpillIO.unpack_landed`), so when the last read completes only the last chunks
remain to unpack. Safety rests on one rule: these slots belong to no tree node until the whole
restore is verified (`SpillIO.restore` succeeds, then the nodes are marked resident); if it fails,
or the request goes away, the slots are freed and nothing ever served them.

The slots of a partial restore count as evictable (`SpillRadixCache.evictable_size`): sglang's
admission budget and its idle leak check then see them as reclaimable, which they are: `evict`
frees partial restores before any tree node, at the cost of their unpack only (the bytes stay in
staging). A partial restore nobody comes back for is freed after `ttl_s`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from sgl_hicache.cache.spill_state import SpillRef

if TYPE_CHECKING:
    from sgl_hicache.cache.spill_io import SpillIO


@dataclass(eq=False)
class RestoreProgress:
    """The slots of one restore (its refs' tokens back to back) and, per ref, how many of its
    leading tokens are unpacked into them."""

    refs: tuple[SpillRef, ...]
    slots: torch.Tensor
    started: float = field(default_factory=time.monotonic)
    unpacked: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        assert len(self.slots) == sum(ref.count for ref in self.refs), "one slot per token of the refs"
        self.unpacked = self.unpacked or [0] * len(self.refs)

    @property
    def tokens(self) -> int:
        return len(self.slots)

    def parts(self) -> Iterator[tuple[SpillRef, torch.Tensor]]:
        """Each ref with its slice of the slots."""
        start = 0
        for ref in self.refs:
            yield ref, self.slots[start : start + ref.count]
            start += ref.count


@dataclass
class EarlyUnpackStats:
    """What early unpacking did (reported in `/server_info`)."""

    steps: int = 0  # unpacks of landed bytes done while reads of the restore were still in flight
    tokens: int = 0  # tokens they unpacked
    finished: int = 0  # restores completed from a partial restore
    evicted: int = 0  # partial restores freed to make room
    expired: int = 0  # partial restores freed after their time to live


class PartialRestores:
    """Partial restores by request id. Holds the allocator's slots; never touches the tree."""

    def __init__(self, allocator: Any, ttl_s: float) -> None:
        self.allocator = allocator
        self.ttl_s = ttl_s
        self.stats = EarlyUnpackStats()
        self._by_rid: dict[str, RestoreProgress] = {}

    @property
    def held_tokens(self) -> int:
        return sum(p.tokens for p in self._by_rid.values())

    def held_slots(self) -> list[torch.Tensor]:
        return [p.slots for p in self._by_rid.values()]

    def advance(self, rid: str, refs: tuple[SpillRef, ...], io: SpillIO,
                alloc: Callable[[int], torch.Tensor | None]) -> None:  # fmt: skip
        """Unpack what has landed of `rid`'s restore of `refs`, taking its slots (`alloc`) at the
        first call that finds verified bytes landed. Never blocks."""
        progress = self.take(rid, refs)
        if progress is None:
            if not io.landed_tokens(refs):
                return  # nothing to unpack yet: take no slots
            slots = alloc(sum(ref.count for ref in refs))
            if slots is None:
                return
            progress = RestoreProgress(refs, slots)
        if unpacked := io.unpack_landed(progress):
            self.stats.steps += 1
            self.stats.tokens += unpacked
        self.put(rid, progress)

    def get(self, rid: str) -> RestoreProgress | None:
        return self._by_rid.get(rid)

    def take(self, rid: str | None, refs: tuple[SpillRef, ...]) -> RestoreProgress | None:
        """Remove and return `rid`'s partial restore if it is for exactly `refs`; one for other refs
        (the tree changed under it: a split, another restore, a lost extent) is freed."""
        progress = self._by_rid.pop(rid, None) if rid is not None else None
        if progress is not None and progress.refs != refs:
            self.allocator.free(progress.slots)
            return None
        return progress

    def put(self, rid: str, progress: RestoreProgress) -> None:
        assert rid not in self._by_rid, f"request {rid} already has a partial restore"
        self._by_rid[rid] = progress

    def drop(self, rid: str | None) -> None:
        progress = self._by_rid.pop(rid, None) if rid is not None else None
        if progress is not None:
            self.allocator.free(progress.slots)

    def evict(self, num_tokens: int) -> int:
        """Free partial restores, oldest first, until `num_tokens` slots are freed or none is left;
        returns the slots freed."""
        freed = 0
        for rid in sorted(self._by_rid, key=lambda r: self._by_rid[r].started):
            if freed >= num_tokens:
                break
            freed += self._by_rid[rid].tokens
            self.drop(rid)
            self.stats.evicted += 1
        return freed

    def expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, p in self._by_rid.items() if now - p.started > self.ttl_s]:
            self.drop(rid)
            self.stats.expired += 1

    def clear(self) -> None:
        for rid in list(self._by_rid):
            self.drop(rid)
