"""FaultyTier: wraps any Tier and injects latency, failures and corruption, deterministically.

For other components' tests (the cache, prefetch): every submit draws from one `random.Random(seed)`
in submission order, so a test that submits the same sequence sees the same faults.

- latency: a completion is not returned before `latency_s` (+ uniform jitter) after its submit (its `at`: then);
  meanwhile `landed` reveals the load's verified bytes at a steady rate over that time (a slow disk
  reading chunk after chunk), never more than the wrapped tier has verified.
- fail_rate: the operation is not passed on; it completes IO_ERROR.
- corrupt_rate (loads): the load runs, then the destination is scribbled over, the extent is
  discarded and the completion says CORRUPT, exactly what the real tier does on a bad checksum.
- silent_corrupt_rate (loads; tests only): the load runs and completes OK, but the destination's
  bytes are flipped after the wrapped tier verified them: a tier serving wrong bytes undetected,
  the one failure the cache cannot catch. Server differential tests use it to show they detect
  wrong KV. Such a load, like a corrupted one, never shows verified bytes through `landed`. Drawn
  only when the rate is above 0, so existing seeds keep their fault sequences.
- late_fault_rate (loads): the load shows only its first `late_fault_share` of bytes verified through
  `landed` (its first layer groups, in a grouped layout), then fails as `late_fault_status` says:
  "corrupt" (CORRUPT, the extent discarded, as a chunk failing its checksum), "miss" (MISS, the
  extent gone), "io_error" (IO_ERROR), or "stall" (its completion held `late_stall_s` longer: a read
  that outlasts the caller's timeout). A fault after the caller started using the verified part:
  what a layer-wise restore must survive. Drawn only when the rate is above 0.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from sgl_hicache.tier.base import IndexedTier
from sgl_hicache.tier.directio import as_view
from sgl_hicache.tier.keys import ExtentKey, Namespace
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

POLL_S = 0.001


@dataclass(frozen=True)
class FaultSpec:
    seed: int = 0
    latency_s: float = 0.0
    jitter_s: float = 0.0
    fail_rate: float = 0.0
    corrupt_rate: float = 0.0
    silent_corrupt_rate: float = 0.0
    late_fault_rate: float = 0.0
    late_fault_share: float = 0.5
    late_fault_status: str = "corrupt"
    late_stall_s: float = 60.0

    def __post_init__(self) -> None:
        if self.late_fault_status not in LATE_FAULTS:
            raise ValueError(
                f"late_fault_status must be one of {sorted(LATE_FAULTS)}, got {self.late_fault_status!r}"
            )
        for name in (
            "fail_rate",
            "corrupt_rate",
            "silent_corrupt_rate",
            "late_fault_rate",
            "late_fault_share",
        ):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.latency_s < 0 or self.jitter_s < 0:
            raise ValueError("latency and jitter must be >= 0")


LATE_FAULTS = {"corrupt": Status.CORRUPT, "miss": Status.MISS, "io_error": Status.IO_ERROR, "stall": None}


@dataclass(frozen=True)
class _Plan:
    ticket: Ticket
    release_at: float
    corrupt_into: memoryview | None = None
    silent: bool = False  # corrupt_into is flipped but the completion stays OK
    late: memoryview | None = None  # a late fault (`late_fault_*`): the destination, past its share


def flip_silently(dest: memoryview, nbytes: int) -> None:
    """XOR 0x55 into every even byte of `dest[:nbytes]`: for little-endian bf16, fp16 and fp32 values
    that flips mantissa bits only (never the exponent, so no value becomes inf or NaN), perturbing
    every value of the payload."""
    view = np.frombuffer(dest, dtype=np.uint8, count=nbytes)
    view[0::2] ^= 0x55


@dataclass
class _Progress:
    """A load's progress as `landed` reports it: the wrapped tier's verified bytes, paced."""

    inner: Ticket
    start: float
    release_at: float
    total: int
    verified: int = 0  # the most the wrapped tier reported (all of it once it completed OK)
    cap: int | None = None  # a late fault: never more than this is shown

    def paced(self, now: float) -> int:
        span = self.release_at - self.start
        share = 1.0 if span <= 0 else min(1.0, (now - self.start) / span)
        shown = min(self.verified, int(self.total * share))
        return shown if self.cap is None else min(shown, self.cap)


class FaultyTier(IndexedTier):
    def __init__(self, inner: IndexedTier, spec: FaultSpec) -> None:
        self._inner, self._spec = inner, spec
        self._rng = random.Random(spec.seed)
        self._lock = threading.Lock()
        self._tickets = itertools.count(1)
        self._plans: dict[Ticket, _Plan] = {}  # inner ticket -> plan
        self._held: list[tuple[float, Completion]] = []  # (release time, outer completion)
        self._ready: dict[Ticket, Completion] = {}
        self._issued: set[Ticket] = set()
        self._progress: dict[Ticket, _Progress] = {}  # outer load ticket -> its progress
        self.injected = {"failures": 0, "corruptions": 0, "silent_corruptions": 0, "late_faults": 0}

    @property
    def namespace(self) -> Namespace:
        return self._inner.namespace

    @property
    def shared(self) -> bool:
        return self._inner.shared

    @property
    def batches_loads(self) -> bool:  # type: ignore[override]
        return self._inner.batches_loads

    def _draw(self) -> tuple[Ticket, float, bool, bool, bool]:
        with self._lock:
            ticket = Ticket(next(self._tickets))
            self._issued.add(ticket)
            delay = self._spec.latency_s + self._rng.uniform(0, self._spec.jitter_s)
            fail = self._rng.random() < self._spec.fail_rate
            corrupt = self._rng.random() < self._spec.corrupt_rate
            rate = self._spec.silent_corrupt_rate
            silent = rate > 0 and self._rng.random() < rate
            return ticket, time.monotonic() + delay, fail, corrupt, silent and not corrupt

    def _draw_late(self) -> bool:
        rate = self._spec.late_fault_rate
        with self._lock:
            return rate > 0 and self._rng.random() < rate

    def _inject_failure(self, ticket: Ticket, op: Op, key: ExtentKey, release_at: float) -> Ticket:
        with self._lock:
            self.injected["failures"] += 1
            self._held.append(
                (release_at, Completion(ticket, op, key, Status.IO_ERROR, 0, "injected failure"))
            )
        return ticket

    def submit_store(
        self, key: ExtentKey, payload: Buffer, tokens: Sequence[int] | np.ndarray, parent: ExtentKey,
        *, store_tokens: bool = True, aliases: Sequence[tuple[int, bytes]] = (), cache_salt: str | None = None,
        group_layers: int = 0,
    ) -> Ticket:  # fmt: skip
        ticket, release_at, fail, _, _ = self._draw()
        if fail:
            return self._inject_failure(ticket, Op.STORE, key, release_at)
        with self._lock:  # held so that _pump cannot see the inner completion before its plan
            inner = self._inner.submit_store(key, payload, tokens, parent, store_tokens=store_tokens,
                                             aliases=aliases, cache_salt=cache_salt,
                                             group_layers=group_layers)  # fmt: skip
            self._plans[inner] = _Plan(ticket, release_at)
        return ticket

    def submit_load(self, key: ExtentKey, dest: Buffer, nbytes: int | None = None,
                    group_layers: int | None = None, batch: Ticket | None = None,
                    group_order: bool = True) -> Ticket:  # fmt: skip
        ticket, release_at, fail, corrupt, silent = self._draw()
        if fail:
            return self._inject_failure(ticket, Op.LOAD, key, release_at)
        late = self._draw_late() and not (corrupt or silent)
        view = as_view(dest, writable=True)
        with self._lock:
            inner = self._inner.submit_load(
                key, view, nbytes, group_layers, self._inner_ticket(batch), group_order
            )
            self._plans[inner] = _Plan(ticket, release_at, view if corrupt or silent else None, silent,
                                       view if late else None)  # fmt: skip
            if not (corrupt or silent):  # a load bound to be corrupted never shows verified bytes
                total = view.nbytes if nbytes is None else nbytes
                cap = int(total * self._spec.late_fault_share) if late else None
                self._progress[ticket] = _Progress(inner, time.monotonic(), release_at, total, cap=cap)
        return ticket

    def _inner_ticket(self, batch: Ticket | None) -> Ticket | None:
        """The wrapped tier's ticket of load `batch` while it runs there (None: it is not). Locked."""
        if batch is None:
            return None
        return next((inner for inner, plan in self._plans.items() if plan.ticket == batch), None)

    def landed(self, ticket: Ticket) -> int:
        with self._lock:
            progress = self._progress.get(ticket)
        if progress is None:
            return 0
        self._observe([progress])
        with self._lock:
            return progress.paced(time.monotonic())

    def _observe(self, loads: list[_Progress]) -> None:
        """Record what the wrapped tier has verified of these loads (before their completions are
        drained: after that it reports 0, and a failed load's verified prefix would be lost)."""
        seen = [(p, self._inner.landed(p.inner)) for p in loads]
        with self._lock:
            for progress, n in seen:
                progress.verified = max(progress.verified, n)

    def _pump(self) -> None:
        with self._lock:
            loads = list(self._progress.values())
        self._observe(loads)
        for c in self._inner.get_finished():
            with self._lock:
                plan = self._plans.pop(c.ticket)
            out = replace(c, ticket=plan.ticket)
            release_at = plan.release_at
            if plan.corrupt_into is not None and c.ok:
                out = self._corrupt(out, plan.corrupt_into, plan.silent)
            elif plan.late is not None and c.ok:
                out, release_at = self._late(out, plan.late, release_at)
            with self._lock:
                self._held.append((release_at, out))
                if out.ok and plan.ticket in self._progress:
                    self._progress[plan.ticket].verified = c.nbytes
        now = time.monotonic()
        with self._lock:
            due = [replace(c, at=max(c.at, t)) for t, c in self._held if t <= now]  # done when released
            self._held = [(t, c) for t, c in self._held if t > now]
            self._ready.update((c.ticket, c) for c in due)

    def _corrupt(self, c: Completion, dest: memoryview, silent: bool) -> Completion:
        if silent:
            flip_silently(dest, c.nbytes)
            with self._lock:
                self.injected["silent_corruptions"] += 1
            return c
        if c.nbytes:
            dest[: min(c.nbytes, 64)] = bytes(b ^ 0xFF for b in dest[: min(c.nbytes, 64)])
        self._inner.discard(c.key)
        with self._lock:
            self.injected["corruptions"] += 1
        return replace(c, status=Status.CORRUPT, nbytes=0, detail="injected corruption")

    def _late(self, c: Completion, dest: memoryview, release_at: float) -> tuple[Completion, float]:
        """A late fault: after its share of bytes, the load fails (or stalls)."""
        with self._lock:
            self.injected["late_faults"] += 1
        status = LATE_FAULTS[self._spec.late_fault_status]
        if status is None:  # a stall: the same completion, much later
            return c, release_at + self._spec.late_stall_s
        shown = int(c.nbytes * self._spec.late_fault_share)
        if c.nbytes > shown:  # the bytes past the verified share are undefined, as after a bad chunk
            dest[shown : c.nbytes] = bytes(c.nbytes - shown)
        if status in (Status.CORRUPT, Status.MISS):
            self._inner.discard(c.key)
        return replace(
            c, status=status, nbytes=0, detail=f"injected late {self._spec.late_fault_status}"
        ), release_at

    def get_finished(self) -> list[Completion]:
        self._pump()
        with self._lock:
            done, self._ready = list(self._ready.values()), {}
            self._issued.difference_update(c.ticket for c in done)
            for c in done:
                self._progress.pop(c.ticket, None)
        return done

    def wait(self, ticket: Ticket, timeout: float | None = None) -> Completion:
        with self._lock:
            if ticket not in self._issued:
                raise KeyError(f"unknown or already returned ticket {ticket}")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._pump()
            with self._lock:
                if ticket in self._ready:
                    self._issued.discard(ticket)
                    self._progress.pop(ticket, None)
                    return self._ready.pop(ticket)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"ticket {ticket} still in flight after {timeout} s")
            time.sleep(POLL_S)

    def wait_posted(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            self._pump()
            with self._lock:
                if self._ready:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)

    def submit_lookup(self, request: LookupRequest) -> None:
        self._inner.submit_lookup(request)  # no faults injected: a lookup only names ranges to read

    def lookups_finished(self) -> list[LookupResult]:
        return self._inner.lookups_finished()

    def contains(self, key: ExtentKey) -> bool:
        return self._inner.contains(key)

    def touch(self, key: ExtentKey) -> None:
        self._inner.touch(key)

    def take_evicted(self) -> list[ExtentKey]:
        return self._inner.take_evicted()

    def lookup(self, key: ExtentKey) -> ExtentInfo | None:
        return self._inner.lookup(key)

    def extents(self) -> list[ExtentInfo]:
        return self._inner.extents()

    def read_tokens(self, key: ExtentKey) -> np.ndarray | None:
        return self._inner.read_tokens(key)

    def discard(self, key: ExtentKey) -> bool:
        return self._inner.discard(key)

    def stats(self) -> TierStats:
        return self._inner.stats()

    def check_integrity(self) -> None:
        self._inner.check_integrity()

    def host_memory(self, nbytes: int) -> memoryview:
        return self._inner.host_memory(nbytes)

    def register_host_memory(self, buf: memoryview) -> None:
        self._inner.register_host_memory(buf)

    def retain(self, keys: Sequence[ExtentKey], until: float) -> None:
        self._inner.retain(keys, until)

    def submit_remove(self, keys: Sequence[ExtentKey]) -> Ticket:
        return self._passed_on(lambda: self._inner.submit_remove(keys))

    def submit_purge(self, cache_salt: str) -> Ticket:
        return self._passed_on(lambda: self._inner.submit_purge(cache_salt))

    def _passed_on(self, submit: Callable[[], Ticket]) -> Ticket:
        """A retention job, passed on without faults (it removes; a failure would only keep data)."""
        with self._lock:
            ticket = Ticket(next(self._tickets))
            self._issued.add(ticket)
            self._plans[submit()] = _Plan(ticket, time.monotonic())
        return ticket

    def close(self, timeout_s: float | None = None) -> None:
        self._inner.close(timeout_s)
