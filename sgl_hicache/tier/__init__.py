"""The spill tier: a durable, checksummed, capacity-bounded extent store (see docs/FORMAT.md).

The top holds the contract and what every backend shares; each backend is a wing, found through
`registry.py`:

base.py         the Tier contract (abstract classes; their docstrings are the promises)
results.py      the values it takes and gives: Ticket, Buffer, Op, Status, Completion, lookups, TierStats
keys.py         Namespace, KVLayout, chained ExtentKeys, path keys
format.py       extent header encode/decode, DirectoryMac (docs/FORMAT.md)
groups.py       layer groups: sections, chunk spans, regrouping a payload
codec.py        an extent encoded (chunks, compression, sealed header) and decoded (plan, verify)
path_lookup.py  cross-server lookups: the walk over path-key aliases, claims, alias marks
completions.py  tickets and completions   scheduler.py  I/O threads, loads first
progress.py     a load in flight: its pieces done in any order, its verified prefix (`landed`)
directio.py     O_DIRECT probe, aligned buffers, exact positional I/O
faults.py       errno -> Status, rate-limited logs, counters
trust.py        the directory must be ours; its secret, which keys every header MAC
registry.py     SpillBackend -> the wing that implements it (lazy imports)
file/           the backend on a directory (`FileTier`); file/budget/ its byte budget
mooncake/       the backend on a Mooncake Store (`MooncakeTier`)
testing/        FaultyTier: latency/failure/corruption injection for other components' tests
"""

from __future__ import annotations

from sgl_hicache.config import TierConfig
from sgl_hicache.tier.base import IndexedTier, Tier
from sgl_hicache.tier.directio import alloc_aligned
from sgl_hicache.tier.keys import ROOT_KEY, ExtentKey, KVDtype, KVLayout, Namespace, NamespaceId, chain_key
from sgl_hicache.tier.registry import backend_class
from sgl_hicache.tier.results import Completion, ExtentInfo, Op, Status, Ticket, TierStats
from sgl_hicache.tier.trust import UntrustedDirectory


def open_tier(config: TierConfig, namespace: Namespace) -> IndexedTier:
    """Open (creating if needed) the tier in `config.directory` for `namespace`.

    Scans existing extents of the namespace (rebuilding the index, enforcing the budget, removing
    stale temp files and files not sealed with the directory's secret) before returning. Raises
    `UntrustedDirectory` (an OSError: one line saying how to fix it) if the directory or its
    secret is a symlink, not owned by this uid, or open to group/other (see trust.py), and
    OSError if the directory cannot be created.

    With `config.backend` mooncake: joins the Mooncake Store as a client (mooncake/backend.py); the
    directory holds only the secret that seals every header. Raises `MooncakeUnavailable` (an
    OSError) if the client cannot be set up.
    """
    return backend_class(config.backend)(config, namespace)


__all__ = [
    "ROOT_KEY", "Completion", "ExtentInfo", "ExtentKey", "IndexedTier", "KVDtype", "KVLayout", "Namespace", "NamespaceId",
    "Op", "Status", "Ticket", "Tier", "TierStats", "UntrustedDirectory", "alloc_aligned", "chain_key",
    "open_tier",
]  # fmt: skip
