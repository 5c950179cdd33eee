"""`MooncakeRealClient` (benchmarks/bench/mooncake_process.py), the `mooncake_client` of the standalone
configurations of `--servers 2`, against a real master on loopback: a client in Mooncake's
standalone mode (`setup_dummy`, as each server joins) stores and reads an object through it, and
stopping it leaves no process of its group; one that exits at once is a ServerStartError."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench import mooncake_process
from benchmarks.bench.mooncake_process import MooncakeRealClient
from benchmarks.bench.server_process import ServerStartError, group_alive
from tests.mooncake_master import MooncakeMaster, skip_without_mooncake

skip_without_mooncake()


@pytest.fixture
def real_client(tmp_path: Path) -> Iterator[MooncakeRealClient]:
    """On a master of its own: a real client stopped by an earlier test may still hold a segment at
    a shared master for a while (until its lease runs out), where a put may land and fail."""
    with (
        MooncakeMaster(tmp_path) as master,
        MooncakeRealClient(master, tmp_path, segment_bytes=64 << 20) as client,
    ):
        yield client


@pytest.fixture
def dummy(real_client: MooncakeRealClient) -> Iterator[Any]:
    """A client of the store in standalone mode, joined through `real_client` (closed before it)."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    assert store.setup_dummy(0, 16 << 20, real_client.address) == 0
    yield store
    store.close()


def test_a_standalone_client_stores_and_reads_an_object_through_the_real_client(dummy: Any) -> None:
    key, value = f"real-client-{uuid.uuid4().hex}", os.urandom(4096)
    assert dummy.upsert(key, value) == 0
    assert dummy.get(key) == value


def test_the_real_client_maps_only_whole_allocations(dummy: Any) -> None:
    """Why `hicache-mooncake-standalone` cannot run (`cluster.UNAVAILABLE`): sglang registers an MHA
    host pool's K and V halves apart, each refused, where the whole allocation would be taken and
    serve a call on any part of it. When this fails, Mooncake has changed: try that configuration."""
    from mooncake.store import MooncakeHostMemAllocator

    half = 1 << 20
    allocator = MooncakeHostMemAllocator()
    ptr = allocator.alloc(2 * half)
    try:
        assert dummy.register_buffer(ptr, half) != 0 and dummy.register_buffer(ptr + half, half) != 0
        assert dummy.register_buffer(ptr, 2 * half) == 0
        key = f"real-client-{uuid.uuid4().hex}"
        assert dummy.batch_put_from([key], [ptr + half], [4096]) == [0]
        assert dummy.unregister_buffer(ptr) == 0
    finally:
        allocator.free(ptr)


def test_stopping_the_real_client_leaves_no_process(real_client: MooncakeRealClient) -> None:
    assert real_client.proc is not None
    pgid = real_client.proc.pid
    assert group_alive(pgid) and real_client.command()[0].endswith("mooncake/mooncake_client")
    real_client.stop()
    assert real_client.proc is None and not group_alive(pgid)
    used = float((real_client.log_dir / "cpu_seconds").read_text())  # what it took, logged as it went
    assert 0 < used < 60


def test_a_real_client_that_exits_at_once_is_a_start_error(
    mooncake_master: MooncakeMaster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mooncake_process, "real_client_binary", lambda: Path("/bin/false"))
    client = MooncakeRealClient(mooncake_master, tmp_path)
    with pytest.raises(ServerStartError, match="mooncake_client did not start"):
        client.start()
    assert client.proc is None
