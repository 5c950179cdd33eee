"""Where the Mooncake tier's objects live (`MooncakeConfig.placement`, issue 40), on a real master.

An object in the reader's own segment is read by a memory copy, one in another client's over the
transfer engine (several times slower on one host, docs/RESULTS.md). `any` (the default) leaves
placement to the master; `local` asks it for the writer's own segment first and falls back to
another segment when that one is full. Each test has a `holder` beside the tier: a client with a
larger segment, where the master's own choice would put many objects.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from sgl_hicache.config import MooncakeConfig
from sgl_hicache.tier import IndexedTier, Status
from sgl_hicache.tier.mooncake import backend as mooncake_backend
from sgl_hicache.tier.mooncake.client import StoreClient, connect
from tests.tier import test_mooncake
from tests.tier.common import CHUNK, payload_for
from tests.tier.test_mooncake import MakeTier, extent_objects, fresh_ns, load, store

master, make_tier, holder = test_mooncake.master, test_mooncake.make_tier, test_mooncake.holder  # fixtures


def all_objects(tier: IndexedTier, keys: list[Any]) -> list[str]:
    out: list[str] = []
    for key in keys:
        header, chunks = extent_objects(tier, key)
        out += [header, *chunks]
    return out


def test_local_placement_puts_every_object_in_the_writers_own_segment(
    make_tier: MakeTier, holder: StoreClient
) -> None:
    """The headers and chunks of a tier with room in its segment are all there (the master alone
    spread objects over both segments, measured: 6 of 16 in the other's), and load exactly."""
    tier = make_tier(fresh_ns("local"), segment_bytes=64 << 20, placement="local")
    client: StoreClient = tier._client  # type: ignore[attr-defined]
    assert client.segment  # its own segment's name, as the master knows it
    keys = [store(tier, i, 3 * CHUNK + 1 + i) for i in range(12)]
    names = all_objects(tier, keys)
    assert len(names) == 12 * 5
    assert holder.endpoints_of(names) == [[client.segment]] * len(names)
    for i, key in enumerate(keys):
        status, got = load(tier, key, 3 * CHUNK + 1 + i)
        assert status is Status.OK and np.array_equal(got, payload_for(i, 3 * CHUNK + 1 + i))


def test_a_full_own_segment_falls_back_to_another(make_tier: MakeTier, holder: StoreClient) -> None:
    """Stores go on when the writer's segment is full (the master places them elsewhere): every
    store succeeds and loads exactly, wherever its objects went."""
    tier = make_tier(fresh_ns("fallback"), segment_bytes=16 << 20, placement="local")  # 16M: Mooncake's least
    own: str = tier._client.segment  # type: ignore[attr-defined]
    nbytes = 32 * CHUNK  # 2 MiB: 12 of them overflow 16 MiB
    keys = [store(tier, i, nbytes) for i in range(12)]
    where = [holder.endpoints_of(extent_objects(tier, k)[1]) for k in keys]
    assert where[0] == [[own]] * 32  # the first went to its own segment
    assert all(s and s != [own] for s in where[-1]), where  # the last found no room there
    for i, key in enumerate(keys):
        status, got = load(tier, key, nbytes)
        assert status is Status.OK and np.array_equal(got, payload_for(i, nbytes))


class RecordingStore:
    """A client's real store, each write's replica request recorded: (method, copies, preferred
    segment), ("", when the write passed no `ReplicateConfig`: the binding's default)."""

    WRITES = ("upsert_from", "batch_upsert_from", "upsert", "upsert_batch", "put")

    def __init__(self, real: Any, seen: list[tuple[str, int, str]]) -> None:
        self._real, self._seen = real, seen

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._real, name)
        if name not in self.WRITES:
            return method

        def call(*args: Any) -> Any:
            cfg = args[-1] if args and type(args[-1]).__name__ == "ReplicateConfig" else None
            copies, preferred = (1, "") if cfg is None else (cfg.replica_num, cfg.preferred_segment)
            self._seen.append((name, copies, preferred))
            return method(*args)

        return call


@pytest.mark.parametrize("placement", ["local", "any"])
def test_placement_is_what_each_write_asks_the_master_for(
    make_tier: MakeTier, monkeypatch: pytest.MonkeyPatch, placement: str
) -> None:
    """`local`: every single-copy write (chunks, header, aliases) names the client's own segment as
    preferred; `any` names none (the master's strategy decides); a write of several copies (the
    manifest's records) names none either way (spread, so that one client leaving takes none)."""
    seen: list[tuple[str, int, str]] = []

    def recording(cfg: MooncakeConfig) -> StoreClient:
        client = connect(cfg)
        return StoreClient(RecordingStore(client._store, seen), client.segment)

    monkeypatch.setattr(mooncake_backend, "connect", recording)
    tier = make_tier(fresh_ns(f"asks-{placement}"), segment_bytes=32 << 20, placement=placement)
    own: str = tier._client.segment  # type: ignore[attr-defined]
    assert bool(own) == (placement == "local")
    for i in range(3):
        store(tier, i, 3 * CHUNK)
    tier.close(5)  # the manifest's records written
    single = [(name, preferred) for name, copies, preferred in seen if copies == 1]
    assert {name for name, _ in single} >= {"batch_upsert_from", "upsert"}, seen
    assert {preferred for _, preferred in single} == {own}, seen
    several = [preferred for _, copies, preferred in seen if copies > 1]
    assert several and set(several) == {""}, seen


def test_a_client_without_a_segment_prefers_none(make_tier: MakeTier) -> None:
    """A client that gives the store no memory has no segment to prefer: placement is the master's."""
    tier = make_tier(fresh_ns("no-segment"), segment_bytes=0, placement="local")
    assert tier._client.segment == ""  # type: ignore[attr-defined]
