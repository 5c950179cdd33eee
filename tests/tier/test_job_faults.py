"""A job that raises where nothing expected it still ends its operation (review: loads and stores
left without a completion).

Once a load was read, its end (closing the file, classifying a failure, dropping a bad extent) or a
store's bookkeeping may raise: an OSError of a close, the Mooncake binding raising, a bug. The
operation must still get exactly one completion, promptly and never OK (the restore recomputes at
once instead of at its timeout), counted in `io_errors`, logged once; what it held (a load's pin,
a store's place as the key's writer) is released. Both backends; Mooncake's against an in-memory
store (`FakeStore`), the binding's calls raising where a test says.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import sgl_hicache.tier.file.backend as file_backend
import sgl_hicache.tier.mooncake.backend as mc
from sgl_hicache.tier import ROOT_KEY, ExtentKey, Status
from sgl_hicache.tier.completions import Returned
from sgl_hicache.tier.faults import Counters, FaultLog
from sgl_hicache.tier.format import Mismatch
from sgl_hicache.tier.mooncake import objects
from sgl_hicache.tier.mooncake.client import Names
from sgl_hicache.tier.results import Completion, Op
from tests.tier.common import CHUNK, NS, key_for, payload_for, tokens_for
from tests.tier.test_integrity import covered
from tests.tier.test_mooncake_races import FakeStore, on_fake_store
from tests.tier.test_store_faults import FailingOs

NBYTES = 4 * CHUNK  # four chunks: four jobs for a file load
PROMPT_S = 5.0  # a completion comes by then, or never (a restore's own timeout is far longer)


def store(tier: Any, i: int) -> ExtentKey:
    key = key_for(i)
    assert tier.wait(tier.submit_store(key, payload_for(i, NBYTES), tokens_for(i), ROOT_KEY), 10).ok
    return key


def load(tier: Any, key: ExtentKey) -> tuple[Status, np.ndarray]:
    """One load's status (it must come within PROMPT_S) and destination; no second completion."""
    dest = np.zeros(NBYTES, dtype=np.uint8)
    ticket = tier.submit_load(key, dest)
    done = tier.wait(ticket, PROMPT_S)
    assert not [c for c in tier.get_finished() if c.ticket == ticket]
    return done.status, dest


def unexpected_logs(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "sgl_hicache.tier" and r.levelno >= logging.ERROR]


def corrupt_last_chunk(root: Path) -> None:
    path = next(root.rglob("*.ext"))
    raw = bytearray(path.read_bytes())
    raw[covered(bytes(raw))[-1].start] ^= 1
    path.write_bytes(bytes(raw))


# -- the file tier --------------------------------------------------------------------------------


def store_failed_then_stores_again(tier: Any, key: Any, data: Any, done: Any) -> None:
    """`done` (a store whose job raised) ended IO_ERROR, counted once; the key is free for the next
    store, which lands, and a load returns its bytes."""
    assert done.status is Status.IO_ERROR
    assert (tier.stats().store_failures, tier.stats().io_errors) == (1, 1)
    assert tier.wait(tier.submit_store(key, data, tokens_for(1), ROOT_KEY), PROMPT_S).ok
    status, got = load(tier, key)
    assert status is Status.OK and np.array_equal(got, data)


