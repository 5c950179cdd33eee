"""The settings that are a choice among names: each an Enum whose docstring says what each name does."""

from __future__ import annotations

import enum


class Fsync(enum.StrEnum):
    """When the tier makes a published extent durable.

    NONE: never (the page cache decides; a power loss may lose recent extents, never corrupt one,
    since every read verifies checksums). DATA: fdatasync each extent before its atomic rename
    (default: a crash never leaves a published-but-empty file). FULL: DATA plus an fsync of the
    directory after the rename, so the publish itself survives power loss.
    """

    NONE = "none"
    DATA = "data"
    FULL = "full"


class Compression(enum.StrEnum):
    NONE = "none"
    ZSTD = "zstd"


class PrefetchPolicy(enum.StrEnum):
    """When a request whose prefix runs into spilled KV becomes schedulable (the names are those of
    sglang's `--hicache-storage-prefetch-policy`; our former `wait` is accepted for WAIT_COMPLETE).

    Restores are all or nothing: a request either gets its whole spilled prefix back or recomputes it.
    WAIT_COMPLETE: only after its reads landed or failed (bounded by the tier's I/O timeout,
    max(`prefetch_timeout_s`, 10 s)). TIMEOUT: waits up to `prefetch_timeout_s`, then recomputes.
    BEST_EFFORT: at once; if the reads have not landed yet the prefix is recomputed.
    A policy also bounds how long admission waits for a cross-server lookup. Both limits, one rule per
    policy, are set in one place: `sgl_hicache.cache.restore_policy.RestorePolicy.of`.
    """

    WAIT_COMPLETE = "wait_complete"
    TIMEOUT = "timeout"
    BEST_EFFORT = "best_effort"

    @classmethod
    def _missing_(cls, value: object) -> PrefetchPolicy | None:
        return cls.WAIT_COMPLETE if value == "wait" else None


class WritePolicy(enum.StrEnum):
    """When KV is written to the tier (the names are those of sglang's `--hicache-write-policy`).

    WRITE_BACK: when it is evicted from the device pool (one write per eviction; KV that is never
    evicted is never written). WRITE_THROUGH: also as soon as the tree takes it (each insert writes
    the resident nodes on the request's path that have no copy on the tier yet); an eviction of such
    a node then writes nothing, and servers sharing the tier find KV that is still resident on the
    server that computed it (a router moving a conversation to another server). More tier writes
    and staging traffic in exchange; the tier's LRU budget bounds the bytes either way.
    """

    WRITE_BACK = "write_back"
    WRITE_THROUGH = "write_through"


class SpillAdmission(enum.StrEnum):
    """Which nodes the tier is written (cache/write_admission.py): an SSD wears with what is written.

    ALL: every node an eviction meets (`min_spill_tokens` aside), and ahead of eviction every node
    write-through and clean-ahead reach. REUSED: only a node that was reused (a request later than
    the one that cached it matched it: its hit count is 2 or more, as HiCache's
    `write_through_selective` counts them), is on the path of a resume hint, is pinned, has at least
    `admission_min_tokens` tokens, already has its copy on the tier, or holds spilled children
    (dropping it would drop them). Any other node an eviction meets is dropped, as sglang's plain
    cache drops it (recomputed if needed again), and write-through and clean-ahead skip it.
    """

    ALL = "all"
    REUSED = "reused"


class KvEventsMedium(enum.StrEnum):
    """The medium a spilled node's pages are announced under in KV cache events (cache/events.py).

    DISK: the truthful name (our tier is a directory or a store, not host memory). CPU_PINNED: for a
    router that indexes only the device and host tiers (smg 1.13 routes on `GPU` and `CPU_PINNED`
    blocks and leaves `DISK` ones out), so that it routes a conversation to the server holding its
    spilled history; as for sglang's host tier, a hit there restores without recompute."""

    DISK = "disk"
    CPU_PINNED = "cpu_pinned"


class SpillBackend(enum.StrEnum):
    """Where extents go. FILE: a directory (`tier/file/backend.py`; shared by the servers mounting it).
    MOONCAKE: a Mooncake Store (`tier/mooncake/backend.py`): one master, every server a client contributing
    DRAM, the master owning placement and eviction; the directory then holds only `.secret`."""

    FILE = "file"
    MOONCAKE = "mooncake"
