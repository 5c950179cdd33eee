"""The loads of one batch share their Mooncake calls (issue 40): a restore's extents read in one
batch read of their headers and one of each layer group across them, instead of a header call and a
call a group for each extent, and those calls one after another, however many I/O threads are
free (concurrent calls into the client slow each other down).

Counted at the tier's `StoreClient` (`Counted`, each call by method name) on a real master, the
I/O threads held until every load of the batch is queued. Per load nothing is shared: every byte is
exact (whole loads, page prefixes, compressed chunks, headers larger than one read's guess), and
one extent's missing or damaged object fails that load alone, as a load on its own would fail
(MISS or CORRUPT), while the others of the same calls are OK and exact. A batch whose loads need no
group order (`group_order` False: a restore that is not layer-wise) is two calls, the headers and
every group's chunks (`load_calls` "merged", the default), or one a group ("by_group").
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sgl_hicache.config import Compression, MooncakeConfig, SpillBackend, TierConfig
from sgl_hicache.tier import ROOT_KEY, Completion, ExtentKey, KVDtype, KVLayout, Namespace, Status, chain_key
from sgl_hicache.tier.format import FIXED_SIZE
from sgl_hicache.tier.groups import chunk_spans, section_of
from sgl_hicache.tier.mooncake import backend as mooncake_backend
from sgl_hicache.tier.mooncake import load as mooncake_load
from sgl_hicache.tier.mooncake import objects
from sgl_hicache.tier.mooncake import scratch as scratch_mod
from sgl_hicache.tier.mooncake.client import (
    INVALID_PARAMS,
    NO_ANSWER,
    OBJECT_NOT_FOUND,
    RPC_FAIL,
    RPC_TIMEOUT,
    Reply,
    StoreClient,
    connect,
)
from tests.mooncake_master import MooncakeMaster, skip_without_mooncake
from tests.tier.common import CHUNK

skip_without_mooncake()

LAYOUT = KVLayout(num_layers=4, num_heads=2, head_dim=64, dtype=KVDtype.BF16, page_size=4)
GROUPS = 4  # one layer a group
PAGES = 40
LAYER_PAGE = 2 * LAYOUT.num_heads * LAYOUT.head_dim * LAYOUT.dtype.itemsize * LAYOUT.page_size
SECTION = PAGES * LAYER_PAGE  # 80 KiB: two chunks of a group
EXTENTS = 8


def tokens(i: int) -> list[int]:
    return list(range(i * 10_000, i * 10_000 + PAGES * LAYOUT.page_size))


def payload(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, GROUPS * SECTION, dtype=np.uint8)


def prefix(i: int, pages: int) -> np.ndarray:
    """What a load of the first `pages` pages of extent i holds: each group's first pages."""
    return np.concatenate([payload(i)[g * SECTION : g * SECTION + pages * LAYER_PAGE] for g in range(GROUPS)])


