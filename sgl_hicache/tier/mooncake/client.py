"""One Mooncake Store client: how it is joined, what its objects are named, what its codes mean.

`MooncakeDistributedStore` (the `mooncake.store` module of `mooncake-transfer-engine[-non-cuda]`,
0.3.13) answers with integers: bytes moved, 0 for done, or a negative error code. `StoreClient`
keeps those calls in one place and turns every code into a `Reply`, so nothing of Mooncake's raises
into the tier's I/O threads. The import of `mooncake.store` happens in `connect` only: it needs the
system library libibverbs.so.1 even over TCP (scripts/setup_venv.sh installs it).

Objects of one namespace (names carry hashes only, never token ids):

    sglhc/<namespace hex>/<extent key hex>        the extent's header: an extent file's first
                                                  header_len bytes (docs/FORMAT.md), MACs included
    sglhc/<namespace hex>/<extent key hex>/<i>    chunk i of its payload, as stored (the file's bytes
                                                  [header_len + offset_i, + length_i))
    sglhc/<namespace hex>/a/<path key hex>        an alias: "<extent key hex>.<offset>" (file/aliases.py)

Every write replaces its object (`upsert`: a `put` of a name that exists would keep the first
object, measured: it answers 0 and leaves the object unchanged, so a stale chunk of an earlier
write, or of another deployment, would outlive a rewrite and fail every later load). A reader that
meets a mix of two writes fails a checksum: CORRUPT, never bytes.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import Any

import numpy as np

from sgl_hicache.config import MooncakeConfig

logger = logging.getLogger("sgl_hicache.tier")

PREFIX = "sglhc"

# Mooncake's error codes (mooncake-store types.h, 0.3.13) that the tier tells apart; any other
# negative code is an I/O error (the store or a peer unreachable, a transfer failed).
OBJECT_NOT_FOUND = -704
REPLICA_IS_NOT_READY = -703  # a put still in flight: not there yet
NO_AVAILABLE_HANDLE = -200  # no segment has room (also seen right after a master restart)
OBJECT_HAS_LEASE = -706  # being read by someone: removed later by the master's eviction
_GONE = {OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY}


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
    """The object names of one namespace."""

    def __init__(self, ns: bytes) -> None:
        self._base = f"{PREFIX}/{ns.hex()}/"

    def header(self, key: bytes) -> str:
        return self._base + key.hex()

    def chunk(self, key: bytes, index: int) -> str:
        return f"{self._base}{key.hex()}/{index}"

    def alias(self, path_key: bytes) -> str:
        return f"{self._base}a/{path_key.hex()}"


class StoreClient:
    """Typed calls on one `MooncakeDistributedStore`; thread-safe as the store is. Never raises for
    what the store answers (codes come back in `Reply`)."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def write_from(self, name: str, data: memoryview) -> Reply:
        """Store `data` as `name` (replacing it) straight from its memory: no copy of ours, and
        registered memory is read by the transfer engine directly."""
        return _reply(self._store.upsert_from(name, address(data), data.nbytes))

    def write(self, name: str, data: bytes) -> Reply:
        """Store `data` as `name`, replacing it."""
        return _reply(self._store.upsert(name, data))

    def size(self, name: str) -> Reply:
        return _reply(self._store.get_size(name))

    def get_into(self, name: str, dest: memoryview) -> Reply:
        """Read the whole object into `dest` (writable); an object larger than `dest` is refused by
        the store (INVALID_PARAMS), a smaller one answers its size."""
        return _reply(self._store.get_into(name, address(dest), dest.nbytes))

    def get(self, name: str) -> bytes | None:
        """A small object's bytes; None if it is missing or the store did not answer."""
        data = self._store.get(name)
        return bytes(data) if data else None

    def exist(self, names: list[str]) -> list[int]:
        """Per name: 1 present, 0 absent, negative: could not tell."""
        return [int(x) for x in self._store.batch_is_exist(names)] if names else []

    def remove(self, name: str) -> Reply:
        return _reply(self._store.remove(name, True))

    def register(self, buf: memoryview) -> Reply:
        return _reply(self._store.register_buffer(address(buf), buf.nbytes))

    def healthy(self) -> bool:
        return int(self._store.health_check()) == 0

    def close(self) -> None:
        self._store.close()


def connect(cfg: MooncakeConfig) -> StoreClient:
    """Set up a client of the store `cfg` names (its segment of `global_segment_size` bytes joins
    the store). Raises MooncakeUnavailable with one line."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise MooncakeUnavailable(f"cannot import mooncake.store ({e}); pip install "
                                  "mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine") from None  # fmt: skip
    _check_reachable(cfg.master)  # setup itself retries an absent master for about 90 s
    store = MooncakeDistributedStore()
    offload = (
        {"enable_ssd_offload": True, "ssd_offload_path": cfg.ssd_offload_path} if cfg.ssd_offload_path else {}
    )
    rc = store.setup(cfg.local_hostname, cfg.metadata_server, cfg.global_segment_size, cfg.local_buffer_size,
                     cfg.protocol, cfg.device_name, cfg.master, **offload)  # fmt: skip
    if rc != 0:
        raise MooncakeUnavailable(f"Mooncake client setup failed with code {rc} (master {cfg.master}, "
                                  f"metadata {cfg.metadata_server}, protocol {cfg.protocol})")  # fmt: skip
    return StoreClient(store)


def _check_reachable(address: str, timeout_s: float = 3.0) -> None:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        raise MooncakeUnavailable(f"the Mooncake master at {address} does not answer ({e})") from None
