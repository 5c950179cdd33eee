"""What every part of the cache needs of the cache that owns it (`SpillRadixCache` is one).

Each part (spilling, matching, admission, restoring, layerwise_flow, lifecycle) declares its own
`<Part>Cache(OwningCache, Protocol)` (`SpillingCache`, `MatchingCache`, ...) with only the extra
members it reads, and holds the cache as `self.cache`, so the parts never import the cache and the
shared members are named once, here.
"""

from __future__ import annotations

from typing import Protocol

from sgl_hicache.cache.agreement import Agreement
from sgl_hicache.cache.controller import SpillController
from sgl_hicache.cache.metrics import SpillMetrics
from sgl_hicache.cache.tree import SpillTree


class OwningCache(Protocol):
    controller: SpillController | None  # None: spill disabled (or never opened)
    spill_metrics: SpillMetrics
    errors_logged: set[str]  # guard names whose first error was logged (guard.py)
    agreement: Agreement  # the TP ranks' collective
    tree: SpillTree

    def disable_spill(self) -> None: ...
