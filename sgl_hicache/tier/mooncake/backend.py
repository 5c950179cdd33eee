"""MooncakeTier: the extent store on a Mooncake Store (contract: `base.IndexedTier`).

One master owns placement, replication, capacity and eviction; every server is a client giving a
DRAM segment (and, where it mounts NVMe-oF namespaces, Mooncake's SSD tier). An extent is a header
object and one object per chunk, in the file format, in the directory of its salt (objects.py; names
and codes: client.py), and every load verifies it as a file load does. The contract's file promises:

- Trust: headers are sealed with `TierConfig.directory`'s `.secret` (trust.py): servers sharing
  extents share that file. Another deployment's, namespace's or key's object is CORRUPT or
  MISMATCH, and dropped. Writers inside the cluster are inside the trust boundary.
- Capacity is the master's: no budget here (`capacity_bytes` unused, `evictions` 0). What it
  evicts, what another client removed, and everything after a master restart is a clean MISS.
  Chunk names are unique per publish (client.py), so a load never meets another publish's chunk:
  a chunk that fails its checksum under a header still the one the load verified is corrupt (the
  header is dropped); under a header replaced since, a miss (failures.py; nothing removed).
- Index: the keys this process found at open, stored, loaded or looked up (recent.py, with each
  key's salt tag, which names its objects); it proves nothing (`shared` is always True), so the cache
  stores again on eviction, and a store that finds a header of its key that verifies and every
  chunk it names writes nothing (else it writes every object anew).
- Warm start: the namespace's manifest (manifest.py) names the extents its writers stored; at open
  each is verified like a load's header, its chunks checked present, and indexed (`extents`,
  `read_tokens`, `scanned_extents`); what it could not use is counted, a header that does not
  verify removed, and the manifest compacted (warm_start.py). Every store this tier writes is
  recorded there within about `MANIFEST_FLUSH_S` (and at close).
- Loads (load.py): the loads of one batch (`submit_load`'s `batch`) are read together, layer group
  by layer group, ranked on the I/O threads (batch, group) as the file tier ranks its reads: their
  headers in one batch read, then each group's chunks across them, every group 0 before any group
  1 (loads without `group_order`: all groups in one call, unless `load_calls` is by_group); each
  object is checked on its own (one extent's missing or bad object fails its load alone) and each
  chunk verified before `landed` counts it. `batches_loads` is True: the cache submits a
  restore's reads as one batch whether or not it restores layer-wise.
- Lookups: path_lookup.py's walk over alias objects in the request's salt directory (the newest
  writer's wins), read after the loads submitted before it and before those submitted after; a
  dangling alias is left to the master's eviction. Failures: an unreachable master or peer is an
  I/O error of that operation (counted, logged at most once a minute); the client reconnects by
  itself.
- Retention: `submit_remove` of named keys removes their objects; `submit_purge` removes every
  object of the salt, in every namespace, with one `remove_by_regex` (its completion's `nbytes`
  and `purged_extents` count objects: headers, chunks, aliases); stores of the salt in flight are
  removed once written (REJECTED). A purge the store failed completes IO_ERROR and is retried about
  every `MANIFEST_FLUSH_S` until it succeeds (`purge_retries`). `retain` keeps nothing (the master
  alone decides what it evicts).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

from sgl_hicache.config import TierConfig
from sgl_hicache.tier.base import IndexedTier
from sgl_hicache.tier.codec import StoreRequest, prepare, store_request
from sgl_hicache.tier.completions import Returned, ReturnedCompletions
from sgl_hicache.tier.directio import as_view
from sgl_hicache.tier.faults import Counters, FaultLog, logger
from sgl_hicache.tier.format import DirectoryMac, FormatError, NewerFormat
from sgl_hicache.tier.keys import ROOT_KEY, ExtentKey, Namespace, check_key
from sgl_hicache.tier.mooncake import objects
from sgl_hicache.tier.mooncake.client import Names, connect
from sgl_hicache.tier.mooncake.failures import COUNTER_OF, Failures
from sgl_hicache.tier.mooncake.load import Ends, Loads, Reader
from sgl_hicache.tier.mooncake.manifest import Manifest
from sgl_hicache.tier.mooncake.purge import Purges
from sgl_hicache.tier.mooncake.recent import RecentExtents
from sgl_hicache.tier.mooncake.scratch import Scratch
from sgl_hicache.tier.mooncake.source import StoreSource
from sgl_hicache.tier.mooncake.warm_start import warm_start
from sgl_hicache.tier.path_lookup import LookupQueue, run_lookup_in
from sgl_hicache.tier.progress import LoadProgress
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
from sgl_hicache.tier.trust import open_trusted

MANIFEST_FLUSH_S = 1.0
"""How often an I/O thread writes the manifest's waiting entries (and retries owed purges)."""
_NOT_COUNTED = ("extents", "bytes_stored", "direct_io", "volume_free_bytes")


