"""The Mooncake tier joined through a real client (`MooncakeConfig.real_client`, Mooncake's standalone
mode, issue 40): every server a dummy of one `mooncake_client` on its host, which holds the segment
and copies every object into and out of the servers' shared memory.

On a real master and real client on loopback: staging made by the tier (`host_memory`) and
registered is written and read in place by the real client (the calls name its addresses); memory
the real client does not map (a caller's array) is written through the call itself and read
through the scratch buffer, bit-exact either way, compressed and page prefixes included; a read
whose RPC broke is taken as still copying (`dest_unsafe`); what a tier stored outlives it (the
segment is the real client's): a tier opened again finds it, verified; a purge reaches every
object of its salt; a real client that does not answer is one line at open.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.bench.mooncake_process import MooncakeRealClient
from sgl_hicache.config import Compression, MiB, MooncakeConfig, SpillBackend, TierConfig
from sgl_hicache.tier import ROOT_KEY, IndexedTier, Status
from sgl_hicache.tier.mooncake import backend as mooncake_backend
from sgl_hicache.tier.mooncake import client as client_mod
from sgl_hicache.tier.mooncake.client import (
    INVALID_PARAMS,
    RPC_FAIL,
    RPC_LOST,
    MooncakeUnavailable,
    Reply,
    StoreClient,
    connect,
)
from sgl_hicache.tier.mooncake.scratch import late_writes
from sgl_hicache.tier.mooncake.shm import SharedMemory
from tests.mooncake_master import skip_without_mooncake
from tests.tier.common import CHUNK, payload_for
from tests.tier.test_contract import close_all
from tests.tier.test_mooncake import fresh_ns, key_of, load, salted_store, store

skip_without_mooncake()

MakeTier = Callable[..., IndexedTier]


class Recorder:
    """A client's real store, each call of the methods that move bytes recorded with its addresses."""

    def __init__(self, store: Any) -> None:
        self._store, self.calls, self.lock = store, list[tuple[str, list[int]]](), threading.Lock()
        self.fail_into: memoryview | None = None  # a read into it answers RPC_FAIL, moving nothing
        self.refused = 0  # objects the calls that move bytes answered INVALID_PARAMS for

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def call(*args: Any) -> Any:
            if name in ("batch_get_into", "batch_upsert_from", "get_into", "upsert_from"):
                addrs = list(args[1]) if name.startswith("batch") else [args[1]]
                with self.lock:
                    self.calls.append((name, addrs))
                if name == "batch_get_into" and self.fail_into is not None and within(addrs, self.fail_into):
                    return [RPC_FAIL] * len(args[0])
                got = method(*args)
                with self.lock:  # the real client refuses memory it does not map
                    self.refused += sum(
                        c == INVALID_PARAMS for c in (got if name.startswith("batch") else [got])
                    )
                return got
            elif name in ("upsert_batch", "upsert"):
                got = method(*args)
                with self.lock:
                    self.calls.append((name, []))
                    self.refused += got == INVALID_PARAMS
                return got
            return method(*args)

        return call

    def named(self, name: str) -> list[list[int]]:
        with self.lock:
            return [addrs for n, addrs in self.calls if n == name]


@pytest.fixture
def recorders(monkeypatch: pytest.MonkeyPatch) -> list[Recorder]:
    """Tiers opened from now on talk to the real client through a `Recorder` each (in this list)."""
    made: list[Recorder] = []

    def recording(cfg: MooncakeConfig) -> StoreClient:
        client = connect(cfg)
        made.append(Recorder(client._store))
        return StoreClient(made[-1], client.segment, client._shared)

    monkeypatch.setattr(mooncake_backend, "connect", recording)
    return made


