"""The order the file tier reads chunks in (`Tier.submit_load`'s `batch`): the loads of one batch (a
restore's extents) layer group by layer group, every load's group g before any load's group g + 1,
so that group 0 of the whole restore lands first; loads of different batches, and loads without
one, one after another in the order they were submitted (the prefix of a restore first); a lookup
after the loads submitted before it and before those submitted after it.

One I/O thread, held at the first chunk read until every load is queued: the order is then the
queue's, not the threads' timing."""

from __future__ import annotations

import bisect
import itertools
import threading
from typing import Any

import numpy as np
import pytest

from sgl_hicache.tier import ROOT_KEY, Status, Ticket, chain_key
from tests.tier.common import CHUNK, NS

PAGES, LAYER_PAGE = 100, 2048  # a layer group's section: 200 KiB, four chunks of at most 64 KiB


def tokens(i: int) -> list[int]:
    return list(range(i * 1000, i * 1000 + PAGES * NS.layout.page_size))


def payload(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(
        0, 256, PAGES * NS.layout.num_layers * LAYER_PAGE, dtype=np.uint8
    )


@pytest.fixture
def recorded(make_tier: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A file tier of one I/O thread holding extents 0..3 (one layer a group: two groups of four
    chunks each), whose chunk reads are recorded as (extent, group) and held until `release`."""
    from sgl_hicache.tier.file import backend

    tier = make_tier(io_threads=1)
    for i in range(4):
        key = chain_key(NS.id, ROOT_KEY, tokens(i))
        assert tier.wait(tier.submit_store(key, payload(i), tokens(i), ROOT_KEY, group_layers=1), 30).ok
    assert CHUNK < PAGES * LAYER_PAGE <= 4 * CHUNK
    names = {bytes(chain_key(NS.id, ROOT_KEY, tokens(i))): i for i in range(4)}
    gate, reads = threading.Event(), []
    real = backend.read_chunk

    def read_chunk(ext: Any, piece: Any, dest: Any) -> int:
        group = bisect.bisect_right(list(itertools.accumulate(ext.header.sections)), piece.raw_off)
        reads.append((names[bytes(ext.header.key)], group))
        gate.wait(30)
        return real(ext, piece, dest)

    monkeypatch.setattr(backend, "read_chunk", read_chunk)
    yield tier, reads, gate
    gate.set()


def load_all(tier: Any, gate: threading.Event, batches: list[int | None]) -> None:
    """Load extents 0..n-1, extent i with the ticket of extent batches[i]'s load as its batch (None:
    no batch); release the thread; every load comes back OK with its own bytes."""
    dests = [np.zeros(payload(i).nbytes, np.uint8) for i in range(len(batches))]
    tickets: list[Ticket] = []
    for i, of in enumerate(batches):
        key = chain_key(NS.id, ROOT_KEY, tokens(i))
        extra = {} if of is None else {"batch": tickets[of]}
        tickets.append(tier.submit_load(key, dests[i], **extra))
    gate.set()
    for i, ticket in enumerate(tickets):
        assert tier.wait(ticket, 30).status is Status.OK
        assert np.array_equal(dests[i], payload(i))


def test_the_loads_of_a_batch_are_read_group_by_group_and_a_later_load_after_them(recorded: Any) -> None:
    tier, reads, gate = recorded
    load_all(tier, gate, [None, 0, 0, None])  # extents 0-2: one restore; extent 3: another load
    batch = [group for extent, group in reads if extent < 3]
    assert batch == sorted(batch), f"a later group read before group 0 of another extent: {reads}"
    assert {extent for extent, group in reads if group == 0} == {0, 1, 2, 3}
    last = max(i for i, (extent, _) in enumerate(reads) if extent < 3)
    assert all(extent == 3 for extent, _ in reads[last + 1 :]) and len(reads) - last - 1 == 8, reads


def test_loads_without_a_batch_are_read_one_after_another(recorded: Any) -> None:
    tier, reads, gate = recorded
    load_all(tier, gate, [None, None, None])
    assert [extent for extent, _ in reads] == [0] * 8 + [1] * 8 + [2] * 8, reads


def test_a_lookup_runs_after_the_loads_before_it_and_before_the_loads_after_it(
    recorded: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sgl_hicache.tier.file import backend
    from sgl_hicache.tier.results import LookupRequest

    tier, reads, gate = recorded
    real = backend.run_lookup

    def run_lookup(*args: Any) -> Any:
        reads.append(("lookup", -1))
        return real(*args)

    monkeypatch.setattr(backend, "run_lookup", run_lookup)
    dests = [np.zeros(payload(i).nbytes, np.uint8) for i in range(2)]
    first = tier.submit_load(chain_key(NS.id, ROOT_KEY, tokens(0)), dests[0])
    tier.submit_lookup(LookupRequest(np.asarray(tokens(2), np.uint32), 0))
    second = tier.submit_load(chain_key(NS.id, ROOT_KEY, tokens(1)), dests[1])
    gate.set()
    assert tier.wait(first, 30).ok and tier.wait(second, 30).ok
    found: list[Any] = []
    for _ in range(300):
        if found := tier.lookups_finished():
            break
        threading.Event().wait(0.1)
    assert found, "the lookup never answered"
    assert [extent for extent, _ in reads] == [0] * 8 + ["lookup"] + [1] * 8, reads
