"""The Mooncake tier's scratch buffers (`Scratch`): where a header, a compressed chunk or the part of
a chunk a prefix load needs is read before it is verified and placed (objects.py). Each is
registered with the store (RDMA reads into registered memory only) and owned here until it is
unregistered: none outlives the tier's close, none stays larger than `SCRATCH_KEEP_BYTES`, and none
is unregistered, reused or freed while a transfer may still write it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from sgl_hicache.tier.directio import alloc_aligned
from sgl_hicache.tier.faults import logger
from sgl_hicache.tier.format import align_up
from sgl_hicache.tier.mooncake.client import BEFORE_TRANSFER, Reply

SCRATCH_SPOIL_LIMIT = 64 << 20
"""The most scratch set aside for good (`Scratch.spoil`); past it no use of a buffer starts
(`ScratchExhausted`): every load and store needs one for its headers, so the tier then fails them
all (counted, recomputed) until the server restarts, rather than transfers given up on again and
again eating the host's memory."""


class ScratchExhausted(OSError):
    """`SCRATCH_SPOIL_LIMIT` reached: no scratch buffer is made any more."""


SCRATCH_KEEP_BYTES = 4 << 20
"""A thread's scratch buffer is kept between uses up to this size; a larger one is unregistered and
dropped as the use that needed it ends: none stays that big, outside any memory budget. The calls
are cut to fit it (`open_headers`: 64 headers a call; load.py: the compressed chunks of a call), so
only one chunk larger than it needs a buffer made for one use."""


class _Held:
    """One thread's scratch: its buffer (None: none now) and whether a use of it is open."""

    def __init__(self) -> None:
        self.buf: memoryview | None = None
        self.busy = False


def late_writes(replies: Sequence[Reply]) -> bool:
    """Whether a transfer of these replies may still write its buffer: one the store gave up on (a
    failure not known to come before any transfer, `client.BEFORE_TRANSFER`: a missing object, a
    buffer refused, no master; an outage of the master spoils nothing)."""
    return any(not r.ok and r.code not in BEFORE_TRANSFER for r in replies)