@pytest.fixture
def make_tier(mooncake_real_client: MooncakeRealClient, tmp_path: Path) -> Iterator[MakeTier]:
    opened: list[IndexedTier] = []

    def make(ns: Any, **kw: Any) -> IndexedTier:
        kw.setdefault("directory", tmp_path / "tier")
        kw.setdefault("chunk_bytes", CHUNK)
        kw.setdefault("io_threads", 4)
        mooncake = MooncakeConfig(real_client=mooncake_real_client.address, local_buffer_size=16 * MiB)
        opened.append(mooncake_backend.MooncakeTier(TierConfig(backend=SpillBackend.MOONCAKE, mooncake=mooncake,
                                                               **kw), ns))  # fmt: skip
        return opened[-1]

    yield make
    close_all(opened)


def staging(tier: IndexedTier, nbytes: int) -> memoryview:
    """An arena as the server makes one: the tier's host memory, registered with it."""
    arena = tier.host_memory(nbytes)
    tier.register_host_memory(arena)
    return arena


def within(addrs: list[int], arena: memoryview) -> bool:
    base = np.frombuffer(arena, np.uint8).ctypes.data
    return all(base <= a < base + arena.nbytes for a in addrs)


def test_staging_is_written_and_read_in_place_by_the_real_client(
    make_tier: MakeTier, recorders: list[Recorder]
) -> None:
    """Two servers (two dummies of one real client): one spills from its staging, the other restores
    into its own; every chunk goes by the real client's copy straight from and into those arenas
    (no byte through the calls), and the loaded bytes are the stored ones."""
    ns = fresh_ns("in-place")
    writer, reader = make_tier(ns), make_tier(ns)
    nbytes = 3 * CHUNK + 123
    out, into = staging(writer, 4 * CHUNK), staging(reader, 4 * CHUNK)
    np.frombuffer(out, np.uint8)[:nbytes] = payload_for(7, nbytes)
    key = key_of(ns, 7)
    done = writer.wait(writer.submit_store(key, out[:nbytes], [7, 8], ROOT_KEY), 30)
    assert done.ok, done
    done = reader.wait(reader.submit_load(key, into[:nbytes]), 30)
    assert done.status is Status.OK and done.nbytes == nbytes
    assert np.array_equal(np.frombuffer(into, np.uint8)[:nbytes], payload_for(7, nbytes))
    w, r = recorders
    assert w.named("batch_upsert_from") and all(within(a, out) for a in w.named("batch_upsert_from"))
    chunk_reads = [a for a in r.named("batch_get_into") if within(a, into)]
    assert sum(len(a) for a in chunk_reads) == 4  # every chunk read straight into the arena


@pytest.mark.parametrize("compression", [Compression.NONE, Compression.ZSTD])
def test_memory_the_real_client_does_not_map_goes_through_shared_copies_exactly(
    make_tier: MakeTier, recorders: list[Recorder], compression: Compression
) -> None:
    """A payload and destinations in a caller's own arrays (not the tier's host memory), larger
    than what a call may carry (the 16 MiB local buffer): the chunks are written from a copy in
    shared memory and read into the tier's scratch (memory the real client maps), then placed:
    whole loads and page prefixes bit-exact, and the real client refused nothing."""
    ns = fresh_ns(f"bounced-{compression.value}")
    writer, reader = make_tier(ns, compression=compression), make_tier(ns)
    nbytes = 20 * MiB + 4097
    key = store(writer, 11, nbytes)
    for want in (None, CHUNK + 5, 2 * CHUNK):
        status, got = load(reader, key, nbytes, want)
        end = nbytes if want is None else want
        assert status is Status.OK and np.array_equal(got[:end], payload_for(11, nbytes)[:end])
    w, r = recorders
    assert w.named("batch_upsert_from") and not w.refused
    assert r.named("batch_get_into") and not r.refused  # each read into memory the real client maps


