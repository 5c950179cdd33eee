"""The manifest of a namespace in the store: which extents its writers stored, for a warm start.

The store cannot be listed, so every tier of a namespace records the extents it wrote in *records*:
objects `m/<slot>` (client.py) of up to `RECORD_ENTRIES` (key, salt tag) pairs each, sealed with
the tier directory's secret (`DirectoryMac.record`). A writer gathers its stores and writes a record
when it has `RECORD_ENTRIES` of them, about every second otherwise (backend.py), and at close.

- **Claiming a slot**: `put` keeps an object already there, so a writer puts its record at the
  first slot it has not seen taken and reads it back: its own bytes mean the slot is its own, else
  it tries the next one (every record carries a random nonce, so no two are byte-equal).
- **`m/head`**: the highest slot a writer claimed, raised after a claim and never lowered (a writer
  writes it only above what it reads there, and not at all when the store does not answer for it;
  one racing it may still write its own lower claim, never below what both read). Not covered: a
  head the store lost (both copies' segments gone) reads as none, and a scan then stops two empty
  windows past the highest record it meets, so records a compaction left beyond a long run of
  emptied slots lose their warm start (never an answer: lookups still find them). A scan reads up to it, so slots emptied below it cost a scan only
  existence checks (a call per `SCAN_WINDOW`).
- **Scanning** (a tier's open): windows of `SCAN_WINDOW` slots up to the one holding `m/head`, the
  next one, and further while a window still holds a record, are checked for existence (a call
  each) and the records read in batches; a record that does not verify (another deployment's
  secret, a tampered one) is skipped, counted (`bad_records`) and never removed (it may be another
  deployment's manifest). Slots the master evicted or a compaction emptied are holes that the
  next writer to open fills first.
- **Compaction** (`compact`, at a tier's open after its warm start sorted the entries): when the
  scan read at least `COMPACT_MIN_RECORDS` records and the live entries (those whose extent the
  warm start found, or could not tell about: warm_start.py) fit in half as many records, or are
  at most half the entries read (duplicates counted), the live entries are written as new records
  (claimed as `flush` claims, `m/head` raised: a scan that could not read the head compacts
  nothing), and only once every one is confirmed are the records this scan read removed, each only
  if the slot still holds the bytes read (re-read in a batch just before its removal; records carry
  a nonce, so bytes written since never equal them). So a record written since the scan is never
  removed (another writer's, even in a slot emptied meanwhile by another compactor), entries waiting in a writer
  are untouched, and a store call failing midway removes nothing (new records already written
  are duplicates; entries dedupe by key). Two compactors at once both rewrite the live entries
  (duplicate records, compacted at a later open) and each removes what it read. Not covered: the
  store has no compare-and-delete, so a record written into a slot in the moment between a
  compactor's re-read and its removal (the slot emptied by another compactor, then claimed) is
  removed: its entries lose their warm start (still found by lookup; never a wrong answer).
- **Where it lives**: a Mooncake object lives in one client's segment and leaves the store with
  that client (a server stopped or restarted takes what its segment held). Records and `m/head`
  are kept in `COPIES` segments, so a server's restart takes no record with it while another
  client holds a segment; the extents its own segment held are gone all the same (skipped).
- **What a record proves**: nothing. It names extents; each is verified at open like a load's
  header (warm_start.py) before it is indexed. Entries of extents evicted or removed since name
  nothing and are skipped (until a compaction drops them); a record the master evicted takes its
  entries' warm start with it (those extents are still found by lookup). A purge removes the
  salt's objects, not the entries naming them (keys and keyed salt tags only: no token ids, no KV).
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from collections.abc import Iterable, Iterator
from typing import NamedTuple

from sgl_hicache.tier.format import MAC_BYTES, DirectoryMac, FormatError
from sgl_hicache.tier.keys import KEY_BYTES, ExtentKey
from sgl_hicache.tier.mooncake.client import OBJECT_ALREADY_EXISTS, Names, StoreClient

RECORD_ENTRIES = 128
COPIES = 2  # a record lives in this many clients' segments (where there are as many)
SCAN_WINDOW = 1024  # slots checked per existence call of a scan
READ_BATCH = 256  # records read per call of a scan
CLAIM_TRIES = 64  # slots a flush tries before it gives up (its entries wait for the next flush)
MAX_PENDING = 1 << 16  # entries waiting for a record at most (the oldest go first)
COMPACT_MIN_RECORDS = 16  # a scan that read fewer records never compacts
_MAGIC = b"SGLHCMR2"  # with a nonce
_MAGIC_V1 = b"SGLHCMR1"  # without: still read
_NONCE = 16
_COUNT = struct.Struct("<I")
_NO_SALT = bytes(MAC_BYTES)
_ENTRY = 1 + KEY_BYTES + MAC_BYTES  # has-salt flag, key, salt tag

Entry = tuple[ExtentKey, bytes | None]


class Compaction(NamedTuple):
    written: int  # new records, holding the live entries
    removed: int  # records the scan read, removed since


def encode_record(entries: list[Entry], seal: DirectoryMac) -> bytes:
    """A sealed record of `entries`, with a random nonce: no two records are byte-equal, so a slot
    read back as one's own bytes is one's own (`_claim`) and a compaction's re-read before removal
    (`_remove_read`) never mistakes a record written since for one it read."""
    body = bytearray(_MAGIC + _COUNT.pack(len(entries)) + os.urandom(_NONCE))
    for key, salt in entries:
        body += bytes([salt is not None]) + key + (salt or _NO_SALT)
    return bytes(body) + seal.record(bytes(body))


def decode_record(data: bytes, seal: DirectoryMac) -> list[Entry]:
    """The entries of a record; raises FormatError for one not sealed with `seal` or malformed."""
    body, mac = data[:-MAC_BYTES], data[-MAC_BYTES:]
    if len(data) < len(_MAGIC) + _COUNT.size + MAC_BYTES or seal.record(body) != mac:
        raise FormatError("manifest record MAC mismatch: not written with this directory's secret")
    if not body.startswith((_MAGIC, _MAGIC_V1)):
        raise FormatError("bad manifest record magic")
    (count,) = _COUNT.unpack_from(body, len(_MAGIC))
    start = len(_MAGIC) + _COUNT.size + (_NONCE if body.startswith(_MAGIC) else 0)
    if len(body) != start + count * _ENTRY:
        raise FormatError("manifest record of inconsistent length")
    out: list[Entry] = []
    for at in range(start, len(body), _ENTRY):
        key = ExtentKey(body[at + 1 : at + 1 + KEY_BYTES])
        out.append((key, body[at + 1 + KEY_BYTES : at + _ENTRY] if body[at] else None))
    return out


def _digest(record: bytes) -> bytes:
    return hashlib.blake2b(record, digest_size=16).digest()


class Manifest:
    """One tier's view of its namespace's manifest: `scan` at open (then `compact`), `add` per
    store, `flush`."""

    def __init__(self, client: StoreClient, names: Names, seal: DirectoryMac) -> None:
        self._client, self._names, self._seal = client, names, seal
        self._lock = threading.Lock()  # pending, next slot
        self._flushing = threading.Lock()  # one flush or compaction at a time
        self._pending: list[Entry] = []
        self._next = 0  # the lowest slot this writer has not seen taken
        self._taken: set[int] = set()  # slots seen taken at the scan, above `_next`
        self._read: dict[int, bytes] = {}  # slot -> digest of the record the scan read there (verified)
        self._entries_read = 0  # the entries of those records, duplicates included
        self._head_known = False  # whether the scan read `m/head` (or saw there is none)
        self.bad_records = 0

    def scan(self) -> list[Entry]:
        """Every entry of every record that verifies, oldest slot first, each key once. Blocks."""
        head = self._head()
        self._head_known = head is not None
        head = 0 if head is None else head
        taken, start = [], 0
        while True:
            window = list(range(start, start + SCAN_WINDOW))
            found = [s for s, x in zip(window, self._client.exist([self._names.record(s) for s in window]),
                                       strict=True) if x == 1]  # fmt: skip
            taken += found
            start += SCAN_WINDOW
            if not found and start > head + SCAN_WINDOW:
                break
        free = sorted(set(range(start)) - set(taken))
        with self._lock:
            self._next = free[0] if free else start
            self._taken = set(taken)
        return self._read_records(taken)

    def _head(self) -> int | None:
        """The slot `m/head` names; -1 if there is none (or not a number: written over); None
        if the store did not answer (it may hold a higher one)."""
        raw = self._client.get(self._names.head())
        if raw is None:  # missing, or no answer: the existence check tells which
            return -1 if self._client.exist([self._names.head()]) == [0] else None
        try:
            return int(raw.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            return -1

    def _raise_head(self, slot: int, required: bool = False) -> None:
        """`m/head` := `slot`, unless it holds as high a slot already, or the store did not say
        what it holds (never lowered: then nothing is written, and OSError if `required`). Raises
        OSError if the write failed."""
        if slot < 0:  # nothing claimed
            return
        head = self._head()
        if head is None and required:
            raise OSError("mooncake manifest head unanswered: not raised")
        if head is not None and slot > head:
            reply = self._client.write(self._names.head(), str(slot).encode(), COPIES)
            if not reply.ok:
                raise OSError(f"mooncake manifest head write: code {reply.code}")

    def _read_records(self, slots: list[int]) -> list[Entry]:
        entries: dict[ExtentKey, bytes | None] = {}
        self._read, self._entries_read = {}, 0
        for i in range(0, len(slots), READ_BATCH):
            batch = slots[i : i + READ_BATCH]
            for slot, data in zip(batch, self._client.get_many([self._names.record(s) for s in batch]),
                                  strict=True):  # fmt: skip
                if not data:  # gone since the existence check, or the store did not answer
                    continue
                try:
                    got = decode_record(data, self._seal)
                except FormatError:
                    self.bad_records += 1
                    continue
                self._read[slot], self._entries_read = _digest(data), self._entries_read + len(got)
                entries.update(got)
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
        for the next flush. Raises OSError if the store fails (the entries not written wait too)."""
        with self._flushing:
            with self._lock:
                pending, self._pending = self._pending, []
            written, highest = 0, -1
            try:
                for slot in self._put(pending):
                    written, highest = written + 1, max(highest, slot)
            finally:
                with self._lock:
                    self._pending = (pending[written * RECORD_ENTRIES :] + self._pending)[-MAX_PENDING:]
            self._raise_head(highest)
            return written

    def compact(self, live: list[Entry]) -> Compaction | None:
        """Rewrite the records the scan read as records of `live` (the entries to keep) and remove
        them (the module doc's contract); None if not worth it (nothing done). Once per scan.
        Raises OSError if the store failed before every new record was confirmed (then nothing
        was removed)."""
        with self._flushing:
            read, entries_read, self._read = self._read, self._entries_read, {}
            needed = -(-len(live) // RECORD_ENTRIES)
            if not self._head_known:  # its new records might land beyond a head it cannot see
                return None
            if len(read) < COMPACT_MIN_RECORDS or (2 * needed > len(read) and 2 * len(live) > entries_read):
                return None
            slots = list(self._put(live))
            if len(slots) < needed:
                raise OSError(f"no free manifest slot in {CLAIM_TRIES} tries: compaction abandoned")
            self._raise_head(max(slots, default=-1), required=True)
            return Compaction(len(slots), self._remove_read(read))

    def _remove_read(self, read: dict[int, bytes]) -> int:
        """Remove the records of `read` (slot -> digest) still there as read; how many went."""
        removed, slots = 0, sorted(read)
        for i in range(0, len(slots), READ_BATCH):
            batch = slots[i : i + READ_BATCH]
            names = [self._names.record(s) for s in batch]
            now = self._client.get_many(names)
            still = [n for n, s, d in zip(names, batch, now, strict=True) if d and _digest(d) == read[s]]
            removed += sum(reply.ok for reply in self._client.remove_many(still))
        return removed

    def _put(self, entries: list[Entry]) -> Iterator[int]:
        """Claim a slot for each record's worth of `entries`, in order, yielding each slot claimed;
        stops where none was found in CLAIM_TRIES. Raises OSError if the store failed."""
        for i in range(0, len(entries), RECORD_ENTRIES):
            slot = self._claim(encode_record(entries[i : i + RECORD_ENTRIES], self._seal))
            if slot is None:
                return
            yield slot

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