class Scratch:
    """Byte buffers, one per thread, each registered with the store (`register`) when made and
    unregistered (`unregister`) before it is dropped, all owned here whatever the thread (thread-safe).

    A thread uses its buffer in a block, one at a time (`use`; a nested one raises RuntimeError);
    it grows by at least doubling, up to SCRATCH_KEEP_BYTES (past it, what a use needs), so uses
    growing in small steps cost a few registrations. No buffer is unregistered while a use of it is
    open; then each goes: the one a thread's grown buffer replaces (once its successor is
    registered), one over SCRATCH_KEEP_BYTES as its use ends, a thread's that exited when another
    thread's grows or at `close`, and every other at `close`, which first waits (bounded) for the
    uses open to end and refuses any later (RuntimeError: the client is about to close). A buffer
    a failed transfer may still write (`spoil`) is never used again nor unregistered: kept until
    this object is gone. `register` raises when the store refuses (the thread keeps its buffer); a
    refused or raising `unregister` is logged once. `alloc` makes a buffer (the store's
    `host_memory`). `held_bytes`: what is held now."""

    def __init__(
        self, register: Callable[[memoryview], object], unregister: Callable[[memoryview], object],
        alloc: Callable[[int], memoryview] = alloc_aligned,
    ) -> None:  # fmt: skip
        self._register, self._unregister, self._alloc = register, unregister, alloc
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified as a use ends
        self._held: dict[threading.Thread, _Held] = {}  # by the thread using it
        self._spoiled: list[memoryview] = []  # written, maybe, by transfers the store gave up on
        self._closed = self._release_failed = self._spoil_logged = False

    @property
    def held_bytes(self) -> int:
        """The bytes of the buffers held now (registered with the store)."""
        with self._lock:
            return sum(h.buf.nbytes for h in self._held.values() if h.buf is not None)

    @contextmanager
    def use(self, nbytes: int) -> Iterator[memoryview]:
        """The calling thread's buffer, `nbytes` of it, for the block (the view is not valid after:
        the buffer may be reused, or unregistered)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the Mooncake tier is closed")
            if nbytes and self.spoiled_bytes >= SCRATCH_SPOIL_LIMIT:
                raise ScratchExhausted(f"{self.spoiled_bytes} B of Mooncake scratch set aside for failed "
                                       "transfers: no more is made")  # fmt: skip
            held = self._held.setdefault(threading.current_thread(), _Held())
            if held.busy:
                raise RuntimeError("this thread's scratch buffer is in use")
            held.busy = True
        try:
            yield self._grown(held, nbytes)[:nbytes]
        finally:
            self._end(held)

    def _grown(self, held: _Held, nbytes: int) -> memoryview:
        old = held.buf
        if old is not None and old.nbytes >= nbytes:
            return old
        grown = max(nbytes, min(2 * old.nbytes, SCRATCH_KEEP_BYTES)) if old is not None else nbytes
        buf = self._alloc(align_up(max(grown, 1)))  # registered whole, as a real client wants
        got = self._register(buf)  # first: if it raises, the thread keeps its old buffer, still registered
        if isinstance(got, Reply) and not got.ok:
            raise OSError(f"mooncake could not register a {buf.nbytes} B scratch buffer: code {got.code}")
        with self._lock:
            held.buf = buf
            dead = self._take(lambda t, h: not t.is_alive() and not h.busy)
        for gone in [old, *dead] if old is not None else dead:
            self._release(gone)
        return buf

    def _end(self, held: _Held) -> None:
        with self._lock:
            held.busy, buf = False, held.buf
            self._idle.notify_all()
            if buf is None or (buf.nbytes <= SCRATCH_KEEP_BYTES and not self._closed):
                return
            held.buf = None
        self._release(buf)

    def _release(self, buf: memoryview) -> None:
        """Unregister `buf` (dropped after); a failure is logged once, never raised."""
        try:
            got = self._unregister(buf)
        except Exception as e:
            got = e
        if isinstance(got, Exception) or (isinstance(got, Reply) and not got.ok):
            if not self._release_failed:
                logger.warning("sgl_hicache: Mooncake could not unregister a %d B scratch buffer: %s",
                               buf.nbytes, got)  # fmt: skip
            self._release_failed = True

    def spoil(self) -> None:
        """In a use: the calling thread's buffer may still be written by a transfer the store gave
        up on (`late_writes`). It is never used again nor unregistered (the memory stays mapped and
        registered until this object is gone); the thread's next use makes a new one."""
        with self._lock:
            held = self._held.get(threading.current_thread())
            if held is None or held.buf is None:
                return
            self._spoiled.append(held.buf)
            held.buf = None
            first, self._spoil_logged = not self._spoil_logged, True
        if first:
            logger.warning("sgl_hicache: a Mooncake transfer failed and may still write its buffer: %d B of "
                           "scratch set aside for good (logged once; at most %d B are, then the tier's loads "
                           "and stores fail)", self._spoiled[-1].nbytes, SCRATCH_SPOIL_LIMIT)  # fmt: skip

    def spoil_if_late(self, replies: Sequence[Reply]) -> None:
        """In a use: `spoil` the calling thread's buffer if a transfer of `replies` (those that
        read into it) may still write it (`late_writes`)."""
        if late_writes(replies):
            self.spoil()

    @property
    def spoiled_bytes(self) -> int:
        """The bytes set aside for good (`spoil`), at most about `SCRATCH_SPOIL_LIMIT`."""
        return sum(b.nbytes for b in self._spoiled)

    def _take(self, which: Callable[[threading.Thread, _Held], bool]) -> list[memoryview]:
        """The buffers of the threads `which` picks, their entries dropped; holding the lock."""
        picked = [t for t, h in self._held.items() if which(t, h)]
        return [buf for t in picked if (buf := self._held.pop(t).buf) is not None]

    def close(self, wait_s: float = 5.0) -> None:
        """Refuse new uses, wait up to `wait_s` for those open to end, then unregister every buffer
        not in use (one still in use after the wait goes as its use ends)."""
        with self._lock:
            self._closed = True
            self._idle.wait_for(lambda: not any(h.busy for h in self._held.values()), wait_s)
            idle = self._take(lambda t, h: not h.busy)
        for buf in idle:
            self._release(buf)