@pytest.mark.parametrize("lost", [True, False])
def test_a_read_whose_call_was_lost_may_still_be_copying(
    make_tier: MakeTier, recorders: list[Recorder], monkeypatch: pytest.MonkeyPatch, lost: bool
) -> None:
    """Through a real client RPC_FAIL answers both a call the dummy lost (its request timed out: the
    copy may still be writing the destination) and the real client's own failed master request
    (nothing copied). A slow one (`LOST_AFTER_S`) fails its load `dest_unsafe` (the cache never
    reuses that staging again); a quick one fails it cleanly (a master outage eats no staging). A
    client of the master itself keeps RPC_FAIL as failed before any transfer."""
    monkeypatch.setattr(client_mod, "LOST_AFTER_S", 0.0 if lost else 60.0)
    ns = fresh_ns(f"rpc-lost-{lost}")
    writer, reader = make_tier(ns), make_tier(ns)
    nbytes = 2 * CHUNK
    key = store(writer, 3, nbytes)
    into = staging(reader, nbytes)
    recorders[1].fail_into = into  # the chunks' reads (the header is read into scratch)
    done = reader.wait(reader.submit_load(key, into), 30)
    assert not done.ok and done.dest_unsafe is lost, done
    failing = StoreClient(_Failing(), "", SharedMemory()).get_many_into(["k"], [into[:8]])[0]
    assert late_writes([failing]) is lost
    assert (StoreClient(_Failing(), "", SharedMemory()).get_into("k", into[:8]).code == RPC_LOST) is lost
    assert not late_writes([StoreClient(_Failing()).get_many_into(["k"], [into[:8]])[0]])
    answered = StoreClient(
        _Failing(answers=[RPC_FAIL, 8]), "", SharedMemory()
    )  # a lost batch fails every object
    assert not late_writes(answered.get_many_into(["k", "j"], [into[:8], into[8:16]]))


class _Failing:
    """A store whose reads answer RPC_FAIL (or, for a batch, `answers`)."""

    def __init__(self, answers: list[int] | None = None) -> None:
        self.answers = answers

    def batch_get_into(self, names: list[str], *_: Any) -> list[int]:
        return self.answers or [RPC_FAIL] * len(names)

    def get_into(self, *_: Any) -> int:
        return RPC_FAIL


def test_what_a_tier_stored_outlives_it_in_the_real_clients_segment(
    make_tier: MakeTier, tmp_path: Path
) -> None:
    """The segment is the real client's: a tier that closed leaves every extent there, and one
    opened again on the store finds them through the manifest, verified (loads bit-exact, token ids
    read back); one of another deployment's secret finds none."""
    ns = fresh_ns("outlives")
    first = make_tier(ns)
    keys = [store(first, i, 2 * CHUNK + 7 * i) for i in range(3)]
    first.close(5)
    again = make_tier(ns)
    assert {e.key for e in again.extents()} == set(keys)
    assert again.read_tokens(keys[1]) is not None and again.read_tokens(keys[1]).tolist() == [1, 2]
    for i, key in enumerate(keys):
        status, got = load(again, key, 2 * CHUNK + 7 * i)
        assert status is Status.OK and np.array_equal(got, payload_for(i, 2 * CHUNK + 7 * i))
    assert make_tier(ns, directory=tmp_path / "other").extents() == []


def test_a_purge_reaches_every_object_of_its_salt(make_tier: MakeTier) -> None:
    a, b = make_tier(fresh_ns("purge-a")), make_tier(fresh_ns("purge-b"))
    doomed = [salted_store(a, 1, "rc1"), salted_store(b, 2, "rc1")]
    key, kept = salted_store(a, 3, "rc2")
    names = [n for _, objs in doomed for n in objs]
    client: StoreClient = a._client  # type: ignore[attr-defined]
    assert client.exist(names) == [1] * len(names)
    done = a.wait(a.submit_purge("rc1"), 30)
    assert done.ok and done.nbytes == len(names), done
    assert client.exist(names) == [0] * len(names) and client.exist(kept) == [1] * len(kept)
    assert load(b, doomed[1][0], 3 * CHUNK)[0] is Status.MISS
    status, got = load(a, key, 3 * CHUNK)
    assert status is Status.OK and np.array_equal(got, payload_for(3, 3 * CHUNK))


