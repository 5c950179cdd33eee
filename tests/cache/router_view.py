"""What a KV-aware router knows of one worker, built from its KV cache events alone, and what it
should know: the blocks of the worker's tree, computed here from the tokens with sglang's page hash
(not from any node's cached hash), resident pages under GPU, spilled ones under DISK."""

from __future__ import annotations

import hashlib
from typing import Any

from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64


class RouterView:
    """Per medium, the block hashes a router holds for one worker (smg's relay keeps one record per
    hash and tier). Applying an event that a true stream never sends fails: a block stored twice
    under one medium, removed without being stored, or stored below a parent it does not know."""

    def __init__(self) -> None:
        self.blocks: dict[str, set[int]] = {}
        self.events = 0

    def apply(self, events: list[Any]) -> None:
        for event in events:
            self.events += 1
            if isinstance(event, AllBlocksCleared):
                self.blocks.clear()
            elif isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                held = self.blocks.get(medium_name(event.medium), set())
                missing = [h for h in event.block_hashes if h not in held]
                assert not missing, f"{len(missing)} blocks removed from {event.medium} never stored there"
                held.difference_update(event.block_hashes)
            else:
                raise AssertionError(f"unknown event {event!r}")

    def _stored(self, event: BlockStored) -> None:
        assert len(event.block_hashes) * event.block_size == len(event.token_ids), "unaligned store"
        known = set().union(*self.blocks.values()) if self.blocks else set()
        assert event.parent_block_hash is None or event.parent_block_hash in known, (
            "store below an unknown parent"
        )
        held = self.blocks.setdefault(medium_name(event.medium), set())
        twice = [h for h in event.block_hashes if h in held]
        assert not twice, f"{len(twice)} blocks stored twice under {event.medium}"
        held.update(event.block_hashes)

    def view(self) -> dict[str, set[int]]:
        return {medium: set(held) for medium, held in self.blocks.items() if held}


def medium_name(medium: Any) -> str:
    """The medium as it goes on the wire (msgspec encodes sglang's `StorageMedium` by value)."""
    return str(getattr(medium, "value", medium))


def page_hashes(tokens: list[int], salt: str | None, page_size: int) -> list[int]:
    """sglang's published block hash of each full page of `tokens` (a SHA-256 chain over pages;
    a salted tenant's chain starts from its salt's seed)."""
    seed = None if salt is None else hashlib.sha256(b"sglang-cache-salt-v1\0" + salt.encode()).hexdigest()
    hashes = get_hash_str(list(tokens), seed, page_size=page_size)
    return [hash_str_to_int64(h) for h in hashes]


def tree_view(cache: Any) -> dict[str, set[int]]:
    """The blocks of `cache`'s tree: resident nodes' pages under GPU, spilled nodes' under DISK."""
    out: dict[str, set[int]] = {}
    page = cache.page_size
    stack: list[tuple[Any, list[int]]] = [(child, []) for child in cache.root_node.children.values()]
    while stack:
        node, before = stack.pop()
        path = before + list(node.key.token_ids)
        mine = page_hashes(path, node.key.cache_salt, page)[len(before) // page :]
        held = out.setdefault("DISK" if node.evicted else "GPU", set())
        assert held.isdisjoint(mine), "two nodes of the tree hash alike"
        held.update(mine)
        stack.extend((child, path) for child in node.children.values())
    return {medium: held for medium, held in out.items() if held}
