"""A Mooncake I/O thread's scratch buffer (`objects.Scratch`): every buffer it makes is registered
with the store (RDMA reads into it), so it grows by at least doubling, up to what one batch read
reads into (`LOAD_BATCH_BYTES`), and unregisters the buffer it replaces: requests that grow in small
steps (a batch's header reads, n x `HEADER_READ_BYTES`) cost a few registrations, not one a step.
No store needed: the register and unregister calls are recorded."""

from __future__ import annotations

import threading

import pytest

from sgl_hicache.tier.mooncake import objects

STEP = 64 << 10


class Recorded:
    def __init__(self) -> None:
        self.registered: list[memoryview] = []
        self.unregistered: list[memoryview] = []
        self.scratch = objects.Scratch(self.registered.append, self.unregistered.append)

    @property
    def sizes(self) -> list[int]:
        return [b.nbytes for b in self.registered]


def test_growing_requests_register_a_doubling_buffer_and_unregister_the_one_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(objects, "LOAD_BATCH_BYTES", 16 * STEP)
    r = Recorded()
    for n in range(1, 17):  # 64 KiB .. 1 MiB in steps of 64 KiB
        view = r.scratch.get(n * STEP)
        assert view.nbytes == n * STEP
        view[-1] = n  # writable, all of it
    assert r.sizes == [STEP, 2 * STEP, 4 * STEP, 8 * STEP, 16 * STEP], "doubling"
    assert r.scratch.get(40 * STEP).nbytes == 40 * STEP
    assert r.sizes[-1] == 40 * STEP, "past LOAD_BATCH_BYTES: what the request needs, no more"
    assert [id(b) for b in r.unregistered] == [id(b) for b in r.registered[:-1]], "each replaced one, once"


def test_a_buffer_large_enough_is_reused_and_each_thread_has_its_own() -> None:
    r = Recorded()
    first = r.scratch.get(3 * STEP)
    assert r.scratch.get(STEP).obj is first.obj and r.scratch.get(3 * STEP).obj is first.obj
    other: list[memoryview] = []
    worker = threading.Thread(target=lambda: other.append(r.scratch.get(STEP)))
    worker.start()
    worker.join()
    assert other[0].obj is not first.obj
    assert len(r.registered) == 2 and not r.unregistered


def test_a_registration_that_raises_leaves_the_thread_its_old_buffer_registered() -> None:
    registered: list[memoryview] = []
    unregistered: list[memoryview] = []

    def register(buf: memoryview) -> None:
        if registered:
            raise RuntimeError("register_buffer failed")
        registered.append(buf)

    scratch = objects.Scratch(register, unregistered.append)
    first = scratch.get(STEP)
    with pytest.raises(RuntimeError):
        scratch.get(4 * STEP)
    assert not unregistered, "the registered buffer is kept"
    assert scratch.get(STEP).obj is first.obj, "and still used"