def test_a_real_client_that_does_not_answer_is_one_line(tmp_path: Path) -> None:
    from benchmarks.bench.server_process import free_port

    with pytest.raises(MooncakeUnavailable) as e:
        connect(MooncakeConfig(real_client=f"127.0.0.1:{free_port()}", local_buffer_size=16 * MiB))
    assert "real client" in str(e.value) and "\n" not in str(e.value)


def test_scratch_set_aside_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Transfers given up on again and again (through a real client a master outage answers as a
    lost call does) set scratch aside for good: past `SCRATCH_SPOIL_LIMIT` no more is made (the
    reads needing it fail, OSError, and recompute) rather than the host's memory going."""
    from sgl_hicache.tier.mooncake import scratch as scratch_mod

    monkeypatch.setattr(scratch_mod, "SCRATCH_SPOIL_LIMIT", 3 * 4096)
    made: list[int] = []
    s = scratch_mod.Scratch(lambda b: made.append(b.nbytes), lambda b: None)
    for _ in range(3):
        with s.use(4096):
            s.spoil_if_late([Reply(code=RPC_LOST)])
    assert s.spoiled_bytes == 3 * 4096 and len(made) == 3
    with pytest.raises(scratch_mod.ScratchExhausted, match="set aside"), s.use(4096):
        pass
    assert len(made) == 3  # nothing more was made
    with s.use(0) as none:  # a use that needs no buffer (every piece read in place) still runs
        assert none.nbytes == 0


def test_no_shared_memory_is_a_memory_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mooncake's allocator raises (RuntimeError) or answers 0 when it cannot: either is MemoryError,
    on which the server serves without spill (server/factory.py)."""
    shared = SharedMemory()

    class Refusing:
        def alloc(self, n: int) -> int:
            raise RuntimeError("Failed to create anonymous shared memory")

    class Zero:
        def alloc(self, n: int) -> int:
            return 0

    for allocator in (Refusing(), Zero()):
        monkeypatch.setattr(shared, "_allocator", allocator)
        with pytest.raises(MemoryError, match="could not allocate"):
            shared.alloc(4096)


def test_a_master_outage_behind_the_real_client_sets_nothing_aside(tmp_path: Path) -> None:
    """The master gone while the real client stays up: loads through it fail (the real client's
    request to the master fails: RPC_FAIL, answered at once), and neither the staging they read
    into nor the scratch their headers go through is set aside (nothing was copied): a master
    outage does not eat a standalone server's staging."""
    from benchmarks.bench.mooncake_process import MooncakeMaster

    logs = tmp_path / "logs"
    logs.mkdir()
    with MooncakeMaster(logs) as master, MooncakeRealClient(master, logs, 64 << 20) as real_client:
        cfg = MooncakeConfig(real_client=real_client.address, local_buffer_size=16 * MiB)
        tier = mooncake_backend.MooncakeTier(
            TierConfig(backend=SpillBackend.MOONCAKE, mooncake=cfg, directory=tmp_path / "tier",
                       chunk_bytes=CHUNK, io_threads=2), fresh_ns("outage"))  # fmt: skip
        try:
            keys = [store(tier, i, 2 * CHUNK) for i in range(3)]
            into = staging(tier, 2 * CHUNK)
            master.stop()
            for key in keys:
                done = tier.wait(tier.submit_load(key, into), 60)
                assert not done.ok and not done.dest_unsafe, done
            assert tier._scratch.spoiled_bytes == 0  # type: ignore[attr-defined]
        finally:
            if master.proc is None:  # a dummy closing while the master is away may crash (Mooncake 0.3.13)
                master.start()
            tier.close(10)
