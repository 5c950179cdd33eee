"""Where each backend lives: `SpillBackend` -> the module and class that implement it, imported only
when that backend is opened (a server on files never imports Mooncake's client, nor the reverse).
As sglang's `mem_cache/storage/backend_factory.py`: a new backend is one entry here and one wing
under `tier/`; the top of `tier/` never imports a wing otherwise (tests/test_import_graph.py)."""

from __future__ import annotations

import importlib
from typing import NamedTuple, Protocol

from sgl_hicache.config import SpillBackend, TierConfig
from sgl_hicache.tier.base import IndexedTier
from sgl_hicache.tier.keys import Namespace


class Opener(Protocol):
    def __call__(self, config: TierConfig, namespace: Namespace) -> IndexedTier: ...


class Backend(NamedTuple):
    module: str
    cls: str


BACKENDS = {
    SpillBackend.FILE: Backend("sgl_hicache.tier.file.backend", "FileTier"),
    SpillBackend.MOONCAKE: Backend("sgl_hicache.tier.mooncake.backend", "MooncakeTier"),
}


def backend_class(backend: SpillBackend) -> Opener:
    """The class implementing `backend`, its module imported now (lazily, once)."""
    where = BACKENDS[backend]
    opener: Opener = getattr(importlib.import_module(where.module), where.cls)
    return opener
