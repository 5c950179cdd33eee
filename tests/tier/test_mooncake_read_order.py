"""The order the Mooncake tier reads chunks in (`Tier.submit_load`'s `batch`, issue 37), as the file
tier's (test_read_order.py): the loads of one batch layer group by layer group, every load's group
g before any load's group g + 1; loads of different batches, and loads without one, one after
another in the order they were submitted; a lookup after the loads submitted before it. The loads
of a batch share their calls (issue 40): one batch read of their headers, then one of each layer
group across them (or, one chunk a call, the same objects in the same order); loads that need no
group order, every group of them in one call after the headers. `landed` grows as
the verified prefix of each destination while the groups of a batch land; a corrupt chunk in a
late group fails its load (CORRUPT, its one completion), nothing of that group counts for it, and
the other loads of the call are OK and exact.

A real master; one I/O thread, held by a job queued ahead of the loads until every load is queued:
the order is then the queue's, not the threads' timing. Each batch read (`get_many_into`) is
recorded with the (extent, layer group) of the objects it reads, HEADERS for a header."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sgl_hicache.config import SpillBackend, TierConfig
from sgl_hicache.tier import ROOT_KEY, ExtentKey, Namespace, Status, Ticket, chain_key, open_tier
from sgl_hicache.tier.groups import chunk_spans, section_of
from sgl_hicache.tier.mooncake import backend as mooncake_backend
from sgl_hicache.tier.mooncake import objects
from sgl_hicache.tier.results import Completion, LookupRequest
from tests.mooncake_master import MooncakeMaster, skip_without_mooncake
from tests.tier.common import CHUNK, NS

skip_without_mooncake()

PAGES, LAYER_PAGE = 100, 2048  # a layer group's section: 200 KiB, four chunks of at most 64 KiB
SECTION = PAGES * LAYER_PAGE
EXTENTS = 4
HEADERS = -1  # the "layer group" of a header object
EVERY = -2  # every layer group of an extent, in order (a load read without group order)
GROUP_CHUNKS = [n for _, n in chunk_spans([SECTION], CHUNK)]  # a group's chunk objects' bytes


def tokens(i: int) -> list[int]:
    return list(range(i * 1000, i * 1000 + PAGES * NS.layout.page_size))


def payload(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(
        0, 256, PAGES * NS.layout.num_layers * LAYER_PAGE, dtype=np.uint8
    )


@dataclass(frozen=True)
class Read:
    """One batch read: the (extent, group) pairs it read (in order, once each), the chunk bytes it
    read of each extent, and when it began the `landed` of every load so far, and whether each
    destination held exactly the payload up to it."""

    parts: tuple[tuple[int, int], ...]
    chunk_bytes: dict[int, int]
    landed: tuple[int, ...]
    exact: bool


@dataclass
class Recorded:
    tier: Any
    ns: Namespace
    gate: threading.Event
    objects: dict[str, tuple[int, int]]  # header or chunk object name -> (extent, group)
    reads: list[Read | str] = field(default_factory=list)
    tickets: list[Ticket] = field(default_factory=list)
    dests: list[np.ndarray] = field(default_factory=list)

    def key(self, i: int) -> ExtentKey:
        return chain_key(self.ns.id, ROOT_KEY, tokens(i))

    def batch_reads(self) -> list[Read]:
        return [r for r in self.reads if isinstance(r, Read)]


@pytest.fixture(
    params=[(None, None), (CHUNK, None), (CHUNK, CHUNK // 2)],
    ids=["one-call-a-group", "one-call-a-chunk", "two-headers-a-call"],
)
def recorded(request: pytest.FixtureRequest, mooncake_master: MooncakeMaster, tmp_path: Path,
             monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorded]:  # fmt: skip
    """A Mooncake tier of one I/O thread holding extents 0..3 (one layer a group: two groups of four
    chunks each), whose batch reads of chunks are recorded and held until `gate` is set; `param`:
    the bytes of one batch read and of a header's guess (None: as shipped, a whole group of every
    load of a batch a call, every header of a batch in one)."""
    batch_bytes, header_bytes = request.param
    if batch_bytes is not None:
        monkeypatch.setattr(objects, "LOAD_BATCH_BYTES", batch_bytes)
    if header_bytes is not None:
        monkeypatch.setattr(objects, "HEADER_READ_BYTES", header_bytes)
    cfg = TierConfig(backend=SpillBackend.MOONCAKE, mooncake=mooncake_master.config(),
                     directory=tmp_path / "tier", chunk_bytes=CHUNK, io_threads=1)  # fmt: skip
    tier: Any = open_tier(cfg, Namespace(f"order-{time.monotonic_ns()}", NS.layout))
    rec = Recorded(tier, tier.namespace, threading.Event(), {})
    try:
        for i in range(EXTENTS):
            done = tier.wait(
                tier.submit_store(rec.key(i), payload(i), tokens(i), ROOT_KEY, group_layers=1), 30
            )
            assert done.ok, done
            ext = objects.open_header(tier._client, tier._names, rec.ns.id, rec.key(i), None, tier._seal,
                                      tier._scratch)  # fmt: skip
            spans = chunk_spans(ext.header.sections, CHUNK)
            groups = section_of(ext.header.sections, [offset for offset, _ in spans])
            assert groups == [0] * 4 + [1] * 4
            rec.objects.update(
                (name, (i, g)) for name, g in zip(ext.chunk_names(tier._names), groups, strict=True)
            )
            rec.objects[tier._names.header(rec.key(i))] = (i, HEADERS)
        _record(rec, monkeypatch)
        yield rec
    finally:
        rec.gate.set()
        tier.close(10)


def _record(rec: Recorded, monkeypatch: pytest.MonkeyPatch) -> None:
    client, real = rec.tier._client, rec.tier._client.get_many_into

    def get_many_into(names: list[str], dests: list[memoryview]) -> Any:
        landed = tuple(rec.tier.landed(t) for t in rec.tickets)
        exact = all(
            np.array_equal(d[:n], payload(i)[:n])
            for i, (d, n) in enumerate(zip(rec.dests, landed, strict=True))
        )
        seen = [rec.objects[n] for n in names]
        nbytes = Counter[int]()
        for (i, group), d in zip(seen, dests, strict=True):
            nbytes[i] += d.nbytes if group != HEADERS else 0
        rec.reads.append(Read(tuple(dict.fromkeys(seen)), dict(nbytes), landed, exact))
        return real(names, dests)

    monkeypatch.setattr(client, "get_many_into", get_many_into)
    real_lookup = mooncake_backend.run_lookup_in

    def run_lookup_in(*args: Any) -> Any:
        rec.reads.append("lookup")
        return real_lookup(*args)

    monkeypatch.setattr(mooncake_backend, "run_lookup_in", run_lookup_in)


def hold(rec: Recorded) -> None:
    """Hold the tier's one I/O thread (a job ranked ahead of every load) until `rec.gate` is set."""
    rec.tier._io.submit_read(lambda: rec.gate.wait(30), ())


