"""The model-based cache test (test_stateful.py) with both caches on one Mooncake Store (issue 26).

`TwoCachesOneDirectory`'s rules (requests, evictions, prefetches, flushes, restarts, cross-server
lookups) drive two caches whose tier is a `MooncakeTier` on the session's real master; after every
step every resident slot must hold exactly its reference KV. Tampering acts on the store's objects
instead of files: another client removes an extent's header or a chunk, flips a byte of a chunk,
or puts another extent's (sealed) header under a key. Retention hints are the file machine's,
purges included (issue 40: a purge by salt reaches the store). A restart finds the extents its
namespace stored through the store's manifest (a warm start, as from files).

Each hypothesis example gets a tier directory, hence a secret, of its own: objects an earlier
example left in the store (same namespace, same keys) are foreign to it, refused on load and
replaced on store. Clients are reused across examples (`ReusedClientNoClose`: a Mooncake client
takes ~2 s to leave the store, which would dominate the run); at most two tiers use them at once.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

from sgl_hicache.config import MooncakeConfig, SpillBackend, TierConfig
from sgl_hicache.tier.mooncake import backend as mooncake_tier
from sgl_hicache.tier.mooncake import objects
from sgl_hicache.tier.mooncake.client import Names, StoreClient, connect
from tests.cache.conftest import Stack, build_stack
from tests.cache.test_stateful import RARE, TwoCachesOneDirectory
from tests.mooncake_master import MooncakeMaster

EXAMPLES = max(2, int(os.environ.get("SGL_HICACHE_FUZZ_EXAMPLES", "20")) // 2)
STEPS = 100
CLIENTS: list[StoreClient] = []
MASTER: list[MooncakeMaster] = []


class ReusedClientNoClose(StoreClient):
    """A client a test hands to tier after tier: `close` leaves it open (the module closes it)."""

    def close(self) -> None:
        pass

    def really_close(self) -> None:
        super().close()


@contextlib.contextmanager
def reused_clients(config: MooncakeConfig) -> Iterator[None]:
    """Two clients of `config`'s store handed to tier after tier (`CLIENTS`), closed at the end."""
    clients = [connect(config) for _ in range(2)]
    reused = [ReusedClientNoClose(c._store, c.segment, c._shared) for c in clients]
    turn = itertools.cycle(reused)
    patch = pytest.MonkeyPatch()
    patch.setattr(mooncake_tier, "connect", lambda cfg: next(turn))
    CLIENTS[:] = reused
    try:
        yield
    finally:
        patch.undo()
        for client in reused:
            client.really_close()
        CLIENTS.clear()


@pytest.fixture(scope="module", autouse=True)
def mooncake_clients(mooncake_master: MooncakeMaster) -> Iterator[None]:
    MASTER[:] = [mooncake_master]
    with reused_clients(mooncake_master.config(segment_bytes=32 << 20)):
        yield


class TwoCachesOnMooncake(TwoCachesOneDirectory):
    def _stack(self) -> Stack:
        tier = TierConfig(backend=SpillBackend.MOONCAKE, mooncake=MASTER[0].config(), directory=self.dir / "tier",
                          chunk_bytes=4096, io_threads=2)  # fmt: skip
        return build_stack(
            self.dir / "tier", size=self.pool_tokens, page_size=self.page_size, write_policy=self.write_policy,
            kv_events=True, tier=tier, admission=self.admission[0], admission_min_tokens=self.admission[1],
        )  # fmt: skip

    def _spilled_keys(self) -> list[bytes]:
        from sgl_hicache.cache.spill_state import ExtentState

        keys = set()
        for server in self.servers:
            stack = list(server.stack.cache.root_node.children.values())
            while stack:
                node = stack.pop()
                ref = getattr(node, "spill", None)
                if ref is not None and ref.extent.state is ExtentState.ON_TIER:
                    keys.add(bytes(ref.extent.key))
                stack.extend(node.children.values())
        return sorted(keys)

    @rule(pick=st.integers(0, 10**6), how=st.sampled_from(["header", "chunk", "flip", "borrow"]), roll=RARE)
    def another_process_tampers(self, pick: int, how: str, roll: int) -> None:  # type: ignore[override]
        keys = self._spilled_keys()
        if not keys or roll:
            return
        self.tampered = True
        client, key = CLIENTS[pick % 2], keys[pick % len(keys)]
        header, chunks = self._objects(key)
        if how == "header":
            client.remove(header)
        elif how == "chunk" and chunks:
            client.remove(chunks[0])
        elif how == "flip" and chunks:
            data = client.get(chunks[0])
            if data:
                flipped = bytearray(data)
                flipped[pick % len(flipped)] ^= 0x5A
                client.write(chunks[0], bytes(flipped))
        elif how == "borrow":
            other = keys[(pick + 1) % len(keys)]
            borrowed = client.get(self._objects(other)[0])
            if borrowed and other != key:
                client.write(header, borrowed)

    def _objects(self, key: bytes) -> tuple[str, list[str]]:
        """The names of `key`'s header (in the directory of its salt, as a server that spilled it
        knows it) and of the chunks that header names now (none if it does not verify)."""
        tiers = [s.stack.cache.controller.tier for s in self.servers]
        tier: Any = next((t for t in tiers if t.contains(key)), tiers[0])
        salt = tier._salt(key)
        names: Names = tier._names
        try:
            ext = objects.open_header(
                tier._client, names, tier.namespace.id, key, salt, tier._seal, tier._scratch
            )
        except (OSError, ValueError):  # gone or tampered already
            return names.header(key, salt), []
        return names.header(key, salt), ext.chunk_names(names)

    @rule(which=st.integers(0, 1))
    def a_foreign_evictor_then_this_cache_evicts(self, which: int) -> None:
        """Not on Mooncake: the master's eviction and another client's removal are the tampering above."""


_SETTINGS = settings(
    max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)  # fmt: skip
TestTwoCachesOnMooncake = TwoCachesOnMooncake.TestCase
TestTwoCachesOnMooncake.settings = _SETTINGS


def test_the_machine_runs_on_mooncake() -> None:
    """The clients the machine's tiers use are the store's (not a file tier by mistake)."""
    from sgl_hicache.tier.mooncake.backend import MooncakeTier

    machine: Any = TwoCachesOnMooncake()
    try:
        assert all(isinstance(s.stack.cache.controller.tier, MooncakeTier) for s in machine.servers)
    finally:
        machine.teardown()
