"""Tiers for tests: `FaultyTier` wraps any tier and injects latency, failures and corruption."""

from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier

__all__ = ["FaultSpec", "FaultyTier"]