def test_a_load_whose_file_cannot_be_closed_ends_io_error_logged_once_and_unpinned(
    make_tier: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The close at the end of a load fails (EIO; the descriptor is gone all the same): both loads
    end IO_ERROR at once, never OK, counted twice and logged once, and the extent is pinned by
    neither (it can be discarded)."""
    tier = make_tier()
    key = store(tier, 1)
    failing = FailingOs(lambda name, *args: name == "close")
    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger="sgl_hicache.tier"):
        m.setattr(file_backend, "os", failing)
        statuses = [load(tier, key)[0] for _ in range(2)]
    assert statuses == [Status.IO_ERROR] * 2 and failing.failed == ["close"] * 2
    assert tier.stats().io_errors == 2 and tier.stats().loads == 0
    assert len(unexpected_logs(caplog)) == 1
    assert tier.discard(key)  # no pin left


@pytest.mark.parametrize("where", ["open", "end"])
def test_a_load_whose_failure_cannot_be_classified_still_ends(
    make_tier: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Classifying a failed load raises (a bug in the fault path): at its open (no such extent) or
    at its end (a chunk failed its checksum), the load ends IO_ERROR at once, counted, unpinned."""
    tier = make_tier()
    key = store(tier, 1)
    if where == "end":
        corrupt_last_chunk(tmp_path / "tier")

    def classify_raises(*args: Any) -> Any:
        raise RuntimeError("a bug in the fault path")

    with monkeypatch.context() as m:
        m.setattr(file_backend, "failed", classify_raises)
        status, _ = load(tier, key if where == "end" else key_for(2))
    assert status is Status.IO_ERROR and tier.stats().io_errors == 1
    assert tier.discard(key)


def test_a_store_whose_job_raises_ends_and_its_key_is_stored_again(
    make_tier: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store's job raises before it wrote anything: it ends IO_ERROR at once (a store failure),
    and a later store of the key writes it (it follows no store that ended without a completion)."""
    tier = make_tier()
    key, data = key_for(1), payload_for(1, NBYTES)

    def present_raises(req: Any) -> bool:
        raise RuntimeError("a bug before the write")

    with monkeypatch.context() as m:
        m.setattr(tier._publisher, "present", present_raises)
        done = tier.wait(tier.submit_store(key, data, tokens_for(1), ROOT_KEY), PROMPT_S)
    store_failed_then_stores_again(tier, key, data, done)


# -- the Mooncake tier ----------------------------------------------------------------------------


@pytest.fixture
def on_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeStore, mc.MooncakeTier]]:
    """A Mooncake tier on an in-memory store."""
    fake = FakeStore()
    monkeypatch.setattr(mc, "connect", lambda cfg: fake)
    tier = mc.MooncakeTier(on_fake_store(tmp_path), NS)
    yield fake, tier
    tier.close(5)


def binding_raises(*args: Any) -> Any:
    raise RuntimeError("the binding raised")


def found_bad(*args: Any) -> bool:
    raise Mismatch("an extent of the key that is not what the key names")


def corrupt_a_chunk(fake: FakeStore) -> None:
    """Flip the first byte of the extent's chunk object 2 (its checksum then fails)."""
    chunk = next(n for n in fake.objs if n.endswith(".2"))
    fake.objs[chunk] = bytes([fake.objs[chunk][0] ^ 1]) + fake.objs[chunk][1:]


def test_a_mooncake_load_whose_bad_extent_cannot_be_removed_still_ends(
    on_store: tuple[FakeStore, mc.MooncakeTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk fails its checksum and the binding raises on the removal of the bad header: the load
    ends IO_ERROR at once (never OK), counted; once the binding answers, the next load drops it."""
    fake, tier = on_store
    key = store(tier, 1)
    corrupt_a_chunk(fake)
    with monkeypatch.context() as m:
        m.setattr(fake, "remove", binding_raises)
        status, _ = load(tier, key)
    assert status is Status.IO_ERROR and tier.stats().io_errors == 1
    assert load(tier, key)[0] is Status.CORRUPT
    assert load(tier, key)[0] is Status.MISS


@pytest.mark.parametrize("where", ["load", "store"])
def test_a_bad_mooncake_extent_leaves_the_index_even_when_its_removal_raises(
    on_store: tuple[FakeStore, mc.MooncakeTier], monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A load finds a chunk corrupt, or a store finds its key's extent bad, and the binding raises
    on the removal of the bad header: the key leaves the index all the same (the tier no longer
    claims an extent it found bad; before, `contains`, `lookup` and `stats` kept it)."""
    fake, tier = on_store
    key = store(tier, 1)
    corrupt_a_chunk(fake)
    with monkeypatch.context() as m:
        m.setattr(fake, "remove", binding_raises)
        if where == "load":
            assert load(tier, key)[0] is Status.IO_ERROR
        else:
            m.setattr(objects, "present", found_bad)
            ticket = tier.submit_store(key, payload_for(1, NBYTES), tokens_for(1), ROOT_KEY)
            assert tier.wait(ticket, PROMPT_S).status is Status.IO_ERROR
    assert not tier.contains(key) and tier.lookup(key) is None
    assert (tier.stats().extents, tier.stats().bytes_stored) == (0, 0)


def test_a_mooncake_remove_whose_binding_raises_still_completes(
    on_store: tuple[FakeStore, mc.MooncakeTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake, tier = on_store
    key = store(tier, 1)
    monkeypatch.setattr(fake, "remove_many", binding_raises)  # the header read, then its removal raises
    done = tier.wait(tier.submit_remove([key]), PROMPT_S)
    assert done.status is Status.IO_ERROR and tier.stats().io_errors == 1


def test_a_mooncake_remove_that_fails_for_one_key_removes_and_counts_the_others(
    on_store: tuple[FakeStore, mc.MooncakeTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The binding raises on the removal of the second of three keys: the first and the third go
    all the same, and both are counted (`purged_extents`, the completion's `nbytes`); the remove
    ends IO_ERROR, counted once (before: the job stopped at the raise, counting nothing)."""
    fake, tier = on_store
    keys = [store(tier, i) for i in (1, 2, 3)]
    remove_many = fake.remove_many

    def raises_for_the_second(names: list[str]) -> Any:
        if names[0].endswith(bytes(keys[1]).hex()):
            raise RuntimeError("the binding raised")
        return remove_many(names)

    monkeypatch.setattr(fake, "remove_many", raises_for_the_second)
    done = tier.wait(tier.submit_remove(keys), PROMPT_S)
    assert (done.status, done.nbytes) == (Status.IO_ERROR, 2)
    assert (tier.stats().purged_extents, tier.stats().io_errors) == (2, 1)
    monkeypatch.undo()
    assert [load(tier, k)[0] for k in keys] == [Status.MISS, Status.OK, Status.MISS]


def test_a_mooncake_purge_whose_binding_raises_is_owed_and_retried(
    on_store: tuple[FakeStore, mc.MooncakeTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The binding raises on a purge's `remove_by_regex`: the purge ends IO_ERROR at once and is
    owed like one the store refused, so the tier's tick runs it again until the salt's objects are
    gone (before: a raise left nothing owed, and the deletion was lost). The retry counts what it
    removed just after the store's reply, on an I/O thread: the test waits for both."""
    fake, tier = on_store
    key = key_for(1)
    ticket = tier.submit_store(key, payload_for(1, NBYTES), tokens_for(1), ROOT_KEY, cache_salt="s1")
    assert tier.wait(ticket, PROMPT_S).ok

    def objects_of_key() -> int:
        return sum("/" + bytes(key).hex() in name for name in list(fake.objs))

    held = objects_of_key()  # its header and chunks: what the purge removes and counts
    remove_matching, raises = fake.remove_matching, [True]

    def raises_once(pattern: str) -> Any:
        if raises:
            raises.pop()
            raise RuntimeError("the binding raised")
        return remove_matching(pattern)

    monkeypatch.setattr(fake, "remove_matching", raises_once)
    assert tier.wait(tier.submit_purge("s1"), PROMPT_S).status is Status.IO_ERROR
    deadline = time.monotonic() + 10
    while objects_of_key() or tier.stats().purged_extents < held:
        assert time.monotonic() < deadline, "the purge that raised was not retried, or not counted"
        time.sleep(0.05)
    assert tier.stats().purge_retries >= 1 and tier.stats().purged_extents == held


def test_a_mooncake_purge_retry_whose_binding_raises_is_counted_and_still_owed(
    on_store: tuple[FakeStore, mc.MooncakeTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The binding raises on every `remove_by_regex`: each retry of the owed purge is counted as an
    I/O error like a retry the store refused (before: a retry that raised was counted nowhere)."""
    fake, tier = on_store
    monkeypatch.setattr(fake, "remove_matching", binding_raises)
    assert tier.wait(tier.submit_purge("s1"), PROMPT_S).status is Status.IO_ERROR
    deadline = time.monotonic() + 10
    while tier.stats().io_errors < 3:
        assert time.monotonic() < deadline, (
            f"retries {tier.stats().purge_retries}, io_errors {tier.stats().io_errors}"
        )
        time.sleep(0.05)
    assert tier.stats().purge_retries >= 2


def test_a_mooncake_store_whose_failure_handling_raises_ends_and_its_key_is_stored_again(
    on_store: tuple[FakeStore, mc.MooncakeTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store finds a bad extent of its key, and the binding raises on its removal: the store
    ends IO_ERROR at once; a later store of the key writes it (it follows no store that ended
    without a completion)."""
    fake, tier = on_store
    key, data = key_for(1), payload_for(1, NBYTES)
    with monkeypatch.context() as m:
        m.setattr(objects, "present", found_bad)
        m.setattr(fake, "remove", binding_raises)
        done = tier.wait(tier.submit_store(key, data, tokens_for(1), ROOT_KEY), PROMPT_S)
    store_failed_then_stores_again(tier, key, data, done)


@pytest.mark.parametrize("raising", ["remove", "get_into"])
def test_a_mooncake_read_of_tokens_whose_binding_raises_is_a_miss_counted_and_logged_once(
    on_store: tuple[FakeStore, mc.MooncakeTier], monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, raising: str,
) -> None:  # fmt: skip
    """A warm start reads an extent's token ids; the binding raises on the removal of its bad
    header, or on the header's read: None (a miss), counted in `io_errors`, logged once, never
    raised into the warm start (before: the raise escaped `read_tokens`). Once the binding
    answers, a bad header is dropped and a good one read."""
    fake, tier = on_store
    key = store(tier, 1)
    header = Names(NS.id).header(key)
    if raising == "remove":
        raw = bytearray(fake.objs[header])
        raw[20] ^= 1  # under the header's MAC: a FormatError
        fake.objs[header] = bytes(raw)
    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger="sgl_hicache.tier"):
        m.setattr(fake, raising, binding_raises)
        assert [tier.read_tokens(key), tier.read_tokens(key)] == [None, None]
    assert tier.stats().io_errors == 2 and len(unexpected_logs(caplog)) == 1
    tokens = tier.read_tokens(key)
    if raising == "remove":
        assert tokens is None and header not in fake.objs
    else:
        assert tokens is not None and tokens.tolist() == tokens_for(1)


# -- the guard itself ------------------------------------------------------------------------------


@pytest.mark.parametrize("op", [Op.LOAD, Op.STORE])
@pytest.mark.parametrize("status", [Status.OK, Status.IO_ERROR])
def test_a_job_that_raises_after_posting_keeps_its_completion_and_counts_nothing_more(
    caplog: pytest.LogCaptureFixture, op: Op, status: Status
) -> None:
    """The job posted its completion (and counted it, as a backend's post does) and then raised: the
    completion stands, the raise is logged once, and nothing more is counted (one operation, one
    count: before, a failure was counted twice and an OK operation counted as an I/O error)."""
    counters = Counters()
    returned: Returned[Any] = Returned(threading.Lock(), lambda load: 0, counters, FaultLog(), "a test")
    ticket, key = returned.queue.issue(), key_for(1)

    def posts_then_raises() -> None:
        if status is not Status.OK:
            counters.add("io_errors")
            if op is Op.STORE:
                counters.add("store_failures")
        returned.queue.post(Completion(ticket, op, key, status, 0, "the job's own"))
        raise RuntimeError("a bug after the post")

    failed = {"io_errors": 1, **({"store_failures": 1} if op is Op.STORE else {})}
    counted = {} if status is Status.OK else failed
    with caplog.at_level(logging.WARNING, logger="sgl_hicache.tier"):
        returned.guard(ticket, op, key, posts_then_raises)()
    done = returned.wait(ticket, 0)
    assert (done.status, done.detail) == (status, "the job's own")
    assert counters.snapshot() == counted
    assert len(unexpected_logs(caplog)) == 1


@pytest.mark.parametrize("op", [Op.LOAD, Op.STORE])
def test_a_job_that_raises_before_posting_ends_io_error_counted_once(
    caplog: pytest.LogCaptureFixture, op: Op
) -> None:
    counters = Counters()
    returned: Returned[Any] = Returned(threading.Lock(), lambda load: 0, counters, FaultLog(), "a test")
    ticket = returned.queue.issue()
    with caplog.at_level(logging.WARNING, logger="sgl_hicache.tier"):
        returned.guard(ticket, op, key_for(1), lambda: binding_raises())()
    assert returned.wait(ticket, 0).status is Status.IO_ERROR
    assert counters.snapshot() == {"io_errors": 1, **({"store_failures": 1} if op is Op.STORE else {})}
    assert len(unexpected_logs(caplog)) == 1


def test_a_raising_jobs_completion_is_seen_only_once_it_is_logged_and_counted() -> None:
    """A waiter that sees the IO_ERROR of a job that raised also sees its count and its log line
    (before: posted first, so a test checking the log right after its wait could find none)."""
    counters, logged = Counters(), threading.Event()

    class SlowLog(FaultLog):
        def unexpected(self, op: Op, err: Exception, where: str) -> None:
            time.sleep(0.2)  # a slow log handler: the waiter must not overtake it
            logged.set()

    returned: Returned[Any] = Returned(threading.Lock(), lambda _: 0, counters, SlowLog(), "test")
    ticket = returned.queue.issue()

    def raises() -> None:
        raise RuntimeError("a bug")

    threading.Thread(target=returned.guard(ticket, Op.STORE, ROOT_KEY, raises)).start()
    done = returned.queue.wait(ticket, timeout=10)
    assert done.status is Status.IO_ERROR
    assert logged.is_set(), "the completion was seen before the failure was logged"
    assert counters.snapshot()["io_errors"] == 1 and counters.snapshot()["store_failures"] == 1
