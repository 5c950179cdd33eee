"""The manifest of a namespace in the store: which extents its writers stored, for a warm start.

The store cannot be listed, so every tier of a namespace records the extents it wrote in *records*:
objects `m/<slot>` (client.py) of up to `RECORD_ENTRIES` (key, salt tag) pairs each, sealed with
the tier directory's secret (`DirectoryMac.record`). A writer gathers its stores and writes a record
when it has `RECORD_ENTRIES` of them, about every second otherwise (backend.py), and at close.

- **Claiming a slot**: `put` keeps an object already there, so a writer puts its record at the
  first slot it has not seen taken and reads it back: its own bytes mean the slot is its own, else
  it tries the next one. `m/head` holds the highest slot a writer claimed (a hint: every writer
  replaces it, so it may lag behind another's claim by a few slots).
- **Scanning** (a tier's open): the slots up to `m/head` and `SCAN_WINDOW` beyond, and further while
  a window still holds a record, are checked for existence in batches and the records read in
  batches; a record that does not verify (another deployment's secret, a tampered one) is skipped
  and counted. Slots the master evicted are holes that the next writer to open fills first.
- **Where it lives**: a Mooncake object lives in one client's segment and leaves the store with
  that client (a server stopped or restarted takes what its segment held). Records and `m/head`
  are kept in `COPIES` segments, so a server's restart takes no record with it while another
  client holds a segment; the extents its own segment held are gone all the same (skipped).
- **What a record proves**: nothing. It names extents; each is verified at open like a load's
  header (backend.py) before it is indexed. Entries of extents evicted or removed since name
  nothing and are skipped; a record the master evicted takes its entries' warm start with it
  (those extents are still found by lookup). A purge removes the salt's objects, not the entries
  naming them (keys and keyed salt tags only: no token ids, no KV).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterable

from sgl_hicache.tier.format import MAC_BYTES, DirectoryMac, FormatError
from sgl_hicache.tier.keys import KEY_BYTES, ExtentKey
from sgl_hicache.tier.mooncake.client import OBJECT_ALREADY_EXISTS, Names, StoreClient

RECORD_ENTRIES = 128
COPIES = 2  # a record lives in this many clients' segments (where there are as many)
SCAN_WINDOW = 1024  # slots checked per existence call of a scan
READ_BATCH = 256  # records read per call of a scan
CLAIM_TRIES = 64  # slots a flush tries before it gives up (its entries wait for the next flush)
MAX_PENDING = 1 << 16  # entries waiting for a record at most (the oldest go first)
_MAGIC = b"SGLHCMR1"
_COUNT = struct.Struct("<I")
_NO_SALT = bytes(MAC_BYTES)
_ENTRY = 1 + KEY_BYTES + MAC_BYTES  # has-salt flag, key, salt tag

Entry = tuple[ExtentKey, bytes | None]


def encode_record(entries: list[Entry], seal: DirectoryMac) -> bytes:
    body = bytearray(_MAGIC + _COUNT.pack(len(entries)))
    for key, salt in entries:
        body += bytes([salt is not None]) + key + (salt or _NO_SALT)
    return bytes(body) + seal.record(bytes(body))


def decode_record(data: bytes, seal: DirectoryMac) -> list[Entry]:
    """The entries of a record; raises FormatError for one not sealed with `seal` or malformed."""
    body, mac = data[:-MAC_BYTES], data[-MAC_BYTES:]
    if len(data) < len(_MAGIC) + _COUNT.size + MAC_BYTES or seal.record(body) != mac:
        raise FormatError("manifest record MAC mismatch: not written with this directory's secret")
    if not body.startswith(_MAGIC):
        raise FormatError("bad manifest record magic")
    (count,) = _COUNT.unpack_from(body, len(_MAGIC))
    start = len(_MAGIC) + _COUNT.size
    if len(body) != start + count * _ENTRY:
        raise FormatError("manifest record of inconsistent length")
    out: list[Entry] = []
    for at in range(start, len(body), _ENTRY):
        key = ExtentKey(body[at + 1 : at + 1 + KEY_BYTES])
        out.append((key, body[at + 1 + KEY_BYTES : at + _ENTRY] if body[at] else None))
    return out


class Manifest:
    """One tier's view of its namespace's manifest: `scan` at open, `add` per store, `flush`."""

    def __init__(self, client: StoreClient, names: Names, seal: DirectoryMac) -> None:
        self._client, self._names, self._seal = client, names, seal
        self._lock = threading.Lock()  # pending, next slot
        self._flushing = threading.Lock()  # one flush at a time
        self._pending: list[Entry] = []
        self._next = 0  # the lowest slot this writer has not seen taken
        self._taken: set[int] = set()  # slots seen taken at the scan, above `_next`
        self.bad_records = 0

    def scan(self) -> list[Entry]:
        """Every entry of every record that verifies, oldest slot first, each key once. Blocks."""
        head = self._head()
        taken, start = [], 0
        while True:
            window = list(range(start, start + SCAN_WINDOW))
            found = [s for s, x in zip(window, self._client.exist([self._names.record(s) for s in window]),
                                       strict=True) if x == 1]  # fmt: skip
            taken += found
            start += SCAN_WINDOW
            if not found and start > head:
                break
        free = sorted(set(range(start)) - set(taken))
        with self._lock:
            self._next = free[0] if free else start
            self._taken = set(taken)
        return self._read(taken)

    def _head(self) -> int:
        raw = self._client.get(self._names.head())
        try:
            return int(raw.decode("ascii")) if raw else 0
        except (UnicodeDecodeError, ValueError):
            return 0

    def _read(self, slots: list[int]) -> list[Entry]:
        entries: dict[ExtentKey, bytes | None] = {}
        for i in range(0, len(slots), READ_BATCH):
            names = [self._names.record(s) for s in slots[i : i + READ_BATCH]]
            for data in self._client.get_many(names):
                try:
                    entries.update(decode_record(data, self._seal) if data else [])
                except FormatError:
                    self.bad_records += 1
        return list(entries.items())

    def add(self, key: ExtentKey, salt: bytes | None) -> bool:
        """Record `key` at the next flush; whether a record's worth is waiting (flush now)."""
        with self._lock:
            self._pending.append((key, salt))
            del self._pending[:-MAX_PENDING]
            return len(self._pending) >= RECORD_ENTRIES

    def forget(self, keys: Iterable[ExtentKey]) -> None:
        """Entries not recorded yet that must not be (removed or purged since)."""
        gone = set(keys)
        with self._lock:
            self._pending = [e for e in self._pending if e[0] not in gone]

    def waiting(self) -> list[Entry]:
        with self._lock:
            return list(self._pending)

    def flush(self) -> int:
        """Write what is waiting as records; the records written. Entries that found no slot wait
        for the next flush. Raises OSError if the store fails (they wait too)."""
        with self._flushing:
            with self._lock:
                pending, self._pending = self._pending, []
            written, highest = 0, -1
            try:
                while pending:
                    slot = self._claim(encode_record(pending[:RECORD_ENTRIES], self._seal))
                    if slot is None:
                        break
                    pending, written, highest = pending[RECORD_ENTRIES:], written + 1, max(highest, slot)
            finally:
                with self._lock:
                    self._pending = (pending + self._pending)[-MAX_PENDING:]
            if highest >= 0:
                self._client.write(self._names.head(), str(highest).encode(), COPIES)
            return written

    def _claim(self, record: bytes) -> int | None:
        for _ in range(CLAIM_TRIES):
            with self._lock:
                while self._next in self._taken:
                    self._taken.discard(self._next)
                    self._next += 1
                slot, self._next = self._next, self._next + 1
            name = self._names.record(slot)
            reply = self._client.put(name, record, COPIES)
            if not reply.ok and reply.code != OBJECT_ALREADY_EXISTS:
                raise OSError(f"mooncake manifest record put: code {reply.code}")
            if self._client.get(name) == record:
                return slot
        return None
