"""Shared test data (no pytest import: child processes of the crash tests load this too)."""

from __future__ import annotations

import numpy as np

from sgl_hicache.tier import ROOT_KEY, ExtentKey, KVDtype, KVLayout, Namespace, chain_key

NS = Namespace(
    "test-model", KVLayout(num_layers=2, num_heads=2, head_dim=64, dtype=KVDtype.BF16, page_size=4)
)
CHUNK = 64 * 1024


def payload_for(i: int, nbytes: int) -> np.ndarray:
    """The deterministic payload of extent `i` (so any process can check any extent)."""
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)


def tokens_for(i: int) -> list[int]:
    """The tokens extent `i` holds (its key is their chain key after ROOT_KEY)."""
    return [i, i + 1]


def key_for(i: int, ns: Namespace = NS) -> ExtentKey:
    return chain_key(ns.id, ROOT_KEY, tokens_for(i))