def submit(rec: Recorded, batches: list[int | None], group_order: bool = True) -> None:
    """Load extents 0..n-1, extent i with the ticket of extent batches[i]'s load as its batch (None:
    no batch), then release the thread."""
    hold(rec)
    for i, of in enumerate(batches):
        rec.dests.append(np.zeros(payload(i).nbytes, np.uint8))
        extra = {} if of is None else {"batch": rec.tickets[of]}
        rec.tickets.append(rec.tier.submit_load(rec.key(i), rec.dests[i], group_order=group_order, **extra))
    rec.gate.set()


def settled(rec: Recorded, oks: int, failures: int = 0) -> None:
    """Wait until every load is done (`oks` OK, `failures` CORRUPT), none returned yet: every read
    is recorded and each load's `landed` still holds."""
    deadline = time.monotonic() + 30
    while (s := rec.tier.stats()).loads < oks or s.checksum_failures < failures:
        assert time.monotonic() < deadline, "the loads did not finish within 30 s"
        time.sleep(0.005)


def finished(rec: Recorded, oks: int, failures: int = 0) -> dict[Ticket, Completion]:
    """Once every load is done, each load's one completion."""
    settled(rec, oks, failures)
    done: list[Completion] = []
    deadline = time.monotonic() + 30
    while len({c.ticket for c in done}) < len(rec.tickets):
        assert time.monotonic() < deadline, f"completions missing: {done}"
        done += rec.tier.get_finished()
        time.sleep(0.005)
    time.sleep(0.1)
    done += rec.tier.get_finished()
    counts = Counter(c.ticket for c in done)
    assert set(counts) == set(rec.tickets) and set(counts.values()) == {1}, f"one completion a load: {done}"
    return {c.ticket: c for c in done}


