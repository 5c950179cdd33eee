"""The values the tier contract (`base.py`) takes and gives back: plain data, no behaviour.

In: `Ticket`s name submitted operations, `Buffer`s hold payloads and destinations, a `LookupRequest`
asks for extents continuing a prompt. Out: a `Completion` (its `Op` and `Status`) per operation, a
`LookupResult` of `Segment`s per lookup, `ExtentInfo` per indexed extent, `TierStats` counters.
What each means to a caller is written on the `Tier` method that takes or returns it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NewType, TypeAlias

import numpy as np

if TYPE_CHECKING:
    import torch

from sgl_hicache.tier.keys import ExtentKey

Ticket = NewType("Ticket", int)
"""Names one submitted operation; unique for the life of a tier object."""

Buffer: TypeAlias = "memoryview | bytearray | bytes | np.ndarray | torch.Tensor"
"""A contiguous host buffer (a torch tensor must be a contiguous CPU tensor); loads need a
writable one. Any dtype: the tier sees bytes."""


class Op(enum.Enum):
    STORE = "store"
    LOAD = "load"
    REMOVE = "remove"  # `submit_remove`; `nbytes` of its completion: files removed
    PURGE = "purge"  # `submit_purge`; `nbytes` of its completion: files removed


class Status(enum.Enum):
    """Outcome of one operation. Only OK means the bytes (stored or loaded) are good."""

    OK = "ok"
    MISS = "miss"  # load: no such extent (never stored, evicted, removed by another process)
    CORRUPT = "corrupt"  # load: checksum, truncation, version or namespace mismatch; extent dropped
    #                     (a newer format version is a MISS instead: kept for the newer server)
    MISMATCH = "mismatch"  # load: well-formed, but not what the key names (its parent and tokens do not
    #                       hash to the key) or shorter than requested; extent dropped
    NO_SPACE = "no_space"  # store: over budget with nothing evictable, or the volume is full
    IO_ERROR = "io_error"  # EIO, EACCES, EROFS, directory gone for good, ...; logged (rate-limited)
    REJECTED = "rejected"  # bad request: destination too small, extent larger than capacity, closed,
    #                       or abandoned by close(timeout_s)


@dataclass(frozen=True)
class Completion:
    """Result of one operation. `nbytes`: payload bytes stored, or loaded into the destination;
    `at`: when the tier posted it (`time.monotonic()`, on the thread that ended the operation).

    `dest_unsafe` (a failed load only): the load's destination may still be written after this
    completion, by a transfer the tier gave up on that may yet land (a Mooncake transfer timed out).
    The caller must never hand that memory to anyone again (another load, a payload being packed):
    bytes written into it later would change them. Never set where every transfer ended with its
    call (the file tier's reads are synchronous)."""

    ticket: Ticket
    op: Op
    key: ExtentKey
    status: Status
    nbytes: int = 0
    detail: str = ""
    at: float = field(default_factory=time.monotonic, compare=False)
    dest_unsafe: bool = False

    @property
    def ok(self) -> bool:
        return self.status is Status.OK


@dataclass(frozen=True)
class ExtentInfo:
    """What the index knows of one published extent (no payload read needed)."""

    key: ExtentKey
    parent: ExtentKey
    token_count: int
    payload_len: int
    file_bytes: int


DEFAULT_MAX_STEPS = 32


@dataclass(frozen=True, eq=False)
class LookupRequest:
    """Find extents continuing `tokens` (uint32 ids) after its first `start` tokens."""

    tokens: np.ndarray
    start: int
    tenant: bytes = b""
    epoch: bytes = b""
    max_steps: int = DEFAULT_MAX_STEPS
    tag: object = None  # the caller's, returned with the result
    cache_salt: str | None = None  # the tenant's salt (in `tenant` too): a backend that keeps each
    #                               salt's extents apart (mooncake) looks there only


@dataclass(frozen=True)
class Segment:
    """Tokens [start, end) of the prompt are tokens [0, end - start) of extent `key` (which holds
    `extent_tokens` in all, from prompt position `start`)."""

    key: ExtentKey
    extent_tokens: int
    start: int
    end: int


@dataclass(frozen=True)
class LookupResult:
    """`segments`: contiguous (each starts where the previous one's verified part reaches), the
    first at or before `request.start`; empty when nothing usable was found."""

    request: LookupRequest
    segments: tuple[Segment, ...] = ()
    fs_calls: int = 0
    refused: int = 0  # claims that failed verification (forged, foreign, inconsistent): never used
    stale: int = 0  # aliases whose extent is gone (evicted or deleted by its writer): clean misses
    elapsed_s: float = 0.0

    @property
    def end(self) -> int:
        return self.segments[-1].end if self.segments else self.request.start


@dataclass(frozen=True)
class TierStats:
    """Counters since open (`bytes_stored`/`extents` are current totals)."""

    extents: int
    bytes_stored: int
    capacity_bytes: int
    stores: int
    store_bytes: int
    store_failures: int
    loads: int
    load_bytes: int
    misses: int
    checksum_failures: int
    mismatches: int
    io_errors: int
    no_space: int
    evictions: int
    evicted_bytes: int
    direct_io: bool
    buffered_loads: int
    scanned_extents: int
    removed_temp_files: int
    removed_bad_files: int
    recreations: int  # the directory was found removed while serving and re-created
    secret_conflicts: int  # ... but another process had re-created it with a new secret (kept)
    purged_extents: int = 0  # removed by `submit_remove` / `submit_purge` (retention hints)
    retained_extents: int = 0  # kept from eviction by `retain` now (pinned conversations)
    # Evicted because a store would have left less than min_free_bytes free on the volume (not
    # counted in `evictions`/`evicted_bytes`, which the budget forced):
    free_space_evictions: int = 0
    free_space_evicted_bytes: int = 0
    volume_free_bytes: int = -1  # free on the volume when last looked at; -1: unknown, or not a volume
    newer_extents: int = (
        0  # extents of a newer format version met (scan, load, purge) and kept, never deleted
    )
    # Bytes this process wrote to the tier: each extent's payload as stored (padded, compressed) and
    # its header, as files or Mooncake objects; a store that found its extent there already writes none
    # (what wears an SSD; divided by the cache's `restored_bytes`: write amplification).
    written_bytes: int = 0
    purge_retries: int = 0  # purges run again because the store failed them (retried until done)
    # Warm start from a manifest (mooncake/warm_start.py): entries whose extent was gone, records
    # that did not verify (another secret, tampered: skipped), compactions and the records they removed.
    warm_start_gone: int = 0
    manifest_bad_records: int = 0
    manifest_compactions: int = 0
    manifest_records_removed: int = 0
