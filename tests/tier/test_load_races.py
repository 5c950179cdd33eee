"""A load that fails while a store of the same key publishes must not undo that store.

Found by `test_capacity.py::test_random_workload_never_exceeds_capacity[0]` (about 1 run in 30 on a
tmpfs): a load of key K opened its file before K's store published (ENOENT), and its MISS then
"forgot" K from the index after the store had indexed the new file: a published extent that the
index no longer held (never read again, and outside the byte budget until a restart's scan).
"""

from __future__ import annotations

import threading

import sgl_hicache.tier.file.backend as nvme
from sgl_hicache.tier import ROOT_KEY, Status
from sgl_hicache.tier.format import ALIGN
from tests.tier.common import key_for, payload_for, tokens_for


def test_a_miss_that_raced_a_publish_keeps_the_new_extent_indexed(make_tier, monkeypatch) -> None:
    tier = make_tier(io_threads=4)
    opened, release = threading.Event(), threading.Event()
    real_open = nvme.open_extent

    def open_then_wait(*args, **kwargs):  # the load's open fails (ENOENT) before the store publishes
        try:
            return real_open(*args, **kwargs)
        finally:
            opened.set()
            assert release.wait(30)

    monkeypatch.setattr(nvme, "open_extent", open_then_wait)
    load = tier.submit_load(key_for(1), bytearray(5000))
    assert opened.wait(30)
    monkeypatch.setattr(nvme, "open_extent", real_open)
    assert tier.wait(tier.submit_store(key_for(1), payload_for(1, 5000), tokens_for(1), ROOT_KEY), 30).ok
    release.set()
    assert tier.wait(load, 30).status is Status.MISS  # it looked before the file existed
    assert tier.contains(key_for(1)), "the MISS of an older look forgot the newly published extent"
    tier.check_integrity()
    again = bytearray(5000)
    assert tier.wait(tier.submit_load(key_for(1), again), 30).ok and bytes(again) == bytes(
        payload_for(1, 5000)
    )


def test_a_corrupt_read_that_raced_a_republish_keeps_the_new_extent(make_tier, tmp_path, monkeypatch) -> None:
    """A load reads a corrupt copy of K through the descriptor it opened; meanwhile that file is
    gone and K's store publishes a good one. The load's CORRUPT must drop only what it read."""
    tier = make_tier(directory=tmp_path / "tier", io_threads=4)
    assert tier.wait(tier.submit_store(key_for(1), payload_for(1, 5000), tokens_for(1), ROOT_KEY), 30).ok
    path = next((tmp_path / "tier").rglob(f"{key_for(1).hex()}.ext"))
    data = bytearray(path.read_bytes())
    data[ALIGN + 100] ^= 0xFF  # a payload byte (after the header block): its checksum fails
    path.write_bytes(data)
    opened, release = threading.Event(), threading.Event()
    real_read = nvme.read_chunk

    def wait_then_read(*args, **kwargs):
        opened.set()
        assert release.wait(30)
        return real_read(*args, **kwargs)

    monkeypatch.setattr(nvme, "read_chunk", wait_then_read)
    load = tier.submit_load(key_for(1), bytearray(5000))
    assert opened.wait(30)  # the load holds the corrupt file open
    monkeypatch.setattr(nvme, "read_chunk", real_read)
    path.unlink()  # gone (e.g. another process's eviction): the store below writes K anew
    assert tier.wait(tier.submit_store(key_for(1), payload_for(1, 5000), tokens_for(1), ROOT_KEY), 30).ok
    assert path.exists()
    release.set()
    assert tier.wait(load, 30).status is Status.CORRUPT  # what it read was bad
    assert path.exists() and tier.contains(key_for(1)), "the corrupt read removed the new extent"
    tier.check_integrity()
    again = bytearray(5000)
    assert tier.wait(tier.submit_load(key_for(1), again), 30).ok and bytes(again) == bytes(
        payload_for(1, 5000)
    )