Call = tuple[tuple[int, int], ...]


def order(rec: Recorded) -> list[Call | str]:
    """The (extent, group) pairs of each recorded read, a call at a time."""
    return [r.parts if isinstance(r, Read) else r for r in rec.reads]


def calls(steps: list[tuple[list[int], int]]) -> list[Call | str]:
    """The reads of `steps`, each (extents, group): those extents' header objects (HEADERS) or
    chunks of that group (EVERY: of each group, extent by extent), in batch reads as the tier packs
    them: up to `LOAD_BATCH_BYTES` a call (at least one object), a header counting
    `HEADER_READ_BYTES`, a chunk its length."""
    out: list[Call | str] = []
    for extents, group in steps:
        groups = (0, 1) if group == EVERY else (group,)
        sizes = [objects.HEADER_READ_BYTES] if group == HEADERS else GROUP_CHUNKS
        call: list[tuple[int, int]] = []
        nbytes = 0
        for i, g, n in ((i, g, n) for i in extents for g in groups for n in sizes):
            if call and nbytes + n > objects.LOAD_BATCH_BYTES:
                out.append(tuple(dict.fromkeys(call)))
                call, nbytes = [], 0
            call.append((i, g))
            nbytes += n
        out.append(tuple(dict.fromkeys(call)))
    return out


def one_by_one(extents: list[int]) -> list[tuple[list[int], int]]:
    """The steps of loads of no batch: each extent's header and groups, one extent after another."""
    return [([i], group) for i in extents for group in (HEADERS, 0, 1)]


def test_the_loads_of_a_batch_are_read_group_by_group_and_a_later_load_after_them(recorded: Recorded) -> None:
    rec = recorded
    submit(rec, [None, 0, 0, None])  # extents 0-2: one restore; extent 3: another load
    done = finished(rec, EXTENTS)
    steps = [([0, 1, 2], HEADERS), ([0, 1, 2], 0), ([0, 1, 2], 1), *one_by_one([3])]
    assert order(rec) == calls(steps), rec.reads
    for i, ticket in enumerate(rec.tickets):
        assert (done[ticket].status, done[ticket].nbytes) == (Status.OK, payload(i).nbytes)
        assert np.array_equal(rec.dests[i], payload(i))


def test_a_batch_without_group_order_reads_every_group_of_its_loads_at_once(recorded: Recorded) -> None:
    """Issue 40: loads that need no group order (a restore that is not layer-wise; the Mooncake
    config's `load_calls` merged, the default) are read, after their headers, every group at once:
    one call for the batch (or, a chunk a call, extent by extent), and a later load after them.
    Every landed prefix held exactly the payload."""
    rec = recorded
    submit(rec, [None, 0, 0, None], group_order=False)
    done = finished(rec, EXTENTS)
    steps = [([0, 1, 2], HEADERS), ([0, 1, 2], EVERY), ([3], HEADERS), ([3], EVERY)]
    assert order(rec) == calls(steps), rec.reads
    assert all(r.exact for r in rec.batch_reads())
    for i, ticket in enumerate(rec.tickets):
        assert (done[ticket].status, done[ticket].nbytes) == (Status.OK, payload(i).nbytes)
        assert np.array_equal(rec.dests[i], payload(i))


