"""One Mooncake Store client: how it is joined, what its objects are named, what its codes mean.

`MooncakeDistributedStore` (the `mooncake.store` module of `mooncake-transfer-engine[-non-cuda]`,
0.3.13) answers with integers: bytes moved, 0 for done, or a negative error code. `StoreClient`
keeps those calls in one place and turns every code into a `Reply`, so nothing of Mooncake's raises
into the tier's I/O threads; its batch calls (`write_many_from`, `get_many_into`, ...) are one call
of the store each, whatever the number of objects. The import of `mooncake.store` happens in
`connect` only: it needs the system library libibverbs.so.1 even over TCP (scripts/setup_venv.sh
installs it).

Objects of one namespace (names carry hashes only, never token ids), in the directory of their
salt: `<salt>` is the extent's salt tag (`DirectoryMac.salt` of its cache_salt, 32 hex digits) or
`-` for an extent stored without a cache_salt, so that one `remove_by_regex` reaches every object
of a salt in every namespace (`salt_pattern`):

    sglhc2/<ns hex>/<salt>/<key hex>                 the extent's header: an extent file's first
                                                     header_len bytes (docs/FORMAT.md), MACs included
    sglhc2/<ns hex>/<salt>/<key hex>.<pub>.<i>       chunk i of its payload, as stored (the file's
                                                     chunk i, without padding); <pub>: the publish's
                                                     `created_ns` (16 hex digits), recorded in the header
    sglhc2/<ns hex>/<salt>/a/<path key hex>          an alias: "<extent key hex>.<offset>" (file/aliases.py)
    sglhc2/<ns hex>/m/<n>, sglhc2/<ns hex>/m/head    the manifest (manifest.py): which extents the
                                                     namespace's writers stored, for a warm start

Placement (`MooncakeConfig.placement`): "any" (the default) leaves it to the master; with "local"
every single-copy write asks the master for this client's own segment first
(`ReplicateConfig.preferred_segment`; it falls back to another when that one is full), so a server
reads what it spilled by a memory copy, not over the transfer engine. Writes of several copies
(the manifest's records) are spread by the master.

With `real_client` (Mooncake's standalone mode, `MooncakeConfig.real_client`) the client is a
"dummy" of a `mooncake_client` on this host: every object lives in that process's segment, it does
every transfer, by a memory copy into or out of our shared memory (shm.py), and each call is one RPC
to it. Memory it has not mapped (`StoreClient.addressable`) is written from a copy in shared memory
registered for the call and read through the tier's scratch buffer (objects.py); a read whose call
was lost may still be copying into its destination (`RPC_LOST`, `LOST_AFTER_S`). The
calls that carry bytes (`write`, `get`, ...) carry at most the client's `local_buffer_size` a call
(INVALID_PARAMS past it): headers, aliases and manifest records only.

Chunk names are unique per publish: a re-publish of a key writes new chunks, and a load that read
the header before it reads the chunks that header names (or misses them, if removed since), never a
mix. Every write of an extent's object replaces it (`upsert`: a `put` of a name that exists keeps
the first object, measured: it answers 0 and leaves the object unchanged); the manifest's records
are `put` on purpose (manifest.py claims a slot that way).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from sgl_hicache.config import MooncakeConfig
from sgl_hicache.tier.directio import alloc_aligned
from sgl_hicache.tier.mooncake.shm import SharedMemory

logger = logging.getLogger("sgl_hicache.tier")

PREFIX = "sglhc2"  # "sglhc": the layout before salt directories and per-publish chunk names
NO_SALT = "-"

# Mooncake's error codes (mooncake-store types.h, 0.3.13) that the tier tells apart; any other
# negative code is an I/O error (the store or a peer unreachable, a transfer failed).
OBJECT_NOT_FOUND = -704
REPLICA_IS_NOT_READY = -703  # a put still in flight: not there yet
NO_AVAILABLE_HANDLE = -200  # no segment has room (also seen right after a master restart)
OBJECT_ALREADY_EXISTS = -705  # a put of a name that is taken (this version answers 0 instead)
OBJECT_HAS_LEASE = -706  # being read by someone: removed later by the master's eviction
NO_ANSWER = -1  # ours: a batch call that did not answer for every object
INVALID_PARAMS = -600  # e.g. an object larger than the buffer given to read it into
RPC_FAIL = -900  # the master (or a peer's RPC) did not answer: before any transfer
RPC_TIMEOUT = -901  # a master request timed out (Mooncake 0.3.12 on): before any transfer
RPC_LOST = -2  # ours: a read through a real client whose call was lost: its copy may still run
LOST_AFTER_S = 20.0
"""Through a real client, RPC_FAIL is the answer both for a call the dummy lost and for the real
client's own failed request to the master (Mooncake 0.3.13 `DummyClient::invoke_batch_rpc`); only a
lost call may leave a copy running. A call is lost by its request timing out (the dummy's client
pool keeps coro_io's default, 30 s, measured from after our clock started) or by its connection
breaking: the real client gone, whose copies went with it (or, past 160 requests in parallel on
one connection, another's timeout closing it: `MAX_IO_THREADS_STANDALONE`). So an RPC_FAIL answered
sooner than this (the master away: the real client's reconnects take 4-5 s) copied nothing; one
that took this long may still be copying (`RPC_LOST`). A lost batch answers RPC_FAIL for every
object: one whose other objects got other answers was answered."""
INVALID_REPLICA = -702  # no complete replica to read: before any transfer
LEASE_EXPIRED = -707  # the read's lease ran out: answered after its transfer ended
TRANSFER_FAIL = -800  # the transfer engine gave up: the transfer may still be writing
_GONE = {OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY}
BEFORE_TRANSFER = frozenset(
    {*_GONE, INVALID_PARAMS, NO_AVAILABLE_HANDLE, RPC_FAIL, RPC_TIMEOUT, INVALID_REPLICA, LEASE_EXPIRED}
)
"""Failures after which no transfer can still write a buffer (none started, or it ended: Mooncake
0.3.x types.h); every other failure, TRANSFER_FAIL, ours NO_ANSWER and codes not known here, may
leave one in flight."""


class MooncakeUnavailable(OSError):
    """The client could not be set up (library missing, master unreachable): one line."""


@dataclass(frozen=True)
class Reply:
    """What one call answered: `n` bytes moved (or 0 for done) when `code` is 0."""

    code: int = 0
    n: int = 0

    @property
    def ok(self) -> bool:
        return self.code == 0

    @property
    def gone(self) -> bool:
        """The object is not there (never stored, evicted, removed): a clean miss."""
        return self.code in _GONE

    @property
    def no_space(self) -> bool:
        return self.code == NO_AVAILABLE_HANDLE


def _reply(rc: int) -> Reply:
    return Reply(code=rc) if rc < 0 else Reply(n=rc)


def address(view: memoryview) -> int:
    """Address of a contiguous byte view's first byte (read-only views too)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


class Names:
    """The object names of one namespace (the module doc); `salt`: an extent's salt tag or None."""

    def __init__(self, ns: bytes) -> None:
        self._base = f"{PREFIX}/{ns.hex()}/"

    def _dir(self, salt: bytes | None) -> str:
        return self._base + (NO_SALT if salt is None else salt.hex()) + "/"

    def header(self, key: bytes, salt: bytes | None = None) -> str:
        return self._dir(salt) + key.hex()

    def chunk(self, key: bytes, salt: bytes | None, pub: int, index: int) -> str:
        return f"{self._dir(salt)}{key.hex()}.{pub:016x}.{index}"

    def alias(self, path_key: bytes, salt: bytes | None = None) -> str:
        return f"{self._dir(salt)}a/{path_key.hex()}"

    def record(self, slot: int) -> str:
        return f"{self._base}m/{slot}"

    def head(self) -> str:
        return f"{self._base}m/head"


def salt_pattern(salt: bytes) -> str:
    """The regex of every object of salt tag `salt`, in every namespace."""
    return f"^{PREFIX}/[0-9a-f]{{32}}/{salt.hex()}/"


class StoreClient:
    """Typed calls on one `MooncakeDistributedStore`; thread-safe as the store is. Never raises for
    what the store answers (codes come back in `Reply`). Each method is one call of the store.

    `segment`: this client's own segment (its `get_hostname()`), where every single-copy write asks
    the master to place its object first (`ReplicateConfig.preferred_segment`; the master falls back
    to another segment when that one has no room), or "" to leave placement to the master's
    strategy (`MooncakeConfig.placement`). An object in the reader's own segment is read by a
    memory copy, one in another client's over the transfer engine (loopback TCP here: several
    times slower, docs/RESULTS.md)."""

    def __init__(self, store: Any, segment: str = "", shared: SharedMemory | None = None) -> None:
        self._store, self.segment, self._shared = store, segment, shared
        self._one = _replicas(1, segment) if segment else None  # None: the binding's default config
        self._mapped: dict[int, int] = {}  # standalone: start -> end of each registered buffer
        self._kept: list[memoryview] = []  # standalone: bounce copies the real client would not let go
        self._mapped_lock = threading.Lock()

    def host_memory(self, nbytes: int) -> memoryview:
        """Page-aligned memory this client can move bytes into and out of, once registered: the
        real client's shared memory in the standalone mode (shm.py), else anonymous memory."""
        return self._shared.alloc(nbytes) if self._shared is not None else alloc_aligned(nbytes)

    def addressable(self, view: memoryview) -> bool:
        """Whether a transfer can go straight into or out of `view`: always, but in the standalone
        mode, where only buffers registered here are (the real client maps nothing else)."""
        if self._shared is None or not view.nbytes:
            return True
        start = address(view)
        with self._mapped_lock:
            return any(a <= start and start + view.nbytes <= b for a, b in self._mapped.items())

    def _placed(self, copies: int) -> tuple[Any, ...]:
        """The trailing config argument of a write of `copies` copies (none: the binding's default).
        More than one copy is spread by the master (that is what the copies are for)."""
        if copies > 1:
            return (_replicas(copies),)
        return () if self._one is None else (self._one,)

    def write_from(self, name: str, data: memoryview) -> Reply:
        """Store `data` as `name` (replacing it) straight from its memory: no copy of ours, and
        registered memory is read by the transfer engine directly."""
        if not self.addressable(data):
            return self._bounced([name], [data])[0]
        return _reply(self._store.upsert_from(name, address(data), data.nbytes, *self._placed(1)))

    def write_many_from(self, names: list[str], data: list[memoryview]) -> list[Reply]:
        """`write_from` of each (name, bytes) pair, in one call."""
        if not names:
            return []
        if not all(self.addressable(d) for d in data):  # standalone mode only
            return self._bounced(names, data)
        codes = self._store.batch_upsert_from(
            names, [address(d) for d in data], [d.nbytes for d in data], *self._placed(1)
        )
        return _replies(codes, len(names))

    def _bounced(self, names: list[str], data: list[memoryview]) -> list[Reply]:
        """`write_many_from` of memory the real client does not map: copied into shared memory of
        its own, registered for the call (the bytes calls carry no more than the client's local
        buffer, `local_buffer_size`: a chunk may be larger). Its memory is unmapped here after the
        call; the real client's mapping, which a transfer that outlived a broken call may still
        read, goes with the registration."""
        assert self._shared is not None
        buf = self._shared.alloc(sum(d.nbytes for d in data))
        got = _reply(self._store.register_buffer(address(buf), buf.nbytes))
        if not got.ok:
            return [got] * len(names)
        at, addrs = 0, []
        for d in data:
            buf[at : at + d.nbytes] = d.cast("B")
            addrs.append(address(buf[at : at + d.nbytes]) if d.nbytes else 0)
            at += d.nbytes
        try:
            codes = self._store.batch_upsert_from(names, addrs, [d.nbytes for d in data], *self._placed(1))
        finally:
            if int(self._store.unregister_buffer(address(buf))) != 0:
                self._kept.append(buf)  # still the real client's at our address: never reused
        return _replies(codes, len(names))

    def write(self, name: str, data: bytes, copies: int = 1) -> Reply:
        """Store `data` as `name`, replacing it; in `copies` segments where the store has that many
        (one per client: an object leaves the store with the client whose segment holds it)."""
        return _reply(self._store.upsert(name, data, *self._placed(copies)))

    def write_many(self, names: list[str], data: list[bytes]) -> Reply:
        """`write` of each (name, bytes) pair, in one call; one code for all."""
        return _reply(self._store.upsert_batch(names, data, *self._placed(1))) if names else Reply()

    def put(self, name: str, data: bytes, copies: int = 1) -> Reply:
        """Store `data` as `name` (in `copies` segments, as `write`) unless there is an object of
        that name (then it is kept, and the reply says nothing of which: read it back)."""
        return _reply(self._store.put(name, data, *self._placed(copies)))

    def endpoints_of(self, names: list[str]) -> list[list[str]]:
        """Per name, the transport endpoints of the segments holding a memory copy of it ([] if
        none), one call; for diagnostics and tests (`placement`). With a metadata server (HTTP,
        etcd) a segment's endpoint is its name, `segment`; with P2PHANDSHAKE it may not be."""
        if not names:
            return []
        got = self._store.batch_get_replica_desc(names)
        return [
            [r.get_memory_descriptor().buffer_descriptor.transport_endpoint for r in got.get(n, [])
             if r.is_memory_replica()]
            for n in names
        ]  # fmt: skip

    def size(self, name: str) -> Reply:
        return _reply(self._store.get_size(name))

    def get_into(self, name: str, dest: memoryview) -> Reply:
        """Read the whole object into `dest` (writable); an object larger than `dest` is refused by
        the store (INVALID_PARAMS), a smaller one answers its size."""
        start = time.monotonic()
        return self._read(_reply(self._store.get_into(name, address(dest), dest.nbytes)), start)

    def get_many_into(self, names: list[str], dest: list[memoryview]) -> list[Reply]:
        """`get_into` of each (name, destination) pair, in one call."""
        if not names:
            return []
        start = time.monotonic()
        codes = self._store.batch_get_into(names, [address(d) for d in dest], [d.nbytes for d in dest])
        replies = _replies(codes, len(names))
        if any(r.code != RPC_FAIL for r in replies):  # answered by the real client (LOST_AFTER_S)
            return replies
        return [self._read(r, start) for r in replies]

    def _read(self, reply: Reply, start: float) -> Reply:
        """A read's reply (its call began at `start`, monotonic); through a real client an RPC_FAIL
        that took `LOST_AFTER_S` or more is `RPC_LOST` (the module doc)."""
        slow = time.monotonic() - start >= LOST_AFTER_S
        return Reply(code=RPC_LOST) if self._shared is not None and reply.code == RPC_FAIL and slow else reply

    def get(self, name: str) -> bytes | None:
        """A small object's bytes; None if it is missing or the store did not answer."""
        data = self._store.get(name)
        return bytes(data) if data else None

    def get_many(self, names: list[str]) -> list[bytes | None]:
        """`get` of each name, in one call."""
        if not names:
            return []
        got = list(self._store.get_batch(names))
        if len(got) != len(names):
            return [None] * len(names)
        return [bytes(d) if d else None for d in got]

    def exist(self, names: list[str]) -> list[int]:
        """Per name: 1 present, 0 absent, negative: could not tell."""
        if not names:
            return []
        got = [int(x) for x in self._store.batch_is_exist(names)]
        return got if len(got) == len(names) else [NO_ANSWER] * len(names)

    def remove(self, name: str) -> Reply:
        return _reply(self._store.remove(name, True))

    def remove_many(self, names: list[str]) -> list[Reply]:
        """`remove` of each name, in one call."""
        return _replies(self._store.batch_remove(names, True), len(names)) if names else []

    def remove_matching(self, pattern: str) -> Reply:
        """Remove every object whose name matches the regex `pattern`; `n`: how many went."""
        return _reply(self._store.remove_by_regex(pattern, True))

    def register(self, buf: memoryview) -> Reply:
        """Let transfers go straight into and out of `buf`; in the standalone mode `buf` must be a
        whole `host_memory` allocation (the real client then maps it)."""
        reply = _reply(self._store.register_buffer(address(buf), buf.nbytes))
        if reply.ok and self._shared is not None:
            with self._mapped_lock:
                self._mapped[address(buf)] = address(buf) + buf.nbytes
        return reply

    def unregister(self, buf: memoryview) -> Reply:
        """Undo `register` of `buf` (before it is freed: its pages may be mapped again)."""
        with self._mapped_lock:
            self._mapped.pop(address(buf), None)  # first: no transfer starts into it from here on
        return _reply(self._store.unregister_buffer(address(buf)))

    def healthy(self) -> bool:
        return int(self._store.health_check()) == 0

    def close(self) -> None:
        self._store.close()


def _replicas(copies: int, preferred: str = "") -> Any:
    from mooncake.store import ReplicateConfig

    config = ReplicateConfig()
    config.replica_num = copies
    if preferred:
        config.preferred_segment = preferred
    return config


def _replies(codes: Any, n: int) -> list[Reply]:
    """Per-object replies of a batch call; a batch that did not answer for each is an I/O error of each."""
    got = [int(c) for c in codes]
    return [_reply(c) for c in got] if len(got) == n else [Reply(code=NO_ANSWER)] * n


def connect(cfg: MooncakeConfig) -> StoreClient:
    """Set up a client of the store `cfg` names (its segment of `global_segment_size` bytes joins
    the store), or a dummy of the real client it names (`real_client`). Raises MooncakeUnavailable
    with one line."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise MooncakeUnavailable(f"cannot import mooncake.store ({e}); pip install "
                                  "mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine") from None  # fmt: skip
    if cfg.real_client:
        return _join_real_client(MooncakeDistributedStore(), cfg)
    _check_reachable(cfg.master, "master")  # setup itself retries an absent master for about 90 s
    store = MooncakeDistributedStore()
    offload = (
        {"enable_ssd_offload": True, "ssd_offload_path": cfg.ssd_offload_path} if cfg.ssd_offload_path else {}
    )
    rc = store.setup(cfg.local_hostname, cfg.metadata_server, cfg.global_segment_size, cfg.local_buffer_size,
                     cfg.protocol, cfg.device_name, cfg.master, **offload)  # fmt: skip
    if rc != 0:
        raise MooncakeUnavailable(f"Mooncake client setup failed with code {rc} (master {cfg.master}, "
                                  f"metadata {cfg.metadata_server}, protocol {cfg.protocol})")  # fmt: skip
    local = cfg.placement == "local" and cfg.global_segment_size > 0
    return StoreClient(store, str(store.get_hostname()) if local else "")


def _join_real_client(store: Any, cfg: MooncakeConfig) -> StoreClient:
    """A dummy of the real client at `cfg.real_client` (its first argument, a memory pool size, is
    unused by Mooncake 0.3.13: the segment is the real client's)."""
    _check_reachable(cfg.real_client, "real client (mooncake_client)")
    shared = SharedMemory()
    rc = store.setup_dummy(0, cfg.local_buffer_size, cfg.real_client)
    if rc != 0:
        raise MooncakeUnavailable(
            f"joining the Mooncake real client at {cfg.real_client} failed with code {rc}"
        )
    return StoreClient(store, "", shared)


def _check_reachable(address: str, what: str, timeout_s: float = 3.0) -> None:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        raise MooncakeUnavailable(f"the Mooncake {what} at {address} does not answer ({e})") from None
