"""The spill tier: a durable, checksummed, capacity-bounded extent store (see docs/FORMAT.md).

base.py         Tier contract, Completion/Status/TierStats result types
keys.py         Namespace, KVLayout, chained ExtentKeys
format.py       extent header encode/decode (docs/FORMAT.md)
paths.py        fan-out file layout, free space
trust.py        the directory must be ours; its secret, which keys every header MAC
recreate.py     a directory removed while serving: re-created, secret written back
nvme.py         NvmeTier, the implementation on a directory: submit/complete, store and load jobs
mooncake.py     MooncakeTier, the implementation on a Mooncake Store (--hicache-spill-backend mooncake)
mooncake_io.py  one extent as Mooncake objects (the file format, cut at its seams), written and verified
mooncake_client.py  the Mooncake client: setup, object names, result codes
mooncake_source.py  lookups over the store (lookup.py's walk, aliases as objects)
recent.py       the bounded index of a tier that cannot list its store
publish.py      a store's file half: "present" (adopting others' files), write + account outcome
store.py        write one extent              load.py        read/verify one extent's chunks
capacity.py     budget, watermark, eviction   index.py       LRU index, pins, byte accounting
volume.py       is the volume larger than the free-space watermark plus a useful capacity?
scan.py         startup index rebuild         integrity.py   check_integrity against the files
ledger.py       the root's budget, shared by all its processes (a ledger file under a POSIX lock)
budget.py       the ledger's content (State, leases) and what a reservation returns and calls back
filelock.py     that lock: private open, probe (local-only NFS locks too), wait with a deadline
shared.py       capacity.py's directory-wide half: leases, evicting others' extents, `Tier.shared`
sweep.py        stat-only walk of the whole root, accounted unlinks   owner.py  writer identity
aliases.py      path-key alias links: publish, read, remove dangling  lookup.py  cross-server lookups
scheduler.py    I/O threads, loads first      completions.py tickets and completions
directio.py     O_DIRECT probe, aligned buffers, exact positional I/O
faults.py       errno -> Status, rate-limited logs, counters
faulty.py       FaultyTier: latency/failure/corruption injection for other components' tests
"""

from __future__ import annotations

from sgl_hicache.config import SpillBackend, TierConfig
from sgl_hicache.tier.base import Completion, ExtentInfo, IndexedTier, Op, Status, Ticket, Tier, TierStats
from sgl_hicache.tier.directio import alloc_aligned
from sgl_hicache.tier.keys import ROOT_KEY, ExtentKey, KVDtype, KVLayout, Namespace, NamespaceId, chain_key
from sgl_hicache.tier.trust import UntrustedDirectory


def open_tier(config: TierConfig, namespace: Namespace) -> IndexedTier:
    """Open (creating if needed) the tier in `config.directory` for `namespace`.

    Scans existing extents of the namespace (rebuilding the index, enforcing the budget, removing
    stale temp files and files not sealed with the directory's secret) before returning. Raises
    `UntrustedDirectory` (an OSError: one line saying how to fix it) if the directory or its
    secret is a symlink, not owned by this uid, or open to group/other (see trust.py), and
    OSError if the directory cannot be created.

    With `config.backend` mooncake: joins the Mooncake Store as a client (mooncake.py); the
    directory holds only the secret that seals every header. Raises `MooncakeUnavailable` (an
    OSError) if the client cannot be set up.
    """
    if config.backend is SpillBackend.MOONCAKE:
        from sgl_hicache.tier.mooncake import MooncakeTier

        return MooncakeTier(config, namespace)
    from sgl_hicache.tier.nvme import NvmeTier

    return NvmeTier(config, namespace)


__all__ = [
    "ROOT_KEY", "Completion", "ExtentInfo", "ExtentKey", "IndexedTier", "KVDtype", "KVLayout", "Namespace", "NamespaceId",
    "Op", "Status", "Ticket", "Tier", "TierStats", "UntrustedDirectory", "alloc_aligned", "chain_key",
    "open_tier",
]  # fmt: skip
