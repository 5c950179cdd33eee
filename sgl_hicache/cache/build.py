"""`SpillCacheBuild`: everything a `SpillRadixCache` is built from, in one frozen dataclass.

The factory fills it (server/factory.py; tests/cache/conftest.py for tests) and the cache builds its
parts from it (spill_radix_cache.py): the tree, spilling, matching, admission, restores, layer-wise
restores, lifecycle. What the server opens (the tier, metrics, the hint inbox, the TP group) is
passed in here, never looked up by the cache (`cache/` never imports `server/`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sgl_hicache.cache.agreement import Agreement, SingleRank
from sgl_hicache.cache.controller import SpillController
from sgl_hicache.cache.hint_source import HintSource
from sgl_hicache.cache.metrics import SpillMetrics
from sgl_hicache.config import SpillConfig
from sgl_hicache.tier import NamespaceId


@dataclass(frozen=True)
class SpillCacheBuild:
    params: Any  # sglang's `CacheInitParams`: the pool's allocator, page size, ...
    config: SpillConfig
    metrics: SpillMetrics
    controller: SpillController | None  # None: no tier (spill off; evictions drop as in sglang)
    namespace_id: NamespaceId  # seeds every key: KV of another model or layout is never found
    hints: HintSource | None = None  # clients' hints (TP rank 0 of a server started by our launcher)
    agreement: Agreement = field(default_factory=SingleRank)  # what TP ranks agree on (one rank: nothing)