def test_landed_grows_as_the_verified_prefix_of_each_load_of_a_batch(recorded: Recorded) -> None:
    """At every read, each load's `landed` is exactly the bytes its earlier reads delivered (every
    one verified: a prefix of the destination, holding the payload); group 0 of the whole batch
    lands before any group 1 is read."""
    rec = recorded
    submit(rec, [None, 0, 0])
    settled(rec, 3)
    assert [rec.tier.landed(t) for t in rec.tickets] == [2 * SECTION] * 3, "whole until returned"
    finished(rec, 3)
    reads = rec.batch_reads()
    for k, r in enumerate(reads):
        assert r.exact, f"a landed prefix held other bytes than the payload at read {k}"
        for i in range(3):
            assert r.landed[i] == sum(p.chunk_bytes.get(i, 0) for p in reads[:k]), (k, r)
    first_group_1 = next(r for r in reads if r.parts[0][1] == 1)
    assert first_group_1.landed == (SECTION,) * 3
    assert [rec.tier.landed(t) for t in rec.tickets] == [0] * 3, "nothing once returned"


def test_loads_without_a_batch_are_read_one_after_another(recorded: Recorded) -> None:
    rec = recorded
    submit(rec, [None, None, None])
    finished(rec, 3)
    assert order(rec) == calls(one_by_one([0, 1, 2])), rec.reads
    for i in range(3):
        assert np.array_equal(rec.dests[i], payload(i))


def test_a_lookup_runs_after_the_loads_before_it_and_before_the_loads_after_it(recorded: Recorded) -> None:
    rec = recorded
    hold(rec)
    for i in range(2):
        rec.dests.append(np.zeros(payload(i).nbytes, np.uint8))
    rec.tickets.append(rec.tier.submit_load(rec.key(0), rec.dests[0]))
    rec.tier.submit_lookup(LookupRequest(np.asarray(tokens(2), np.uint32), 0))
    rec.tickets.append(rec.tier.submit_load(rec.key(1), rec.dests[1]))
    rec.gate.set()
    finished(rec, 2)
    assert order(rec) == [*calls(one_by_one([0])), "lookup", *calls(one_by_one([1]))], rec.reads


def test_a_corrupt_chunk_in_a_late_group_fails_its_load_and_only_it(recorded: Recorded) -> None:
    """Extent 1's group-1 chunk fails its checksum: its load completes CORRUPT (its one completion,
    never OK), `landed` of it never passes its group 0, and the other loads of the batch, read in
    the same calls, are OK and exact."""
    rec = recorded
    client = rec.tier._client
    name = next(n for n, pair in rec.objects.items() if pair == (1, 1))
    bad = bytearray(client.get(name))
    bad[10] ^= 1
    assert client.remove(name).ok and client.write(name, bytes(bad)).ok
    submit(rec, [None, 0, 0])
    done = finished(rec, 2, failures=1)
    expected = calls([([0, 1, 2], HEADERS), ([0, 1, 2], 0), ([0, 1, 2], 1)])
    if SECTION * 3 > objects.LOAD_BATCH_BYTES:  # a chunk a call: extent 1 reads none after its bad one
        first = expected.index(((1, 1),))
        expected = [c for k, c in enumerate(expected) if c != ((1, 1),) or k == first]
    assert order(rec) == expected, rec.reads
    assert [done[t].status for t in rec.tickets] == [Status.OK, Status.CORRUPT, Status.OK]
    assert rec.tier.stats().checksum_failures == 1
    for r in rec.batch_reads():
        assert r.exact and r.landed[1] <= SECTION, r
    for i in (0, 2):
        assert np.array_equal(rec.dests[i], payload(i))
    assert np.array_equal(rec.dests[1][:SECTION], payload(1)[:SECTION])
