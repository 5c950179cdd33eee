"""FileTier: the extent store on a local or NVMe-oF directory (contract: `base.IndexedTier`).

Jobs run on `IoScheduler` threads; the lock guards only the index, tickets and completions, never
I/O. Opening checks the directory is ours and reads its secret (trust.py), which seals every header
(format.DirectoryMac). A store job checksums/compresses, reserves room (evicting LRU extents), writes a temp
file and renames it; one that finds the directory removed re-creates it and retries once
(recreate.py). A load job pins the key, opens and verifies the header (MACs, key), then queues one
job per chunk of the requested prefix; the last chunk job closes the file and posts the completion.
Each job runs under `Returned.guard`: one that raises still ends its operation (IO_ERROR, counted).

Read order: a load's jobs are ranked (batch, layer group) (`IoScheduler`; the batch: the load's own
ticket or the one it joined) and a lookup after the loads before it: a restore is read group-major.

Sharing a root with other processes (docs/DESIGN.md "Sharing a tier"): the byte budget is the
root's (ledger.py, shared.py); the index is never trusted as proof that a file exists: a store
checks the file before answering "present" (and writes it again if it is gone; a file there that
we do not index, another process's, is adopted: indexed from the request), and a load of a removed
file is a clean MISS (ENOENT, or ESTALE on NFS) that forgets the key. Those, and lookups that find
others' extents, are signs of another process for `shared` (besides the ledger's, shared.py);
one I/O thread looks for the ledger's at open and every `shared.REFRESH_S` (`SharedBudget.refresh`).

Shutdown: `close(timeout_s)` gives queued and running stores that long, then abandons them and
removes their temp files. A process killed before (SIGKILL) leaves the temp files of its running
stores (and its lease); the next open, or the next reservation on its host short of room, removes
them, accounted (their writer is dead: owner.py, ledger.py).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial

import numpy as np

from sgl_hicache.config import TierConfig
from sgl_hicache.tier.base import IndexedTier
from sgl_hicache.tier.codec import StoreRequest, plan_load, prepare, store_request
from sgl_hicache.tier.completions import Returned, ReturnedCompletions
from sgl_hicache.tier.directio import as_view, probe_direct_io
from sgl_hicache.tier.faults import Counters, FaultLog, logger
from sgl_hicache.tier.file.budget.index import Entry, OverBudget
from sgl_hicache.tier.file.budget.ledger import close_ledger
from sgl_hicache.tier.file.budget.process import ProcessBudget
from sgl_hicache.tier.file.budget.shared import REFRESH_S, open_shared_ledger
from sgl_hicache.tier.file.failures import failed
from sgl_hicache.tier.file.load import LoadState, OpenExtent, open_extent, read_chunk
from sgl_hicache.tier.file.paths import ExtentPaths
from sgl_hicache.tier.file.publish import Publisher
from sgl_hicache.tier.file.recreate import Recreator
from sgl_hicache.tier.file.retain import Removed, TierRetention
from sgl_hicache.tier.file.scan import scan
from sgl_hicache.tier.file.source import run_lookup
from sgl_hicache.tier.format import DirectoryMac, FormatError, Mismatch, NewerFormat
from sgl_hicache.tier.groups import section_of
from sgl_hicache.tier.keys import ROOT_KEY, ExtentKey, Namespace, check_key
from sgl_hicache.tier.path_lookup import LookupQueue
from sgl_hicache.tier.results import (
    Buffer,
    Completion,
    ExtentInfo,
    LookupRequest,
    LookupResult,
    Op,
    Status,
    Ticket,
    TierStats,
)
from sgl_hicache.tier.scheduler import IoScheduler


class FileTier(ReturnedCompletions, IndexedTier):
    def __init__(self, cfg: TierConfig, namespace: Namespace) -> None:
        self._cfg, self._ns, self._ns_id = cfg, namespace, namespace.id
        self._paths = ExtentPaths(cfg.directory, self._ns_id)
        secret = self._paths.create_root()
        self._seal = DirectoryMac(secret)
        self._direct = cfg.direct_io and probe_direct_io(self._paths.ns_dir)
        self._counters, self._faults = Counters(), FaultLog()
        self._ledger = open_shared_ledger(self._paths.root)
        self._budget = ProcessBudget(cfg, self._paths, self._counters, self._faults, self._ledger)
        self._publisher = Publisher(cfg, namespace, self._paths, self._budget, self._seal, self._direct)
        self._recreator = Recreator(self._paths, secret, self._budget, self._counters)
        self._lock, self._index = self._budget.lock, self._budget.index
        self._returned: Returned[LoadState] = Returned(self._lock, lambda load: load.landed, self._counters,
                                                       self._faults, str(self._paths.ns_dir))  # fmt: skip
        self._completions, self._loading = self._returned.queue, self._returned.loading  # loads in flight
        self._lookups = LookupQueue()
        self._storing: dict[ExtentKey, Ticket] = {}  # key -> ticket of the store writing it
        self._retention = TierRetention(self._budget, self._seal, self._storing, namespace)  # pin, purge
        self._closed = self._abandoned = False
        self._rebuild_index()
        self._io = IoScheduler(cfg.io_threads)
        self._io.every(REFRESH_S, self._refresh)  # stops at close

    @property
    def namespace(self) -> Namespace:
        return self._ns

    def _refresh(self) -> None:
        """About every second on an I/O thread: `shared` without a store, the volume's free space,
        and purges owed (cut short by an I/O error: `TierRetention.retry_purges`)."""
        self._budget.shared.refresh()
        self._budget.free_space.refresh()
        self._retention.retry_purges()

    @property
    def shared(self) -> bool:
        return self._budget.shared.others_seen

    def _fail(
        self, op: Op, ticket: Ticket, key: ExtentKey, err: Exception, seen: Entry | None = None
    ) -> Completion:
        return failed(self._budget, op, ticket, key, err, seen)

    # -- stores -------------------------------------------------------------------------------

    def submit_store(
        self, key: ExtentKey, payload: Buffer, tokens: Sequence[int] | np.ndarray, parent: ExtentKey,
        *, store_tokens: bool = True, aliases: Sequence[tuple[int, bytes]] = (), cache_salt: str | None = None,
        group_layers: int = 0,
    ) -> Ticket:  # fmt: skip
        req = store_request(self._ns, self._seal, key, payload, tokens, parent, store_tokens, aliases, cache_salt,
                            group_layers)  # fmt: skip
        ticket = self._completions.issue()
        job = self._returned.guard(ticket, Op.STORE, key, partial(self._store_job, ticket, req))
        with self._lock:  # queue under the lock: close() cannot slip in between
            self._retention.expire_locked()  # a store is what evicts: pins past their deadline go first
            closed, leader = self._closed, self._storing.get(key)
            if leader is not None:  # the same extent is being written: share its outcome
                self._completions.follow(leader, ticket)
            elif not closed:  # indexed or not: the job checks the file (another process may remove it)
                self._storing[key] = ticket
                self._retention.storing_locked(key, req.salt_tag)
                self._io.submit_write(job)
        if closed:
            self._completions.post(Completion(ticket, Op.STORE, key, Status.REJECTED, 0, "closed"))
        return ticket

    def _store_job(self, ticket: Ticket, req: StoreRequest) -> None:
        try:
            done = _abandoned_store(ticket, req.key) if self._abandoned else self._store(ticket, req)
        finally:  # raised or not (then its guard posts): a later store of the key must not follow it
            with self._lock:
                del self._storing[req.key]
                doomed = self._retention.stored_locked(req.key)
            if doomed:  # dropped or purged while written: the file goes, the write never happened
                if (cut := self._retention.unlink(doomed).error) is not None:
                    raise cut  # its guard ends the store IO_ERROR, logged
                done = Completion(ticket, Op.STORE, req.key, Status.REJECTED, 0, "purged while written")
        self._completions.post(done)

    def _store(self, ticket: Ticket, req: StoreRequest) -> Completion:
        if self._publisher.present(req):
            return Completion(ticket, Op.STORE, req.key, Status.OK, req.payload.nbytes, "present")
        try:
            prep = prepare(req, self._cfg)
            try:
                self._publisher.write(prep)
            except FileNotFoundError:  # the directory was removed while serving: re-create, retry once
                if self._abandoned:
                    raise
                self._recreator.recreate()
                self._publisher.write(prep)
        except OverBudget as e:
            self._counters.add("no_space")
            return Completion(ticket, Op.STORE, req.key, Status.NO_SPACE, 0, str(e))
        except Exception as e:  # I/O errors, and bugs: logged by _fail, never lost
            if self._abandoned:  # close() removed its temp file: not a failure
                return _abandoned_store(ticket, req.key)
            self._counters.add("store_failures")
            return self._fail(Op.STORE, ticket, req.key, e)
        self._counters.add("stores")
        self._counters.add("store_bytes", req.payload.nbytes)
        self._counters.add("written_bytes", prep.file_bytes)
        return Completion(ticket, Op.STORE, req.key, Status.OK, req.payload.nbytes)

    # -- loads --------------------------------------------------------------------------------

    def submit_load(self, key: ExtentKey, dest: Buffer, nbytes: int | None = None,
                    group_layers: int | None = None, batch: Ticket | None = None,
                    group_order: bool = True) -> Ticket:  # fmt: skip
        """A piece a job: reading in group order costs no calls (`group_order` unused)."""
        key, view = check_key(key), as_view(dest, writable=True)
        ticket = self._completions.issue()
        first = int(ticket) if batch is None else min(int(batch), int(ticket))
        opened = partial(self._open_job, ticket, key, view, nbytes, group_layers, first)
        job = self._returned.guard(ticket, Op.LOAD, key, opened)
        with self._lock:
            closed = self._closed
            if not closed:
                self._io.submit_read(job, (first, 0))
        if closed:
            self._completions.post(Completion(ticket, Op.LOAD, key, Status.REJECTED, 0, "closed"))
        return ticket

    def _open_job(self, ticket: Ticket, key: ExtentKey, dest: memoryview, nbytes: int | None,
                  group_layers: int | None, batch: int) -> None:  # fmt: skip
        with self._lock:
            self._index.pin(key)
            seen = self._index.get(key)
        try:
            ext = open_extent(self._paths.extent(key), self._ns_id, key, self._direct, self._seal)
        except Exception as e:  # I/O errors, and bugs: logged by _fail, never lost
            self._unpin(key)
            self._completions.post(self._fail(Op.LOAD, ticket, key, e, seen))
            return
        length = ext.header.payload_len
        want = length if nbytes is None else max(0, nbytes)
        try:
            if want > length:
                raise Mismatch(f"{length} B < {want} B requested")
            plan = plan_load(ext.header, want, group_layers)
            groups = section_of(ext.header.sections, [piece.raw_off for piece in plan.pieces])
            if dest.nbytes < want:
                raise ValueError(f"dest {dest.nbytes} B < {want} B")
            load = LoadState(ticket, key, ext, dest, want, seen, plan)
        except Exception as e:  # the request's (a plain ValueError: REJECTED), the extent's, or a bug
            self._close_load(ext, key)
            rejected = isinstance(e, ValueError) and not isinstance(e, FormatError)
            why = Completion(ticket, Op.LOAD, key, Status.REJECTED, 0, str(e))
            self._completions.post(why if rejected else self._fail(Op.LOAD, ticket, key, e, seen))
            return
        with self._lock:
            self._loading[ticket] = load
        if load.remaining == 0:
            self._end_load(load)
            return
        guard = partial(self._returned.guard, ticket, Op.LOAD, key)  # a piece job raises from its end only
        for i in range(1, load.remaining):  # ranked: the batch's group 0 first (see the module doc)
            self._io.submit_read(guard(partial(self._chunk_job, load, i)), (batch, groups[i]))
        self._chunk_job(load, 0)

    def _chunk_job(self, load: LoadState, index: int) -> None:
        error: Exception | None = None
        try:
            read_chunk(load.ext, load.pieces[index], load.dest)
        except Exception as e:  # I/O errors, and bugs: logged by _fail, never lost
            error = e
        if load.done((index,), error):
            self._end_load(load)

    def _end_load(self, load: LoadState) -> None:
        self._close_load(load.ext, load.key)
        if load.error is None:
            try:
                load.finish(load.ext.header, load.dest)
            except Exception as e:  # a bug: logged by _fail, never lost
                load.error = e
        if load.error is not None:
            self._completions.post(self._fail(Op.LOAD, load.ticket, load.key, load.error, load.seen))
            return
        with self._lock:
            ours = load.key in self._index
            self._index.touch(load.key)
        if not ours:  # published after our scan, by someone else
            self._budget.shared.saw_others()
        self._publisher.touch_file(load.key)
        self._counters.add("loads")
        self._counters.add("load_bytes", load.want)
        self._counters.add("buffered_loads", 0 if load.ext.direct else 1)
        self._completions.post(Completion(load.ticket, Op.LOAD, load.key, Status.OK, load.want))

    def _close_load(self, ext: OpenExtent, key: ExtentKey) -> None:
        try:
            os.close(ext.fd)
        finally:  # the descriptor is gone even if close failed: the pin goes too
            self._unpin(key)

    def _unpin(self, key: ExtentKey) -> None:
        with self._lock:
            self._index.unpin(key)

    # -- lookups (path_lookup.py) ------------------------------------------------------------------

    def submit_lookup(self, request: LookupRequest) -> None:
        with self._lock:
            closed = self._closed
            if not closed:  # after the loads submitted so far, before those to come
                rank = (self._completions.issued + 1, -1)
                self._io.submit_read(self._lookups.job(request, self._lookup), rank)
        if closed:
            self._lookups.post(LookupResult(request))

    def _lookup(self, request: LookupRequest) -> LookupResult:
        result = run_lookup(request, self._paths, self._ns_id, self._seal, self._ns.layout.page_size)
        with self._lock:
            others = any(seg.key not in self._index for seg in result.segments)
        if others or result.stale or result.refused:  # another writer's extents, or their traces
            self._budget.shared.saw_others()
        return result

    def lookups_finished(self) -> list[LookupResult]:
        return self._lookups.drain()

    # -- index queries and maintenance --------------------------------------------------------

    def contains(self, key: ExtentKey) -> bool:
        with self._lock:
            return key in self._index

    def touch(self, key: ExtentKey) -> None:
        with self._lock:
            self._index.touch(key)

    def take_evicted(self) -> list[ExtentKey]:
        with self._lock:
            keys = list(self._index.evicted)
            self._index.evicted.clear()
        return keys

    def lookup(self, key: ExtentKey) -> ExtentInfo | None:
        with self._lock:
            entry = self._index.get(key)
            return None if entry is None else entry.info(key)

    def extents(self) -> list[ExtentInfo]:
        with self._lock:
            return [entry.info(key) for key, entry in self._index.items()]

    def read_tokens(self, key: ExtentKey) -> np.ndarray | None:
        try:
            ext = open_extent(self._paths.extent(check_key(key)), self._ns_id, key, False, self._seal)
        except NewerFormat:  # a newer server's: kept
            self._counters.add("newer_extents")
            return None
        except FormatError:
            self._budget.drop(key)
            return None
        except OSError:
            return None
        os.close(ext.fd)
        return None if ext.tokens is None else np.frombuffer(ext.tokens, dtype="<u4").astype(np.uint32)

    def discard(self, key: ExtentKey) -> bool:
        with self._lock:
            if self._index.pinned(key):
                return False
            entry = self._index.remove(key)
        return self._budget.remove_file(key) or entry is not None

    # -- retention (retain.py) -------------------------------------------------------------

    def retain(self, keys: Sequence[ExtentKey], until: float) -> None:
        with self._lock:
            self._retention.retain_locked([check_key(k) for k in keys], until)

    def submit_remove(self, keys: Sequence[ExtentKey]) -> Ticket:
        keys = [check_key(k) for k in keys]
        with self._lock:  # marked now: a store of one of them queued later waits for its unlink
            marked = self._retention.mark_locked(keys)
        return self._submit_job(Op.REMOVE, lambda: self._retention.unlink(marked))

    def submit_purge(self, cache_salt: str) -> Ticket:
        tag = self._seal.salt(cache_salt)
        with self._lock:
            self._retention.doom_locked(tag)
        return self._submit_job(Op.PURGE, lambda: self._retention.purge(tag))

    def _submit_job(self, op: Op, job: Callable[[], Removed]) -> Ticket:
        """Queue `job` with the writes; its completion says how many files it removed, and whether
        it was cut short (I/O errors, and bugs: logged by _fail, never lost)."""
        ticket = self._completions.issue()

        def run() -> None:
            files, error = job()
            done = Completion(ticket, op, ROOT_KEY, Status.OK, files)
            if error is not None:
                done = replace(self._fail(op, ticket, ROOT_KEY, error), nbytes=files)
            self._completions.post(done)

        with self._lock:
            closed = self._closed
            if not closed:
                self._io.submit_write(self._returned.guard(ticket, op, ROOT_KEY, run))
        if closed:
            self._completions.post(Completion(ticket, op, ROOT_KEY, Status.REJECTED, 0, "closed"))
        return ticket

    def stats(self) -> TierStats:
        c = self._counters.snapshot()
        with self._lock:
            extents, used = len(self._index), self._index.used_bytes
            retained = self._retention.retained
        names = [f for f in TierStats.__dataclass_fields__ if f not in _DERIVED]
        return TierStats(
            extents=extents, bytes_stored=used, capacity_bytes=self._budget.capacity_bytes,
            direct_io=self._direct, retained_extents=retained, volume_free_bytes=self._budget.free_space.last,
            **{name: c.get(name, 0) for name in names},
        )  # fmt: skip

    def check_integrity(self) -> None:
        self._budget.check_integrity()

    def close(self, timeout_s: float | None = None) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        closer = threading.Thread(target=self._io.close, name="sgl-hicache-close", daemon=True)
        closer.start()
        closer.join(timeout_s)
        if closer.is_alive():
            self._abandon(timeout_s)
        if self._ledger is not None:
            close_ledger(self._ledger)

    def _abandon(self, timeout_s: float | None) -> None:
        """Stores not started yet complete REJECTED when their job comes; the temp files of those
        being written are removed now (their publish then fails, also REJECTED)."""
        with self._lock:
            self._abandoned = True
            unfinished = list(self._storing)
        removed = 0
        for path in self._paths.own_temps(unfinished):
            with contextlib.suppress(OSError):
                path.unlink()
                removed += 1
        logger.warning(
            "spill tier closed with %d stores unfinished after %s s: abandoned, %d temp files removed",
            len(unfinished), timeout_s, removed,
        )  # fmt: skip

    def _rebuild_index(self) -> None:
        result = scan(self._paths, self._ns_id, self._seal)
        for _, key, entry in result.entries:
            self._index.add(key, entry)
        self._budget.enforce_budget()
        self._budget.shared.open()
        self._counters.add("scanned_extents", len(result.entries))
        self._counters.add("removed_temp_files", result.removed_temp)
        self._counters.add("removed_bad_files", result.removed_bad)
        self._counters.add("newer_extents", result.newer)


def _abandoned_store(ticket: Ticket, key: ExtentKey) -> Completion:
    return Completion(ticket, Op.STORE, key, Status.REJECTED, 0, "abandoned at close")


_DERIVED = {"extents", "bytes_stored", "capacity_bytes", "direct_io", "retained_extents", "volume_free_bytes"}