class Counted:
    """A `StoreClient` whose every call is counted by method name; `reads`: the object names of
    each `get_many_into`, in order; `most`: the most of them that ran at once (each takes at least
    `slow_s`, so that calls that could overlap do); `answers`: object name -> the code its read
    answers (its bytes read all the same: a transfer the store gave up on that landed)."""

    def __init__(self, client: StoreClient) -> None:
        self.client, self.calls, self.reads = client, Counter[str](), list[list[str]]()
        self.slow_s, self._lock, self._now, self.most = 0.0, threading.Lock(), 0, 0
        self.answers: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.client, name)
        return self._read(method) if name == "get_many_into" else self._counted(name, method)

    def _counted(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            self.calls[name] += 1
            return method(*args)

        return call

    def _read(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(names: list[str], dests: list[memoryview]) -> Any:
            with self._lock:
                self.calls["get_many_into"] += 1
                self.reads.append(list(names))
                self._now += 1
                self.most = max(self.most, self._now)
            try:
                time.sleep(self.slow_s)
                replies = method(names, dests)
                return [
                    Reply(self.answers[n]) if n in self.answers else r
                    for n, r in zip(names, replies, strict=True)
                ]
            finally:
                with self._lock:
                    self._now -= 1

        return call

    def reset(self) -> None:
        self.calls.clear()
        self.reads.clear()
        self.most = 0

    @property
    def per_operation(self) -> Counter[str]:
        """The calls of the store, but the I/O threads' registrations of their scratch buffers (as
        they grow); not the client's own answers (`addressable`, `host_memory`: no call)."""
        ours = ("register", "unregister", "addressable", "host_memory")
        return Counter({name: n for name, n in self.calls.items() if name not in ours})


@contextmanager
def posts_counted(tier: Any) -> Iterator[Counter[int]]:
    """Every post of a completion to `tier`'s queue while in the block, by ticket, even one the
    queue drops (a ticket completed already): a load posted twice is seen although it completes
    once."""
    posted: Counter[int] = Counter()
    queue = tier._completions
    post = queue.post

    def counted_post(c: Any, *args: Any) -> bool:
        posted[c.ticket] += 1
        return bool(post(c, *args))

    queue.post = counted_post
    try:
        yield posted
    finally:
        del queue.post


@dataclass
class Batch:
    tier: Any
    client: Counted
    threads: int
    keys: list[ExtentKey] = field(default_factory=list)
    done: list[Completion] = field(default_factory=list)  # the last `load`'s completions

    def chunks(self, i: int) -> dict[int, list[str]]:
        """Extent i's chunk object names by layer group."""
        t = self.tier
        ext = objects.open_header(
            t._client, t._names, t.namespace.id, self.keys[i], None, t._seal, t._scratch
        )
        spans = chunk_spans(ext.header.sections, CHUNK)
        out: dict[int, list[str]] = {}
        for name, g in zip(ext.chunk_names(t._names), section_of(ext.header.sections, [o for o, _ in spans]),
                           strict=True):  # fmt: skip
            out.setdefault(g, []).append(name)
        return out

    def load(self, wants: list[int | None], timeout_s: float = 30,
             group_order: bool = True) -> tuple[list[Status], list[np.ndarray]]:  # fmt: skip
        """Load extents 0..n-1 as one batch (extent i's first wants[i] bytes; None: all), every
        load queued before an I/O thread takes one; their statuses and destinations (each load
        completed within `timeout_s`, once)."""
        gate = threading.Event()
        with posts_counted(self.tier) as posted:
            for _ in range(self.threads):  # ranked ahead of every load: each holds a thread
                self.tier._io.submit_read(gate.wait, ())
            dests = [np.zeros(GROUPS * SECTION, np.uint8) for _ in wants]
            tickets = [self.tier.submit_load(self.keys[0], dests[0], wants[0], group_order=group_order)]
            tickets += [self.tier.submit_load(self.keys[i], dests[i], wants[i], batch=tickets[0],
                                              group_order=group_order) for i in range(1, len(wants))]  # fmt: skip
            gate.set()
            done = self.done = [self.tier.wait(t, timeout_s) for t in tickets]
        assert not self.tier.get_finished(), "one completion a load"
        assert all(posted[t] == 1 for t in tickets), f"a load's completion posted twice: {posted}"
        for c, want in zip(done, wants, strict=True):
            if c.ok:
                assert c.nbytes == (GROUPS * SECTION if want is None else want)
        return [c.status for c in done], dests


@pytest.fixture
def batch(mooncake_master: MooncakeMaster, tmp_path: Path,
          monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Batch]]:  # fmt: skip
    """A Mooncake tier on a counted client (`io_threads`, `compression`, `load_calls` as asked),
    holding extents 0..7 in groups of one layer."""
    monkeypatch.setattr(mooncake_backend, "MANIFEST_FLUSH_S", 3600.0)  # no manifest write while counting
    made: list[mooncake_backend.MooncakeTier] = []

    def counted(cfg: MooncakeConfig) -> Any:
        return Counted(connect(cfg))

    monkeypatch.setattr(mooncake_backend, "connect", counted)

    def make(
        threads: int = 1, compression: Compression = Compression.NONE, load_calls: str = "merged"
    ) -> Batch:
        mooncake = dataclasses.replace(mooncake_master.config(), load_calls=load_calls)
        cfg = TierConfig(backend=SpillBackend.MOONCAKE, mooncake=mooncake,
                         directory=tmp_path / "tier", chunk_bytes=CHUNK, io_threads=threads,
                         compression=compression)  # fmt: skip
        tier = mooncake_backend.MooncakeTier(cfg, Namespace(f"batch-{time.monotonic_ns()}", LAYOUT))
        made.append(tier)
        b = Batch(tier, tier._client, threads)
        for i in range(EXTENTS):
            b.keys.append(chain_key(tier.namespace.id, ROOT_KEY, tokens(i)))
            done = tier.wait(
                tier.submit_store(b.keys[i], payload(i), tokens(i), ROOT_KEY, group_layers=1), 30
            )
            assert done.ok, done
        b.client.reset()
        return b

    yield make
    for tier in made:
        tier.close(10)


@pytest.mark.parametrize("threads", [1, 4])
def test_the_loads_of_a_batch_are_one_header_call_and_one_call_a_layer_group(
    batch: Callable[..., Batch], threads: int
) -> None:
    """And one call after another, however many I/O threads are free (each call is slowed down
    here, so that calls that could overlap do)."""
    b = batch(threads)
    b.client.slow_s = 0.05
    statuses, dests = b.load([None] * EXTENTS)
    assert statuses == [Status.OK] * EXTENTS
    for i, dest in enumerate(dests):
        assert np.array_equal(dest, payload(i)), f"extent {i} loaded other bytes"
    assert b.client.per_operation == Counter(get_many_into=1 + GROUPS), b.client.calls
    assert b.client.most == 1, "calls of one batch ran at once"


@pytest.mark.parametrize(("load_calls", "calls"), [("merged", 2), ("by_group", 1 + GROUPS)])
def test_a_batch_that_needs_no_group_order_is_two_calls_merged_and_one_a_group_by_group(
    batch: Callable[..., Batch], load_calls: str, calls: int
) -> None:
    """Issue 40: a restore that is not layer-wise (`group_order` False) waits for no group first:
    merged, every group's chunks of the batch's eight loads are one call after the headers'."""
    b = batch(4, load_calls=load_calls)
    b.client.slow_s = 0.05
    statuses, dests = b.load([None] * EXTENTS, group_order=False)
    assert statuses == [Status.OK] * EXTENTS
    for i, dest in enumerate(dests):
        assert np.array_equal(dest, payload(i)), f"extent {i} loaded other bytes"
    assert b.client.per_operation == Counter(get_many_into=calls), b.client.calls
    assert b.client.most == 1, "calls of one batch ran at once"


READS = {  # how a batch is read: (load_calls, group_order, its calls)
    "layer-wise": ("merged", True, 1 + GROUPS),
    "merged": ("merged", False, 2),
    "by-group": ("by_group", False, 1 + GROUPS),
}


@pytest.mark.parametrize("compression", [Compression.NONE, Compression.ZSTD])
@pytest.mark.parametrize("reads", list(READS))
def test_every_byte_of_a_batch_of_whole_loads_and_prefixes_is_exact(
    batch: Callable[..., Batch], compression: Compression, reads: str
) -> None:
    """Whole loads and page prefixes (a part of a chunk: decoded from the scratch buffer, as every
    compressed chunk is) in the same calls, read group by group or every group at once."""
    load_calls, group_order, calls = READS[reads]
    b = batch(1, compression, load_calls)
    pages = [PAGES, 1, 7, 16, 17, 39, PAGES, 3]
    wants = [None if p == PAGES else p * GROUPS * LAYER_PAGE for p in pages]
    statuses, dests = b.load(wants, group_order=group_order)
    assert statuses == [Status.OK] * EXTENTS
    for i, (p, dest) in enumerate(zip(pages, dests, strict=True)):
        n = p * GROUPS * LAYER_PAGE
        assert np.array_equal(dest[:n], prefix(i, p)), f"extent {i} ({p} pages) loaded other bytes"
        assert not dest[n:].any(), f"extent {i}: bytes written past its {p} pages"
    assert b.client.per_operation == Counter(get_many_into=calls), b.client.calls


def test_a_compressed_batch_is_cut_into_calls_whose_scratch_fits_the_keep_size(
    batch: Callable[..., Batch], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every compressed chunk passes through the scratch buffer: a merged batch's calls are cut so
    that none needs more of it than a thread keeps (`SCRATCH_KEEP_BYTES`, here 3 chunks' worth or
    3 headers), so no buffer is made, registered and dropped for one call; every byte exact."""
    b = batch(1, Compression.ZSTD, "merged")
    keep = 3 * objects.HEADER_READ_BYTES
    assert keep >= 3 * CHUNK
    for module in (scratch_mod, objects, mooncake_load):
        monkeypatch.setattr(module, "SCRATCH_KEEP_BYTES", keep)
    sizes: list[int] = []
    scratch = b.tier._scratch
    register = scratch._register
    monkeypatch.setattr(scratch, "_register", lambda buf: (sizes.append(buf.nbytes), register(buf))[1])
    statuses, dests = b.load([None] * EXTENTS, group_order=False)
    assert statuses == [Status.OK] * EXTENTS
    for i, dest in enumerate(dests):
        assert np.array_equal(dest, payload(i)), f"extent {i} loaded other bytes"
    assert sizes and max(sizes) <= keep, sizes
    assert b.client.per_operation["get_many_into"] > 2 + 2, b.client.calls  # headers in 3, chunks in more
    assert scratch.held_bytes <= keep


def test_headers_larger_than_the_guess_are_read_again_alone_and_verified(
    batch: Callable[..., Batch], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every header is larger than the buffer a batch read gives it: the store refuses each
    (INVALID_PARAMS), and each is read again at its size, on its own; every load is OK and exact."""
    b = batch(1)
    monkeypatch.setattr(objects, "HEADER_READ_BYTES", 1024)
    statuses, dests = b.load([None] * EXTENTS)
    assert statuses == [Status.OK] * EXTENTS
    for i, dest in enumerate(dests):
        assert np.array_equal(dest, payload(i))
    assert b.client.per_operation == Counter(get_many_into=1 + GROUPS, size=EXTENTS, get_into=EXTENTS)


DAMAGED = 3  # the extent whose object is removed or damaged


def damage(b: Batch, name: str, how: str, at: int) -> None:
    """Remove object `name`, or flip its byte `at`."""
    client = b.tier._client
    if how == "removed":
        assert client.remove(name).ok
    else:
        bad = bytearray(client.get(name))
        bad[at] ^= 1
        assert client.remove(name).ok and client.write(name, bytes(bad)).ok


@pytest.mark.parametrize(
    ("what", "how", "status"),
    [
        ("header", "removed", Status.MISS),
        ("header", "corrupt", Status.CORRUPT),
        ("chunk", "removed", Status.MISS),
        ("chunk", "corrupt", Status.CORRUPT),
    ],
)
@pytest.mark.parametrize("reads", ["layer-wise", "merged"])
def test_one_extents_missing_or_damaged_object_fails_its_load_alone(
    batch: Callable[..., Batch], what: str, how: str, status: Status, reads: str
) -> None:
    """Extent 3's header, or the first chunk of its group 2, is removed or has a flipped byte: its
    load is a MISS or CORRUPT as it would be alone (counted once), it reads nothing after the
    failure (merged, its groups are read in the same call), and the other seven loads of the same
    calls are OK and exact."""
    load_calls, group_order, calls = READS[reads]
    b = batch(1, load_calls=load_calls)
    chunks = b.chunks(DAMAGED)
    if what == "header":
        damage(b, b.tier._names.header(b.keys[DAMAGED]), how, FIXED_SIZE - 1)  # its MAC
    else:
        damage(b, chunks[2][0], how, 1000)
    b.client.reset()
    statuses, dests = b.load([None] * EXTENTS, group_order=group_order)
    assert statuses == [status if i == DAMAGED else Status.OK for i in range(EXTENTS)]
    for i, dest in enumerate(dests):
        if i != DAMAGED:
            assert np.array_equal(dest, payload(i)), f"extent {i} loaded other bytes"
    stats = b.tier.stats()
    assert (stats.misses, stats.checksum_failures) == ((1, 0) if status is Status.MISS else (0, 1))
    assert b.client.calls["get_many_into"] == calls, b.client.calls
    read = {name for names in b.client.reads for name in names}
    assert group_order is False or not read & set(chunks.get(3, [])), "a load that failed read on"
    if what == "header":
        assert not read & {n for names in chunks.values() for n in names}, (
            "a load without a header read chunks"
        )


GAVE_UP = -800  # TRANSFER_FAIL: Mooncake's answer when its transfer timed out, which may still land


@pytest.mark.parametrize(
    ("code", "pages", "status", "unsafe"),
    [
        (GAVE_UP, None, Status.IO_ERROR, True),
        (NO_ANSWER, None, Status.IO_ERROR, True),
        (OBJECT_NOT_FOUND, None, Status.MISS, False),
        (INVALID_PARAMS, None, Status.CORRUPT, False),
        (RPC_FAIL, None, Status.IO_ERROR, False),
        (RPC_TIMEOUT, None, Status.IO_ERROR, False),
        (GAVE_UP, 10, Status.IO_ERROR, False),
    ],
    ids=["gave-up", "no-answer", "gone", "refused", "no-master", "master-timed-out", "gave-up-into-scratch"],
)
@pytest.mark.parametrize("reads", ["layer-wise", "merged"])
def test_a_load_whose_transfer_the_store_gave_up_on_says_its_destination_may_still_be_written(
    batch: Callable[..., Batch], code: int, pages: int | None, status: Status, unsafe: bool, reads: str
) -> None:
    """The store answers a failure for the first chunk of extent 3's group 2 while its transfer may
    still run: read straight into the destination, that load (only) completes `dest_unsafe`, so
    its caller never reuses the memory. Not for an object gone, nor one refused before any transfer
    (INVALID_PARAMS: larger than its slot; RPC_FAIL: no master, an outage must not eat staging), nor a chunk read through the scratch buffer (a page
    prefix's part of it: that buffer is spoiled instead, scratch.py)."""
    load_calls, group_order, _ = READS[reads]
    b = batch(1, load_calls=load_calls)
    b.client.answers[b.chunks(DAMAGED)[2][0]] = code
    want = None if pages is None else pages * LAYER_PAGE * GROUPS
    statuses, _ = b.load([want] * EXTENTS, group_order=group_order)
    assert statuses == [status if i == DAMAGED else Status.OK for i in range(EXTENTS)]
    assert [c.dest_unsafe for c in b.done] == [unsafe and i == DAMAGED for i in range(EXTENTS)]
    assert (b.tier._scratch.spoiled_bytes > 0) == (pages is not None)


def test_a_load_a_bug_ends_after_such_an_answer_still_says_its_destination_may_be_written(
    batch: Callable[..., Batch], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whoever posts the load's end (here the guard of a bug raising as its pieces are recorded),
    its completion says `dest_unsafe`."""
    b = batch(1)
    b.client.answers[b.chunks(DAMAGED)[0][0]] = GAVE_UP
    plant_bug(b, "done", monkeypatch)
    statuses, _ = b.load([None] * EXTENTS, timeout_s=10)
    assert statuses == [Status.IO_ERROR if i == DAMAGED else Status.OK for i in range(EXTENTS)]
    assert [c.dest_unsafe for c in b.done] == [i == DAMAGED for i in range(EXTENTS)]


def plant_bug(b: Batch, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug of ours raising on an I/O thread (the store's own errors are outcomes, never raised):
    in extent 3's header's salt lookup, its pieces' reads, its recording, or the runs of group 2."""
    bad = b.keys[DAMAGED]

    kind = ValueError if where.endswith("-value") else RuntimeError
    where = where.removesuffix("-value")

    def boom(*args: Any) -> Any:
        raise kind(f"a bug in {where}")

    if where == "headers":  # a header batch answering for fewer loads than it was asked for
        opens = mooncake_load.Reader.open
        monkeypatch.setattr(mooncake_load.Reader, "open", lambda reader, wanted: opens(reader, wanted)[:-1])
        return

    if where == "salt":
        ends = b.tier._loads._ends
        salt = ends.salt
        b.tier._loads._ends = ends._replace(salt=lambda key: boom() if key == bad else salt(key))
        return
    if where == "runs":
        runs = mooncake_load._runs
        monkeypatch.setattr(mooncake_load, "_runs", lambda loads, g: boom() if g == 2 else runs(loads, g))
        return
    real = getattr(mooncake_load.MooncakeLoad, where)
    monkeypatch.setattr(mooncake_load.MooncakeLoad, where,
                        lambda load, *a: boom() if load.key == bad else real(load, *a))  # fmt: skip


@pytest.mark.parametrize(
    ("where", "oks"),
    [("salt", 0), ("read", 0), ("runs", 0), ("done", EXTENTS - 1), ("runs-value", 0), ("headers", 0)],
)
def test_a_bug_on_an_io_thread_ends_every_load_it_touched_once(
    batch: Callable[..., Batch], monkeypatch: pytest.MonkeyPatch, where: str, oks: int
) -> None:
    """A bug raising in a job that reads for the whole batch strands none of the loads it took:
    every load of the batch completes once. Raised where the batch's loads are read together (their
    headers' planning, a call's pieces, a group's runs) it fails every load of that step (IO_ERROR,
    counted once each), which then reads nothing more; raised recording one load's pieces, it fails
    that load alone, and the other seven are OK and exact. A bug that raises ValueError is still
    the loads' IO_ERROR, never taken for the request's own error (REJECTED)."""
    b = batch(1)
    plant_bug(b, where, monkeypatch)
    statuses, dests = b.load([None] * EXTENTS, timeout_s=10)
    if oks:
        assert statuses == [Status.IO_ERROR if i == DAMAGED else Status.OK for i in range(EXTENTS)]
    else:
        assert statuses == [Status.IO_ERROR] * EXTENTS
    for i, (status, dest) in enumerate(zip(statuses, dests, strict=True)):
        if status is Status.OK:
            assert np.array_equal(dest, payload(i)), f"extent {i} loaded other bytes"
    stats = b.tier.stats()
    assert (stats.loads, stats.io_errors) == (oks, EXTENTS - oks)
    read = {name for names in b.client.reads for name in names}
    failed_at = {"salt": 0, "read": 0, "runs": 2, "done": 1, "runs-value": 2, "headers": 0}[where]
    for i, status in enumerate(statuses):
        if status is not Status.OK:
            later = {n for g, names in b.chunks(i).items() if g >= failed_at for n in names}
            assert not read & later, f"extent {i} read on after it failed"


def test_the_ok_loads_of_a_call_complete_before_a_failed_one_is_classified(
    batch: Callable[..., Batch],
) -> None:
    """Extent 3's chunk of the last layer group is corrupt: its classification asks the store (is
    the header still the one it verified? then it is removed), so the seven OK loads the same call
    ended complete first, and extent 3 last (CORRUPT)."""
    b = batch(1)
    damage(b, b.chunks(DAMAGED)[GROUPS - 1][0], "corrupt", 1000)
    gate = threading.Event()
    b.tier._io.submit_read(gate.wait, ())
    dests = [np.zeros(GROUPS * SECTION, np.uint8) for _ in range(EXTENTS)]
    tickets = [b.tier.submit_load(b.keys[0], dests[0])]
    tickets += [b.tier.submit_load(b.keys[i], dests[i], batch=tickets[0]) for i in range(1, EXTENTS)]
    gate.set()
    done: list[Completion] = []
    deadline = time.monotonic() + 30
    while len(done) < EXTENTS:
        assert time.monotonic() < deadline, f"completions missing: {done}"
        b.tier.wait_posted(1)
        done += b.tier.get_finished()
    order = [tickets.index(c.ticket) for c in done]
    assert order == [i for i in range(EXTENTS) if i != DAMAGED] + [DAMAGED], done
    assert [c.status for c in done] == [Status.OK] * (EXTENTS - 1) + [Status.CORRUPT]


BATCHES = 6


def test_loads_joining_running_batches_on_four_threads_each_complete_once_and_exact(
    batch: Callable[..., Batch],
) -> None:
    """Six batches at once on four I/O threads (each call slowed down a little), each of eight loads
    of whole extents and page prefixes, read in group order, without (merged) or both mixed: the
    first half submitted, the second once the batch's first load has its header read (its jobs are
    running), joining it. Every load completes once (its completion posted once, counted even if
    the queue would drop a second post), OK, with exactly its bytes; some loads did join a batch
    whose jobs were running."""
    b = batch(4)
    b.client.slow_s = 0.005
    tier = b.tier
    pages = [[PAGES, 1 + k, PAGES, 7 * k % PAGES + 1, PAGES, 3 + k, 20 + k, PAGES] for k in range(BATCHES)]
    dests = [[np.zeros(GROUPS * SECTION, np.uint8) for _ in range(EXTENTS)] for _ in range(BATCHES)]
    tickets: list[list[Any]] = [[] for _ in range(BATCHES)]
    joined_running = [0] * BATCHES

    def submit(k: int) -> None:
        def one(i: int, of: Any) -> Any:
            want = None if pages[k][i] == PAGES else pages[k][i] * GROUPS * LAYER_PAGE
            in_order = (k % 3 == 0) or (k % 3 == 2 and i % 2 == 0)
            return tier.submit_load(b.keys[i], dests[k][i], want, batch=of, group_order=in_order)

        tickets[k].append(one(0, None))
        tickets[k] += [one(i, tickets[k][0]) for i in range(1, EXTENTS // 2)]
        deadline = time.monotonic() + 30
        while tickets[k][0] not in tier._returned.loading:  # planned: its header was read
            assert time.monotonic() < deadline
            time.sleep(0.0005)
        for i in range(EXTENTS // 2, EXTENTS):
            with tier._lock:
                joined_running[k] += int(tickets[k][0]) in tier._loads._batches
            tickets[k].append(one(i, tickets[k][0]))

    submitters = [threading.Thread(target=submit, args=(k,)) for k in range(BATCHES)]
    done: list[Completion] = []
    with posts_counted(tier) as posted:
        for t in submitters:
            t.start()
        for t in submitters:
            t.join(60)
        deadline = time.monotonic() + 60
        while len(done) < BATCHES * EXTENTS:
            assert time.monotonic() < deadline, f"{BATCHES * EXTENTS - len(done)} loads never completed"
            tier.wait_posted(1)
            done += tier.get_finished()
        time.sleep(0.2)
    done += tier.get_finished()
    by_ticket = {c.ticket: c for c in done}
    assert len(done) == len(by_ticket) == BATCHES * EXTENTS, "one completion a load"
    once = Counter(t for ts in tickets for t in ts)
    assert posted == once, f"posted more than once: {posted - once}, never posted: {once - posted}"
    for k in range(BATCHES):
        for i, ticket in enumerate(tickets[k]):
            n = pages[k][i] * GROUPS * LAYER_PAGE
            assert (by_ticket[ticket].status, by_ticket[ticket].nbytes) == (Status.OK, n), by_ticket[ticket]
            assert np.array_equal(dests[k][i][:n], prefix(i, pages[k][i])), (
                f"batch {k} extent {i}: other bytes"
            )
    assert sum(joined_running) > 0, "no load joined a running batch"
    stats = tier.stats()
    assert (stats.loads, stats.io_errors) == (BATCHES * EXTENTS, 0)
