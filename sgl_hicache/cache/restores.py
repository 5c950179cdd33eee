"""Restores in progress: the slots each has taken and how much of its KV is unpacked into them.

A request whose spilled prefix is still being read is deferred (`init_load_back` answers "retry").
At a retry that finds verified bytes landed, its restore takes its slots (once) and unpacks what
landed, so when the last read completes only the last chunks remain. One rule makes this safe, and
one makes it leak-free:

- **The table owns the slots** of every restore from the moment they are allocated until the tree
  takes them (`hand_over`, after the whole restore is verified) or they are freed: whatever raises
  in between, the slots are in the table, and dropping the entry frees them. Nothing serves them
  before `hand_over`.
- **Freeing waits for the copies**: slots given back while an unpack into them may still run, or
  handed to the tree, are preceded by a device-side wait of sglang's forward for that copy
  (`CopyEngine.forward_waits`), so no forward reads a slot before its unpack, and none writes a slot
  an unpack still writes.

The slots of a partial restore count as evictable (`SpillRadixCache.evictable_size`): `evict` frees
restores in progress before any tree node, at the cost of their unpack only (the bytes stay in
staging, except those of extents a streamed restore unpacked whole and gave back: read again). One
nobody comes back for is freed after `ttl_s` (with TP > 1 never by time: the table must be the same
on every rank, since `evict` and `evictable_size` read it; there it goes when evicted, admitted or
flushed).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from sgl_hicache.cache.device import Copy, CopyEngine
from sgl_hicache.cache.spill_state import SpillRef


@dataclass(eq=False)
class RestoreProgress:
    """The slots of one restore (its refs' tokens back to back), per ref and layer group how many of
    its leading tokens are unpacked into them, and the last unpack enqueued (`group_copies`: per
    group, the last unpack of that group's layers)."""

    refs: tuple[SpillRef, ...]
    slots: torch.Tensor
    groups: int = 1
    started: float = field(default_factory=time.monotonic)
    unpacked: list[list[int]] = field(default_factory=list)
    last_copy: Copy | None = None
    group_copies: list[Copy | None] = field(default_factory=list)
    released: int = 0  # reads given back before the restore completed (streamed through staging)
    read_bytes: int = 0  # packed bytes unpacked from tier reads (not a write's staging): counted at success

    def __post_init__(self) -> None:
        assert len(self.slots) == sum(ref.count for ref in self.refs), "one slot per token of the refs"
        self.unpacked = self.unpacked or [[0] * self.groups for _ in self.refs]
        self.group_copies = self.group_copies or [None] * self.groups

    @property
    def tokens(self) -> int:
        return len(self.slots)

    def group_done(self, group: int) -> bool:
        """Whether every token of every ref is unpacked in layer group `group`."""
        return all(done[group] == ref.count for done, ref in zip(self.unpacked, self.refs, strict=True))

    def ref_done(self, i: int) -> bool:
        """Whether ref i is unpacked whole, in every layer group: it needs no more bytes."""
        return all(n == self.refs[i].count for n in self.unpacked[i])

    def done_extents(self) -> set[int]:
        """The extents (by identity) every ref of which is unpacked whole, in every layer group: the
        restore needs no more of their bytes."""
        done: set[int] = set()
        partial: set[int] = set()
        for i, ref in enumerate(self.refs):
            (done if self.ref_done(i) else partial).add(id(ref.extent))
        return done - partial

    def pending_extents(self) -> set[int]:
        """The extents (by identity) some ref of which is not unpacked whole yet: the restore still
        needs their bytes (their reads must not be given up)."""
        return {id(ref.extent) for i, ref in enumerate(self.refs) if not self.ref_done(i)}

    @property
    def any_unpacked(self) -> bool:
        return any(any(done) for done in self.unpacked)

    def parts(self) -> Iterator[tuple[int, SpillRef, torch.Tensor]]:
        """Each ref's index, the ref and its slice of the slots."""
        start = 0
        for i, ref in enumerate(self.refs):
            yield i, ref, self.slots[start : start + ref.count]
            start += ref.count


@dataclass
class EarlyUnpackStats:
    """What early unpacking did (reported in `/server_info`)."""

    steps: int = 0  # unpacks of landed bytes done while reads of the restore were still in flight
    tokens: int = 0  # tokens they unpacked
    finished: int = 0  # restores completed from a partial restore
    evicted: int = 0  # partial restores freed to make room
    expired: int = 0  # partial restores freed after their time to live


class Restores:
    """Restores in progress by owner (a request id, or a key of the caller's). Owns their slots."""

    def __init__(self, allocator: Any, engine: CopyEngine, ttl_s: float) -> None:
        self.allocator = allocator
        self.engine = engine
        self.groups = engine.layout.count
        self.ttl_s = ttl_s
        self.stats = EarlyUnpackStats()
        self._by_owner: dict[object, RestoreProgress] = {}
        self._landing: list[RestoreProgress] = []  # handed over before every group landed (layer-wise)

    @property
    def held_tokens(self) -> int:
        return sum(p.tokens for p in self._by_owner.values())

    def held_slots(self) -> list[torch.Tensor]:
        return [p.slots for p in self._by_owner.values()]

    def get(self, owner: object) -> RestoreProgress | None:
        return self._by_owner.get(owner)

    def open(self, owner: object, refs: tuple[SpillRef, ...], slots: torch.Tensor) -> RestoreProgress:
        """Register fresh `slots` for `owner`'s restore of `refs`: the table owns them from now on."""
        assert owner not in self._by_owner, f"{owner} already has a restore in progress"
        progress = RestoreProgress(refs, slots, self.groups)
        self._by_owner[owner] = progress
        return progress

    def current(self, owner: object, refs: tuple[SpillRef, ...]) -> RestoreProgress | None:
        """`owner`'s restore if it is for exactly `refs`; one for other refs (the tree changed under
        it: a split, another restore, a lost extent) is freed."""
        progress = self._by_owner.get(owner)
        if progress is not None and progress.refs != refs:
            self.drop(owner)
            return None
        return progress

    def hand_over(self, owner: object, landing: bool = False) -> RestoreProgress:
        """Remove `owner`'s restore; its slots become the caller's (the tree's). Every later
        forward runs after its unpacks. `landing`: a layer-wise restore, handed over before its
        reads all landed: its reads are still needed (`needs`) until the caller says `landed`."""
        progress = self._by_owner.pop(owner)
        self.engine.forward_waits(progress.last_copy)
        if landing:
            self._landing.append(progress)
        return progress

    def landed(self, progress: RestoreProgress) -> None:
        """A layer-wise restore handed over with `landing` ended (settled or failed): it needs no read."""
        self._landing = [p for p in self._landing if p is not progress]

    def needs(self, extent_id: int, but: RestoreProgress | None = None) -> bool:
        """Whether a restore in progress other than `but` (in the table, or handed over while its
        reads land) still needs bytes of extent `extent_id`: a read shared by several restores is
        given up only by the last that needs it."""
        return any(
            p is not but and extent_id in p.pending_extents()
            for p in (*self._by_owner.values(), *self._landing)
        )

    def landing_extents(self) -> set[int]:
        """The extents (by identity) layer-wise restores in progress still need bytes of."""
        return {eid for p in self._landing for eid in p.pending_extents()}

    def drop(self, owner: object) -> None:
        """Free `owner`'s slots, if it has a restore (after its unpacks, on the device)."""
        progress = self._by_owner.pop(owner, None)
        if progress is not None:
            self.engine.forward_waits(progress.last_copy)
            self.allocator.free(progress.slots)

    def evict(self, num_tokens: int) -> int:
        """Free restores in progress, oldest first, until `num_tokens` slots are freed or none is
        left; returns the slots freed."""
        freed = 0
        for owner in sorted(self._by_owner, key=lambda o: self._by_owner[o].started):
            if freed >= num_tokens:
                break
            freed += self._by_owner[owner].tokens
            self.drop(owner)
            self.stats.evicted += 1
        return freed

    def expire(self) -> None:
        now = time.monotonic()
        for owner in [o for o, p in self._by_owner.items() if now - p.started > self.ttl_s]:
            self.drop(owner)
            self.stats.expired += 1

    def clear(self) -> None:
        for owner in list(self._by_owner):
            self.drop(owner)
        self._landing = []  # a reset: the tree that held their slots is gone

    def forget(self) -> None:
        """Forget every restore without freeing its slots: only where sglang clears the whole
        allocator next (a flush's fallback), or where freeing itself is what failed. Forwards still
        wait for every unpack enqueued, since the slots will be handed out again."""
        if self._by_owner:
            self.engine.forward_waits(self.engine.load_barrier())
        self._by_owner.clear()
        self._landing = []