class MooncakeTier(ReturnedCompletions, IndexedTier):
    def __init__(self, cfg: TierConfig, namespace: Namespace) -> None:
        self._cfg, self._ns = cfg, namespace
        self._seal = DirectoryMac(open_trusted(cfg.directory, namespace.id.hex()))
        self._client = connect(cfg.mooncake)
        self._names = Names(namespace.id)
        self._scratch = Scratch(self._client.register, self._client.unregister, self._client.host_memory)
        self._registered: list[memoryview] = []  # staging (`register_host_memory`)
        self._counters, self._faults = Counters(), FaultLog()
        joined = (
            f"real client {cfg.mooncake.real_client}" if cfg.mooncake.real_client else cfg.mooncake.master
        )
        self._where = f"the Mooncake Store ({joined})"
        self._lock = threading.Lock()
        self._index = RecentExtents()  # what this process found at open, stored, loaded or looked up lately
        self._storing: dict[ExtentKey, tuple[Ticket, bytes | None]] = {}  # key -> its store's ticket, salt
        self._returned: Returned[LoadProgress] = Returned(
            self._lock, lambda load: load.landed, self._counters, self._faults, self._where
        )
        self._completions, self._lookups = self._returned.queue, LookupQueue()
        self._closed = self._abandoned = False
        self._manifest = Manifest(self._client, self._names, self._seal)
        self._purges = Purges(self._client, self._counters, self._faults, self._where)
        self._failures = Failures(self._client, self._names, self._lock, self._index, self._counters,
                                  self._faults, self._where)  # fmt: skip
        self._warm_start()
        self._io = IoScheduler(cfg.io_threads, name="sgl-hicache-mooncake")
        self._io.every(MANIFEST_FLUSH_S, self._tick)
        reader = Reader(self._client, self._names, namespace.id, self._seal, self._scratch)
        ends = Ends(self._salt, lambda t, k, why: self._post(t, Op.LOAD, k, Status.REJECTED, 0, why),
                    self._load_failed, self._loaded)  # fmt: skip
        self._loads = Loads(
            reader, self._io, self._lock, self._returned, ends, cfg.mooncake.load_calls == "merged"
        )
        logger.info("sgl_hicache: spill tier on %s", self._where)

    def _warm_start(self) -> None:
        """Index every extent the manifest names that verifies and is whole (warm_start.py)."""
        found = warm_start(self._client, self._names, self._ns.id, self._seal, self._manifest, self._counters,
                           lambda op, e: self._faults.report(op, e, self._where))  # fmt: skip
        with self._lock:
            for ext in found:
                self._index.remember(_info(ext), ext.salt)

    def _tick(self) -> None:
        """Now and then on an I/O thread: the manifest's waiting entries, and owed purges."""
        self._flush_manifest()
        self._purges.retry()

    def _flush_manifest(self) -> None:
        try:
            self._manifest.flush()
        except OSError as e:
            self._faults.report(Op.STORE, e, self._where)

    @property
    def namespace(self) -> Namespace:
        return self._ns

    batches_loads = True  # a batch's loads share their store calls (load.py)

    @property
    def shared(self) -> bool:
        return True

    def _post(
        self, ticket: Ticket, op: Op, key: ExtentKey, status: Status, nbytes: int = 0, detail: str = ""
    ) -> None:
        if status in COUNTER_OF:
            self._counters.add(COUNTER_OF[status])
        if op is Op.STORE and status in COUNTER_OF:
            self._counters.add("store_failures")
        self._completions.post(Completion(ticket, op, key, status, nbytes, detail))

    def submit_store(
        self, key: ExtentKey, payload: Buffer, tokens: Sequence[int] | np.ndarray, parent: ExtentKey,
        *, store_tokens: bool = True, aliases: Sequence[tuple[int, bytes]] = (), cache_salt: str | None = None,
        group_layers: int = 0,
    ) -> Ticket:  # fmt: skip
        req = store_request(self._ns, self._seal, key, payload, tokens, parent, store_tokens, aliases, cache_salt,
                            group_layers)  # fmt: skip
        ticket = self._completions.issue()
        with self._lock:
            closed, leader = self._closed, self._storing.get(key)
            if leader is not None:
                self._completions.follow(leader[0], ticket)
            elif not closed:
                self._storing[key] = (ticket, req.salt_tag)
        if closed and leader is None:
            self._post(ticket, Op.STORE, key, Status.REJECTED, 0, "tier closed")
        elif leader is None:
            self._submit_write(ticket, Op.STORE, key, partial(self._store_job, ticket, req))
        return ticket

    def _submit_write(self, ticket: Ticket, op: Op, key: ExtentKey, job: Callable[[], None]) -> None:
        """Queue `job`, which ends operation `ticket`, as a write that ends it even if it raises."""
        self._io.submit_write(self._returned.guard(ticket, op, key, job))

    def _store_job(self, ticket: Ticket, req: StoreRequest) -> None:
        status, detail = Status.REJECTED, "abandoned at close"
        try:
            if not self._abandoned:
                self._write(req)
                status, detail = Status.OK, ""
        except Exception as e:
            status, detail = self._failures.classify(Op.STORE, req.key, req.salt_tag, e), str(e)
        finally:  # before any post (the guard's if this raised): a later store of it follows no ended one
            with self._lock:
                self._storing.pop(req.key, None)
                doomed = self._purges.doomed(req.key)
        if doomed and status is Status.OK:  # its salt was purged while it was written
            self._remove(req.key, req.salt_tag)
            status, detail = Status.REJECTED, "purged while being stored"
        self._post(
            ticket, Op.STORE, req.key, status, req.payload.nbytes if status is Status.OK else 0, detail
        )

    def _write(self, req: StoreRequest) -> None:
        salt = req.salt_tag
        if not objects.present(
            self._client, self._names, self._ns.id, req.key, salt, self._seal, self._scratch
        ):
            written = objects.write_objects(
                self._client, self._names, prepare(req, self._cfg), self._cfg, self._ns, self._seal
            )
            self._counters.add("written_bytes", written)
            objects.publish_aliases(self._client, self._names, req)
            if self._manifest.add(req.key, salt):
                self._flush_manifest()
        info = ExtentInfo(req.key, req.parent, req.token_count, req.payload.nbytes, req.payload.nbytes)
        with self._lock:
            self._index.remember(info, salt)
        self._counters.add("stores")
        self._counters.add("store_bytes", req.payload.nbytes)

    def submit_load(self, key: ExtentKey, dest: Buffer, nbytes: int | None = None, group_layers: int | None = None,
                    batch: Ticket | None = None, group_order: bool = True) -> Ticket:  # fmt: skip
        view, key = as_view(dest, writable=True), check_key(key)
        ticket = self._completions.issue()
        first = int(ticket) if batch is None else min(int(batch), int(ticket))
        fits = nbytes is None or 0 <= nbytes <= view.nbytes
        with self._lock:  # queued under the lock: close() cannot slip in between
            closed = self._closed
            if fits and not closed:
                self._loads.submit(ticket, key, view, nbytes, group_layers, first, group_order)  # load.py
        if closed or not fits:
            why = "tier closed" if closed else f"destination of {view.nbytes} B cannot hold {nbytes} B"
            self._post(ticket, Op.LOAD, key, Status.REJECTED, 0, why)
        return ticket

    def _loaded(self, ticket: Ticket, ext: objects.Opened, nbytes: int) -> None:
        with self._lock:
            self._index.remember(_info(ext), ext.salt)
        self._counters.add("loads")
        self._counters.add("load_bytes", nbytes)
        self._post(ticket, Op.LOAD, ext.header.key, Status.OK, nbytes)

    def _load_failed(self, ticket: Ticket, key: ExtentKey, salt: bytes | None, err: Exception,
                     seen: objects.Opened | None) -> None:  # fmt: skip
        self._post(ticket, Op.LOAD, key, self._failures.classify(Op.LOAD, key, salt, err, seen), 0, str(err))

    def _salt(self, key: ExtentKey) -> bytes | None:
        with self._lock:
            return self._index.salt(key)

    def _open(self) -> bool:
        with self._lock:
            return not self._closed

    def submit_remove(self, keys: Sequence[ExtentKey]) -> Ticket:
        keys, ticket = [check_key(k) for k in keys], self._completions.issue()
        if self._open():
            self._submit_write(ticket, Op.REMOVE, ROOT_KEY, partial(self._remove_job, ticket, keys))
        else:
            self._post(ticket, Op.REMOVE, ROOT_KEY, Status.REJECTED, 0, "tier closed")
        return ticket

    def _remove_job(self, ticket: Ticket, keys: list[ExtentKey]) -> None:
        """`nbytes`: the extents whose header was there and went (aliases: the master's eviction).
        A key whose removal raised (the binding) stops none of the others: then IO_ERROR, still
        counting what went."""
        removed, failed = 0, None
        for key in keys:
            try:
                removed += self.discard(key)
            except Exception as e:  # logged below with its traceback, counted by the post
                failed = failed or e
        self._counters.add("purged_extents", removed)
        if failed is None:
            self._post(ticket, Op.REMOVE, ROOT_KEY, Status.OK, removed)
            return
        self._faults.unexpected(Op.REMOVE, failed, self._where)
        why = f"unexpected {type(failed).__name__}: {failed}"
        self._post(ticket, Op.REMOVE, ROOT_KEY, Status.IO_ERROR, removed, why)

    def submit_purge(self, cache_salt: str) -> Ticket:
        salt, ticket = self._seal.salt(cache_salt), self._completions.issue()
        with self._lock:
            closed = self._closed
            self._purges.doom({k for k, (_, s) in self._storing.items() if s == salt})
            gone = self._index.of_salt(salt)
            for key in gone:
                self._index.forget(key)
        self._manifest.forget(gone)
        if closed:
            self._post(ticket, Op.PURGE, ROOT_KEY, Status.REJECTED, 0, "tier closed")
        else:
            self._submit_write(ticket, Op.PURGE, ROOT_KEY, partial(self._post_purge, ticket, salt))
        return ticket

    def _post_purge(self, ticket: Ticket, salt: bytes) -> None:
        removed = self._purges.run(salt)
        if removed is None:
            self._post(ticket, Op.PURGE, ROOT_KEY, Status.IO_ERROR, 0, "the store did not purge; retried")
        else:
            self._post(ticket, Op.PURGE, ROOT_KEY, Status.OK, removed)

    def submit_lookup(self, request: LookupRequest) -> None:
        salt = None if request.cache_salt is None else self._seal.salt(request.cache_salt)
        source = StoreSource(
            self._client, self._names, self._ns.id, self._seal, self._scratch, salt, self._seen
        )
        job = self._lookups.job(
            request, lambda r: run_lookup_in(r, source, self._ns.id, self._ns.layout.page_size)
        )
        with self._lock:
            closed = self._closed
            if not closed:  # after the loads submitted so far, before those to come
                self._io.submit_read(job, (self._completions.issued + 1, -1))
        if closed:
            self._lookups.post(LookupResult(request))

    def _seen(self, ext: objects.Opened) -> None:
        """A lookup verified `ext`'s header: index it, so that a load finds its objects."""
        with self._lock:
            self._index.remember(_info(ext), ext.salt)

    def lookups_finished(self) -> list[LookupResult]:
        return self._lookups.drain()

    def contains(self, key: ExtentKey) -> bool:
        with self._lock:
            return key in self._index

    def lookup(self, key: ExtentKey) -> ExtentInfo | None:
        with self._lock:
            return self._index.get(key)

    def extents(self) -> list[ExtentInfo]:
        with self._lock:
            return self._index.infos()

    def read_tokens(self, key: ExtentKey) -> np.ndarray | None:
        key = check_key(key)
        if self._closed:  # its client is closing or closed
            return None
        try:
            return self._read_tokens(key)
        except Exception as e:  # the binding raising (a header's read, a bad one's removal): a miss
            self._faults.unexpected(Op.LOAD, e, self._where)
            self._counters.add("io_errors")
            return None

    def _read_tokens(self, key: ExtentKey) -> np.ndarray | None:
        salt = self._salt(key)
        try:
            ext = objects.open_header(
                self._client, self._names, self._ns.id, key, salt, self._seal, self._scratch
            )
        except NewerFormat:  # a newer server's: kept
            self._counters.add("newer_extents")
            return None
        except FormatError:
            self._failures.drop(key, salt)
            return None
        except OSError:  # gone, or the store did not answer
            return None
        return None if ext.tokens is None else np.frombuffer(ext.tokens, dtype="<u4").astype(np.uint32)

    def discard(self, key: ExtentKey) -> bool:
        """Whether its header was there (a load reading it meanwhile misses a chunk: a clean MISS);
        False once the tier is closed (its client is closing or closed)."""
        if self._closed:
            return False
        removed = self._remove(key, self._salt(key))
        with self._lock:
            self._index.forget(key)
        self._manifest.forget([key])
        return removed

    def _remove(self, key: ExtentKey, salt: bytes | None) -> bool:
        return objects.remove_extent(
            self._client, self._names, self._ns.id, key, salt, self._seal, self._scratch
        )

    def host_memory(self, nbytes: int) -> memoryview:
        return self._client.host_memory(nbytes)

    def register_host_memory(self, buf: memoryview) -> None:
        reply = self._client.register(buf)
        if reply.ok:
            self._registered.append(buf)  # unregistered at close: a real client then unmaps it
        else:
            logger.warning("sgl_hicache: Mooncake could not register %d B of staging (code %d): transfers "
                           "go through its own buffer", buf.nbytes, reply.code)  # fmt: skip

    def stats(self) -> TierStats:
        c = self._counters.snapshot()
        with self._lock:
            extents, stored = len(self._index), self._index.bytes
        counted = {n: c.get(n, 0) for n in TierStats.__dataclass_fields__ if n not in _NOT_COUNTED}
        return TierStats(extents=extents, bytes_stored=stored, direct_io=False, **counted)

    def close(self, timeout_s: float | None = None) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        closer = threading.Thread(target=self._close, name="sgl-hicache-mooncake-close", daemon=True)
        closer.start()
        closer.join(timeout_s)
        if closer.is_alive():  # stores not started by now complete REJECTED without writing
            self._abandoned = True

    def _close(self) -> None:
        self._io.close()
        self._flush_manifest()  # what is waiting: a restart on this store finds it
        self._scratch.close()  # the I/O threads stopped: no read goes into their buffers
        for buf in self._registered:
            try:
                self._client.unregister(buf)
            except Exception as e:  # the client closes all the same
                logger.warning("sgl_hicache: Mooncake could not unregister staging at close: %s", e)
        self._client.close()  # may wait long for an absent master: bounded by close's timeout


def _info(ext: objects.Opened) -> ExtentInfo:
    h = ext.header
    return ExtentInfo(h.key, h.parent, h.token_count, h.payload_len, h.file_size)
