"""The spill tier's contract: an asynchronous, checksummed, capacity-bounded extent store.

Everything a caller (the cache) may rely on is written here, once; implementations (`file/backend.py`,
`mooncake/backend.py`, `testing/injector.py`) add no promises of their own. Two levels:

- `Tier`: what the cache uses (sgl_hicache/cache/): submit store, submit load, poll completions
  (`get_finished`, `wait`), cross-server lookups (`submit_lookup`, `lookups_finished`), the index
  (`contains`), `shared`, `stats`, `close`; and four capabilities with a safe default that a
  backend may lack: `landed` (early verified prefix: none), `extents` and `read_tokens` (a warm
  start: nothing to attach), `check_integrity` (nothing to check), plus `host_memory` (memory
  to make staging of: anonymous pages) and `register_host_memory` (memory a backend may map once
  for zero-copy transfers: ignored); the retention hints' calls
  (`take_evicted`, `retain`: nothing; `submit_remove`, `submit_purge`: refused) likewise.
- `IndexedTier`: adds what tools and tests use on a tier's own index: `lookup` and `discard`.

The values the contract takes and gives back (`Completion`, `Status`, `LookupRequest`, `TierStats`,
...) are plain data in `results.py`.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import numpy as np

from sgl_hicache.tier.directio import alloc_aligned
from sgl_hicache.tier.keys import ExtentKey, Namespace
from sgl_hicache.tier.results import (
    Buffer,
    Completion,
    ExtentInfo,
    LookupRequest,
    LookupResult,
    Ticket,
    TierStats,
)


class Tier(abc.ABC):
    """An extent store bound to one `Namespace`: what the cache needs of one.

    Threading: every method is thread-safe. `submit_store`, `submit_load`, `get_finished`,
    `submit_lookup`, `lookups_finished`, `contains`, `lookup`, `extents`, `stats` and `shared`
    never block on I/O (they take a short internal lock at most), so the scheduler thread may call
    them; `wait`, `wait_posted`, `read_tokens`, `check_integrity`, `discard` and `close` may block. I/O failures
    are never raised: they come back as a `Completion` status and are counted in `stats()`. Methods
    raise only for caller bugs (`ValueError`: wrong key length, non-contiguous buffer; `KeyError`:
    unknown ticket).

    Buffers: the tier keeps a reference to a store's payload and a load's destination until that
    ticket's completion has been returned; the caller must neither modify (store) nor read or reuse
    (load) the buffer before then, except the verified prefix of a load that `landed` reports. For
    direct I/O it should come from `alloc_aligned` (an unaligned one works, through a bounce copy).

    Payloads are page-major (page p of all layers before page p+1), or layer-grouped (format v6:
    one page-major section per group of layers), so the first n pages are a byte prefix of every
    section: `submit_load(..., nbytes=n * page_bytes)` reads and verifies only what covers it, and
    `landed` reports a grouped load's verified bytes group by group.

    Where a promise below names files, a directory or its budget, that is the file tier's
    (`file/backend.py`); another backend keeps the same promise on its own objects and says how in its
    module doc (`mooncake/backend.py`: objects in a Mooncake Store, whose master owns capacity and eviction).
    """

    batches_loads = False  # a batch of loads costs fewer calls (Mooncake): reads.py batches each restore

    @property
    @abc.abstractmethod
    def namespace(self) -> Namespace:
        """The namespace every key of this tier lives in."""

    @property
    @abc.abstractmethod
    def shared(self) -> bool:
        """Whether another process may be using this tier's root (so its lookups may find other
        writers' extents, and any extent may be evicted by someone else: `contains` and `lookup`
        then prove nothing). False until this tier has seen a sign of one: another process with a
        tier open on the root (its mark), or its lease or write in the root's ledger; a second tier
        of this process on the root; a file under the root that this tier does not index (another
        namespace's included), another writer's temp file, a file of its index removed by someone
        else, a key stored or loaded that another process published, or a lookup that found another
        writer's extent (or a stale or refused claim); then True for good. Extents of this namespace
        found at open are indexed and count as this tier's (no file records its writer). The tier
        looks on its I/O threads at open and about every second, store or no store, so another
        process is seen within about that of either's open or of its ledger write. Without working
        locks (a per-process budget) the root is listed at open and, until something foreign is
        found, at most every 30 s: True once anything foreign was seen. Never blocks."""

    @abc.abstractmethod
    def submit_store(
        self, key: ExtentKey, payload: Buffer, tokens: Sequence[int] | np.ndarray, parent: ExtentKey,
        *, store_tokens: bool = True, aliases: Sequence[tuple[int, bytes]] = (), cache_salt: str | None = None,
        group_layers: int = 0,
    ) -> Ticket:  # fmt: skip
        """Queue writing `payload` as extent `key`, which must be `chain_key(ns, parent, tokens)`
        (ValueError otherwise: the key names exactly what the extent holds, see keys.py).

        `group_layers` > 0: `payload` is layer-grouped (docs/FORMAT.md, v6: one page-major section
        per group of that many of the namespace's layers), whole pages of equal layers (ValueError
        otherwise); each section is cut into its own chunks, so a load verifies group 0 before
        group 1. 0: page-major, any length.

        `cache_salt`: the tenant salt of the request that computed it, recorded as a keyed tag (never
        the salt itself), so that `submit_purge` of that salt finds the extent.

        `aliases`: (offset, path key) pairs, offsets increasing in 1..len(tokens): the path key of
        the sequence up to that offset of the extent (`lookup.block_tokens` positions and the end).
        They are recorded in the MAC'd header and published as alias entries after the extent, so
        other processes find it by `submit_lookup` (a failed alias write only makes it unfindable).

        The file records the token count and `token_digest(tokens)` always, and the token ids
        themselves only if `store_tokens` (pass False for any tenant whose prompts must not be on
        disk in clear: `read_tokens` then returns None for this extent; loads verify it all the same).

        Never blocks. Publishing is atomic (temp file + rename, fsync per `TierConfig.fsync`): a
        failed or partial write is never visible (nor counted against the budget), except a file
        the tier could not remove after the failure (then it stays counted; if it was published, it
        stays indexed). Storing a key whose file is present at its path completes OK ("present")
        without rewriting, whoever wrote it: the file's mtime is refreshed (the LRU of other
        processes sharing the directory sees the use) and, if this tier did not index it (another
        process, or an earlier one, published it), it is indexed from this request (parent, token
        count, payload length) and the file's size; a key this tier indexes whose file another
        process removed is written again. To make room the tier evicts
        least-recently-used extents that no load of this process is reading, its own or other
        processes'; the extent files of all processes sharing the directory never exceed
        `capacity_bytes` (docs/DESIGN.md "Sharing a tier"), nor eat into `min_free_bytes`. A tier
        directory removed while serving is re-created (same trust checks as at open, same secret,
        same volume) and the store goes on; extents that went with it are forgotten (counted in
        `stats().recreations`)."""

    @abc.abstractmethod
    def submit_load(self, key: ExtentKey, dest: Buffer, nbytes: int | None = None, group_layers: int | None = None,
                    batch: Ticket | None = None, group_order: bool = True) -> Ticket:  # fmt: skip
        """Queue reading the first `nbytes` payload bytes (all if None) of `key` into `dest`.

        `batch`: the ticket of an earlier load this one is read with (the first load the same
        restore or prefetch submitted): the loads of one batch are read layer group by layer group,
        every load's group g before any load's group g + 1, so that the first group of all of them
        lands first (a layer-wise restore starts then); a batch ranks where its first load was
        submitted. Loads of other batches, or of none, are read in the order they were submitted.
        `group_order` False: nobody waits for its group 0 first (a restore not layer-wise), so a
        tier may read its groups at once, in fewer calls (Mooncake). Orders only, never outcomes.

        Never blocks. Only chunks covering the prefix are read and verified; an OK completion has
        exactly `nbytes` (or the payload length, if None). `dest` must hold that many bytes, else
        REJECTED. A page-major payload's prefix is a byte prefix; a layer-grouped one's (v6) is the
        first m pages of every group's section (`nbytes` m whole pages, else REJECTED), delivered
        back to back (the layout of m tokens), group 0 first. `group_layers`: deliver the bytes in
        that grouping (0: page-major) whatever the file's, rearranged once every chunk is verified
        (such a load lands nothing early); None: the file's own. REJECTED where the payload is not
        whole pages of equal layers. A file not sealed with this directory's secret (header or meta MAC wrong: not
        written by a holder of the secret), and any checksum, truncation, version or namespace
        mismatch, drops the extent and reports CORRUPT; a file whose recorded parent, token count
        and token digest do not hash to `key`, or whose payload is shorter than `nbytes`, is
        dropped and reported MISMATCH. Both checks precede the first payload byte read. The content of `dest`
        is then undefined, and where the completion says `dest_unsafe` it may still change after
        the completion: that memory must never be reused (results.py). An extent evicted meanwhile (here or by another
        process sharing the directory), or whose store has not completed yet, is a clean MISS. Loads are served before stores, but a
        waiting store is never passed over indefinitely. A load refreshes the extent's LRU age.
        """

    def landed(self, ticket: Ticket) -> int:
        """How many leading bytes of a load's destination are read and verified so far. Never blocks.

        While a load runs (its completion not yet returned), `dest[:n]` holds verified payload that
        the tier will not write again, so the caller may read it early (e.g. unpack it while later
        chunks are still being read). The load may still fail afterwards (a later chunk corrupt, an
        I/O error): only an OK completion makes the whole range good. n grows while the load runs
        and holds until the completion is returned; it is 0 for stores, unknown tickets, loads not
        started yet, and once the completion has been returned. Default: 0 (no early prefix; the
        caller then waits for the completion)."""
        return 0

    @abc.abstractmethod
    def get_finished(self) -> list[Completion]:
        """Completions not yet returned (by this or `wait`), oldest first. Never blocks."""

    @abc.abstractmethod
    def wait(self, ticket: Ticket, timeout: float | None = None) -> Completion:
        """Block until `ticket` completes and return (consume) its completion. Raises KeyError for
        a ticket never issued or already returned, TimeoutError on timeout."""

    @abc.abstractmethod
    def wait_posted(self, timeout: float) -> bool:
        """Block until a completion waits to be returned (True) or `timeout` passed; consumes none."""

    @abc.abstractmethod
    def submit_lookup(self, request: LookupRequest) -> None:
        """Queue a lookup of extents that continue `request.tokens` after its first `start` tokens,
        by their writers' recorded path keys (aliases; any process sharing the directory may have
        written them): path_lookup.py says how, and that every claim is verified like a load (MACs, key)
        and against the caller's own tokens before it is returned. Never blocks; the file system
        calls run on the I/O threads. Every request gets exactly one `LookupResult` from
        `lookups_finished` (empty if nothing usable was found, the tier is closed, or it failed).
        The result names ranges only: the extents may be evicted before they are read (a clean MISS)."""

    @abc.abstractmethod
    def lookups_finished(self) -> list[LookupResult]:
        """Results of finished lookups not returned yet, oldest first. Never blocks."""

    @abc.abstractmethod
    def contains(self, key: ExtentKey) -> bool:
        """Whether the index holds `key` (a later load may still MISS if another process evicts it)."""

    def touch(self, key: ExtentKey) -> None:
        """`key` was just used without a load (an eviction pointed at it instead of writing it again):
        it becomes the most recently used in this process's LRU. Never blocks on I/O. Default: nothing
        (a backend whose evictions are not its own, as a Mooncake master's)."""
        return None

    def take_evicted(self) -> list[ExtentKey]:
        """The keys this process's tier evicted from its index since the last call (to make room),
        oldest first; at most the last 65536 are kept between calls. Never blocks. The cache takes
        them on the scheduler thread, so that the spilled nodes they held leave its tree and the
        router hears of it (cache/events.py). Default: none (a backend whose evictions are not its
        own to report)."""
        return []

    def extents(self) -> list[ExtentInfo]:
        """All indexed extents, least recently used first (used to rebuild the cache after restart).
        Default: none (a backend that cannot list its extents; a restarted server then finds them
        by `submit_lookup`)."""
        return []

    def read_tokens(self, key: ExtentKey) -> np.ndarray | None:
        """Token ids stored in the header of `key` (uint32), verified like a load's header (MACs,
        key, and the ids against the digest; a bad file is dropped). None if missing, bad, or
        stored with `store_tokens=False`. Blocks. Default: None."""
        return None

    # -- retention (pin, drop, purge hints); a tier without them refuses, never pretends --------

    def retain(self, keys: Sequence[ExtentKey], until: float) -> None:
        """Keep `keys` from this process's eviction until `time.monotonic()` reaches `until`
        (replacing an earlier `until` of the same key); a key not published yet is kept once it
        is. Other processes sharing the root do not see it. Never blocks. Default: keeps nothing."""
        return None

    def submit_remove(self, keys: Sequence[ExtentKey]) -> Ticket:
        """Queue removing the files of `keys` (retained, or being read, or not), with their aliases;
        completes `Op.REMOVE` OK, `nbytes` the files removed. Never blocks. Raises
        NotImplementedError where the tier cannot."""
        raise NotImplementedError(f"{type(self).__name__} cannot remove extents")

    def submit_purge(self, cache_salt: str) -> Ticket:
        """Queue removing every extent stored with `cache_salt`, and every one that may have been
        (older formats without a salt tag that hold no token ids), and the aliases of each, from this
        tier's namespace and, if it is TP rank 0's, from every namespace under the root that is no
        rank's of its server (other models, older weights); the other ranks purge their own (so
        the ranks of a server purging together purge the whole root). Stores of that salt in flight
        now have their file removed once written (and complete REJECTED). Files of a newer format
        version are kept. Completes `Op.PURGE` OK, `nbytes` the files removed.
        Idempotent: a purge again after one cut short (an error or a crash mid-walk) removes the
        rest. Never blocks. Raises NotImplementedError where the tier cannot."""
        raise NotImplementedError(f"{type(self).__name__} cannot purge a cache_salt")

    @abc.abstractmethod
    def stats(self) -> TierStats:
        """A snapshot of the counters. Never blocks."""

    def check_integrity(self) -> None:
        """Verify index vs files vs byte accounting; raise AssertionError with the numbers.

        Call when idle (no operation in flight); blocks for a directory walk. In a directory
        shared with another live process, extents it published since our scan (and its temp
        files) are reported as unindexed: check a shared directory from one process at a time.
        Default: nothing to check."""
        return None

    def host_memory(self, nbytes: int) -> memoryview:
        """`nbytes` of page-aligned memory to make the caller's staging arena of (then given to
        `register_host_memory`): what this backend moves bytes into and out of best (a Mooncake
        tier joined through a real client moves bytes only through memory that process maps).
        Raises MemoryError when none can be had. Default: anonymous memory (`alloc_aligned`)."""
        return alloc_aligned(nbytes)

    def register_host_memory(self, buf: memoryview) -> None:
        """`buf` (the caller's staging arena) will hold payloads and destinations for the tier's
        life: a backend that moves bytes by RDMA registers it once here, so transfers go straight
        from and into it. Call once, before the first submit; the caller keeps `buf` alive until
        `close` returned. Default: nothing (files are read and written by the kernel)."""
        return None

    @abc.abstractmethod
    def close(self, timeout_s: float | None = None) -> None:
        """Finish in-flight operations, stop the I/O threads. Later submits complete REJECTED.
        Idempotent (a second call returns at once).

        With `timeout_s`, blocks at most that long: then stores not started yet complete REJECTED
        ("abandoned at close") without writing, the temp files of stores being written are removed
        (they complete REJECTED too), and close returns while the I/O threads (daemons) end the
        jobs they are in. A write stuck in the kernel past that point may leave its temp file if the
        process dies meanwhile: the next open, or the next store on its host short of room, removes
        it (its writer is dead, file/owner.py)."""

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class IndexedTier(Tier):
    """A `Tier` whose own index tools and tests may query and edit (every tier we open is one)."""

    @abc.abstractmethod
    def lookup(self, key: ExtentKey) -> ExtentInfo | None:
        """Index entry for `key`, or None."""

    @abc.abstractmethod
    def discard(self, key: ExtentKey) -> bool:
        """Remove `key` (unless a load is reading it: then False). Blocks for the unlink."""
