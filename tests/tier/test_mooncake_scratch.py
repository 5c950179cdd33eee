"""A Mooncake I/O thread's scratch buffer (`Scratch`): every buffer it makes is registered
with the store (RDMA reads into it), so it grows by at least doubling, up to what a thread keeps
(`SCRATCH_KEEP_BYTES`), and unregisters the buffer it replaces: requests that grow in small steps
(a batch's header reads, n x `HEADER_READ_BYTES`) cost a few registrations, not one a step. Every
buffer it registered is unregistered exactly once, never while a use of it is open: a larger one
as its use ends, a thread's that exited, and all at close. No store needed: the register and
unregister calls are recorded."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

import pytest

from sgl_hicache.tier.format import DirectoryMac
from sgl_hicache.tier.mooncake import objects
from sgl_hicache.tier.mooncake import scratch as scratch_mod
from sgl_hicache.tier.mooncake.client import INVALID_PARAMS, OBJECT_NOT_FOUND, Names, Reply
from sgl_hicache.tier.mooncake.scratch import Scratch
from tests.tier.common import NS, key_for

STEP = 64 << 10


def keep(monkeypatch: pytest.MonkeyPatch, nbytes: int) -> None:
    """`SCRATCH_KEEP_BYTES` for the test: what a thread keeps, and what the calls are cut to."""
    monkeypatch.setattr(scratch_mod, "SCRATCH_KEEP_BYTES", nbytes)
    monkeypatch.setattr(objects, "SCRATCH_KEEP_BYTES", nbytes)


class Recorded:
    def __init__(self) -> None:
        self.registered: list[memoryview] = []
        self.unregistered: list[memoryview] = []
        self.in_use: set[int] = set()  # id of each buffer a use holds now (`used`)
        self.while_in_use: list[memoryview] = []  # unregistered while a use of it was open
        self.scratch = Scratch(self.registered.append, self._unregister)

    def _unregister(self, buf: memoryview) -> None:
        if id(buf) in self.in_use:
            self.while_in_use.append(buf)
        self.unregistered.append(buf)

    def registered_now(self, view: memoryview) -> bool:
        """Whether `view` is in a buffer registered and not unregistered since."""
        gone = set(map(id, self.unregistered))
        return any(b.obj is view.obj for b in self.registered if id(b) not in gone)

    def used(self, nbytes: int, then: Callable[[memoryview], None] = lambda view: None) -> memoryview:
        """`then(view)` inside a use of `nbytes`; the buffer it used."""
        with self.scratch.use(nbytes) as view:
            buf = next(b for b in reversed(self.registered) if b.obj is view.obj)
            self.in_use.add(id(buf))
            try:
                then(view)
            finally:
                self.in_use.discard(id(buf))
        return buf

    @property
    def sizes(self) -> list[int]:
        return [b.nbytes for b in self.registered]

    def each_unregistered_once(self) -> None:
        assert sorted(map(id, self.unregistered)) == sorted(map(id, self.registered))


@pytest.fixture
def recorded() -> Iterator[Recorded]:
    r = Recorded()
    yield r
    r.scratch.close()
    assert not r.while_in_use, "a buffer was unregistered while a use of it was open"


def in_thread(fn: Callable[[], object]) -> None:
    worker = threading.Thread(target=fn)
    worker.start()
    worker.join()


def test_growing_requests_register_a_doubling_buffer_and_unregister_the_one_replaced(
    monkeypatch: pytest.MonkeyPatch, recorded: Recorded
) -> None:
    keep(monkeypatch, 16 * STEP)
    r = recorded
    for n in range(1, 17):  # 64 KiB .. 1 MiB in steps of 64 KiB

        def check(view: memoryview, n: int = n) -> None:
            assert view.nbytes == n * STEP
            view[-1] = n  # writable, all of it

        r.used(n * STEP, check)
    assert r.sizes == [STEP, 2 * STEP, 4 * STEP, 8 * STEP, 16 * STEP], "doubling"
    r.used(40 * STEP, lambda view: view.nbytes == 40 * STEP or pytest.fail("short view"))
    assert r.sizes[-1] == 40 * STEP, "past SCRATCH_KEEP_BYTES: what the request needs, no more"
    assert [id(b) for b in r.unregistered] == [id(b) for b in r.registered], "each replaced one, once"


def test_a_buffer_large_enough_is_reused_and_each_thread_has_its_own(recorded: Recorded) -> None:
    r = recorded
    first = r.used(3 * STEP)
    assert r.used(STEP) is first and r.used(3 * STEP) is first
    in_thread(lambda: r.used(STEP))
    assert r.registered[-1] is not first
    assert len(r.registered) == 2 and not r.unregistered


def test_a_registration_that_raises_leaves_the_thread_its_old_buffer_registered() -> None:
    registered: list[memoryview] = []
    unregistered: list[memoryview] = []

    def register(buf: memoryview) -> None:
        if registered:
            raise RuntimeError("register_buffer failed")
        registered.append(buf)

    scratch = Scratch(register, unregistered.append)
    with scratch.use(STEP) as first:
        pass
    with pytest.raises(RuntimeError), scratch.use(4 * STEP):
        pass
    assert not unregistered, "the registered buffer is kept"
    with scratch.use(STEP) as again:
        assert again.obj is first.obj, "and still used"


def test_close_unregisters_every_buffer_it_registered_exactly_once(recorded: Recorded) -> None:
    r = recorded
    r.used(STEP)
    r.used(3 * STEP)  # replaces the first
    used, leave = threading.Event(), threading.Event()

    def live() -> None:
        r.used(2 * STEP)
        used.set()
        leave.wait(10)

    alive = threading.Thread(target=live)
    alive.start()  # its thread lives on while close runs: its buffer goes all the same
    assert used.wait(10)
    in_thread(lambda: r.used(STEP))  # its thread has exited
    assert r.scratch.held_bytes == 3 * STEP + 2 * STEP + STEP
    r.scratch.close()
    leave.set()
    alive.join()
    r.each_unregistered_once()
    assert r.scratch.held_bytes == 0
    r.scratch.close()  # again: nothing more
    r.each_unregistered_once()


def test_a_dead_threads_buffer_is_unregistered_when_another_thread_grows(recorded: Recorded) -> None:
    r = recorded
    in_thread(lambda: r.used(2 * STEP))
    dead = r.registered[0]
    assert r.scratch.held_bytes == 2 * STEP and not r.unregistered
    r.used(STEP)
    assert [id(b) for b in r.unregistered] == [id(dead)]
    assert r.scratch.held_bytes == STEP


def test_a_buffer_over_the_keep_size_goes_as_its_use_ends(
    monkeypatch: pytest.MonkeyPatch, recorded: Recorded
) -> None:
    keep(monkeypatch, 4 * STEP)
    r = recorded
    kept = r.used(4 * STEP)
    assert r.scratch.held_bytes == 4 * STEP, "up to the keep size: kept"
    large = r.used(5 * STEP, lambda view: view.nbytes == 5 * STEP or pytest.fail("short view"))
    assert [id(b) for b in r.unregistered] == [id(kept), id(large)], "replaced, then gone after its use"
    assert r.scratch.held_bytes == 0
    assert r.used(STEP).nbytes == STEP, "the next use registers a small one"


def test_no_buffer_is_unregistered_while_a_use_of_it_is_open(
    monkeypatch: pytest.MonkeyPatch, recorded: Recorded
) -> None:
    """`Recorded` fails an unregistration of a buffer in use: close while another thread holds its
    buffer, and a large one, leaves it to that use's end."""
    keep(monkeypatch, 4 * STEP)
    r = recorded
    inside, closed = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def hold(view: memoryview) -> None:
        inside.set()
        closed.wait(10)
        view[:] = b"\1" * view.nbytes  # as a store call reading into it would

    def worker() -> None:
        try:
            r.used(8 * STEP, hold)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=worker)
    t.start()
    assert inside.wait(10)
    closer = threading.Thread(target=r.scratch.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive(), "close waits for the use open to end"
    assert not r.unregistered, "in use: not yet"
    closed.set()
    t.join()
    closer.join(10)
    assert not closer.is_alive() and not errors and not r.while_in_use
    r.each_unregistered_once()
    assert r.scratch.held_bytes == 0
    with pytest.raises(RuntimeError, match="closed"):
        r.used(STEP)  # after close: the client is about to go
    r.each_unregistered_once()


def test_close_waits_a_bounded_time_and_a_use_still_open_lets_its_buffer_go_at_its_end(
    recorded: Recorded,
) -> None:
    r = recorded
    inside, done = threading.Event(), threading.Event()
    t = threading.Thread(target=lambda: r.used(STEP, lambda view: (inside.set(), done.wait(10))))
    t.start()
    assert inside.wait(10)
    r.scratch.close(wait_s=0.05)
    assert not r.unregistered
    done.set()
    t.join()
    r.each_unregistered_once()
    assert not r.while_in_use


def test_a_spoiled_buffer_is_never_reused_nor_unregistered(recorded: Recorded) -> None:
    """A transfer the store gave up on may still write its buffer: set aside for good; the thread's
    next use gets a new one; close leaves it registered (its memory mapped)."""
    r = recorded
    first = r.used(STEP, lambda view: r.scratch.spoil())
    assert r.scratch.spoiled_bytes == STEP and r.scratch.held_bytes == 0
    second = r.used(STEP)
    assert second is not first
    r.scratch.close()
    assert [id(b) for b in r.unregistered] == [id(second)]


def test_a_refused_registration_raises_and_the_thread_keeps_its_buffer() -> None:
    answers = iter([Reply(), Reply(code=-1)])
    unregistered: list[memoryview] = []
    scratch = Scratch(lambda buf: next(answers), unregistered.append)
    with scratch.use(STEP) as view:
        kept = view.obj
    with pytest.raises(OSError, match="could not register"), scratch.use(4 * STEP):
        pass
    with scratch.use(STEP) as view:
        assert view.obj is kept
    assert not unregistered


class FailingStore:
    """Answers every object of a batch read with `code` (TRANSFER_FAIL-like: it may still write)."""

    def __init__(self, code: int) -> None:
        self.code = code

    def get_many_into(self, names: Sequence[str], dests: Sequence[memoryview]) -> list[Reply]:
        return [Reply(self.code)] * len(names)

    def get_into(self, name: str, dest: memoryview) -> Reply:
        return Reply(self.code)


@pytest.mark.parametrize(("code", "spoiled"), [(-800, True), (-1, True), (-900, False), (-901, False), (OBJECT_NOT_FOUND, False),
                                               (INVALID_PARAMS, False)])  # fmt: skip
def test_a_header_read_the_store_gave_up_on_spoils_its_buffer(
    recorded: Recorded, code: int, spoiled: bool
) -> None:
    names, wanted = Names(NS.id), [(key_for(i), None) for i in range(3)]
    store = FailingStore(code)
    if code == INVALID_PARAMS:  # read again alone at its size, which the store does not know
        store.size = lambda name: Reply(OBJECT_NOT_FOUND)  # type: ignore[attr-defined]
    got = objects.open_headers(store, names, NS.id, wanted, DirectoryMac(b"s" * 32), recorded.scratch)  # type: ignore[arg-type]
    assert all(isinstance(e, Exception) for e in got)
    assert (recorded.scratch.spoiled_bytes > 0) == spoiled


def test_headers_are_read_64_a_call_at_most(recorded: Recorded) -> None:
    """A batch of headers is cut to fit the keep size: no call needs a buffer made for it alone."""
    calls: list[int] = []

    class Store(FailingStore):
        def get_many_into(self, names: Sequence[str], dests: Sequence[memoryview]) -> list[Reply]:
            calls.append(len(names))
            return super().get_many_into(names, dests)

    wanted = [(key_for(i), None) for i in range(130)]
    objects.open_headers(Store(OBJECT_NOT_FOUND), Names(NS.id), NS.id, wanted, DirectoryMac(b"s" * 32),  # type: ignore[arg-type]
                         recorded.scratch)  # fmt: skip
    assert calls == [64, 64, 2]
    assert max(recorded.sizes) <= scratch_mod.SCRATCH_KEEP_BYTES


def test_a_nested_use_on_one_thread_raises(recorded: Recorded) -> None:
    with recorded.scratch.use(STEP), pytest.raises(RuntimeError), recorded.scratch.use(STEP):
        pass
    assert recorded.used(STEP).nbytes == STEP, "the thread's buffer is usable after"


class HeaderStore:
    """A store without the headers asked for but `large`'s, larger than HEADER_READ_BYTES (a batch
    read refuses it: INVALID_PARAMS); records whether each buffer read into is registered then."""

    def __init__(self, r: Recorded, large: str, large_bytes: int) -> None:
        self.r, self.large, self.large_bytes = r, large, large_bytes
        self.into: list[bool] = []

    def get_many_into(self, names: Sequence[str], dests: Sequence[memoryview]) -> list[Reply]:
        self.into += [self.r.registered_now(d) for d in dests]
        return [Reply(INVALID_PARAMS if n == self.large else OBJECT_NOT_FOUND) for n in names]

    def size(self, name: str) -> Reply:
        return Reply(n=self.large_bytes)

    def get_into(self, name: str, dest: memoryview) -> Reply:
        self.into.append(self.r.registered_now(dest))
        return Reply(OBJECT_NOT_FOUND)


def test_headers_are_read_into_registered_buffers_and_a_large_one_does_not_stay(
    monkeypatch: pytest.MonkeyPatch, recorded: Recorded
) -> None:
    """A batch of headers and one read again at its size (over the keep size): each store call reads
    into a registered buffer, and after the call the thread holds no more than the keep size."""
    keep(monkeypatch, 4 * objects.HEADER_READ_BYTES)
    names, wanted = Names(NS.id), [(key_for(i), None) for i in range(3)]
    store = HeaderStore(recorded, names.header(key_for(1)), 6 * objects.HEADER_READ_BYTES)
    got = objects.open_headers(store, names, NS.id, wanted, DirectoryMac(b"s" * 32), recorded.scratch)  # type: ignore[arg-type]
    assert [type(e) for e in got] == [objects.Gone] * 3, got
    assert store.into == [True] * 4, "three in the batch, the large one alone"
    assert recorded.scratch.held_bytes == 0, "the large buffer went after its call (it replaced the batch's)"
    assert recorded.sizes == [3 * objects.HEADER_READ_BYTES, 6 * objects.HEADER_READ_BYTES]
