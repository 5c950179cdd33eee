"""The model-based cache test on a Mooncake Store joined through a real client (issue 40): the
machine of test_stateful_mooncake.py (two caches on one store, tampering by another client,
restarts with a warm start, purges), each cache's tier a dummy of one `mooncake_client`
(Mooncake's standalone mode, `MooncakeConfig.real_client`), its staging the real client's shared
memory, registered, so that spills and restores go by the real client's copies in place. After
every step every resident slot must hold exactly its reference KV.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from benchmarks.bench.mooncake_process import MooncakeRealClient
from sgl_hicache.config import MiB, MooncakeConfig, SpillBackend, TierConfig
from tests.cache import test_stateful_mooncake as on_master
from tests.cache.conftest import Stack, build_stack

CONFIG: list[MooncakeConfig] = []


@pytest.fixture(scope="module", autouse=True)
def real_client_clients(mooncake_real_client: MooncakeRealClient) -> Iterator[None]:
    """Two dummies of the session's real client, handed to tier after tier (as on the master)."""
    CONFIG[:] = [MooncakeConfig(real_client=mooncake_real_client.address, local_buffer_size=16 * MiB)]
    with on_master.reused_clients(CONFIG[0]):
        yield


class TwoCachesOnRealClient(on_master.TwoCachesOnMooncake):
    def _stack(self) -> Stack:
        tier = TierConfig(backend=SpillBackend.MOONCAKE, mooncake=CONFIG[0], directory=self.dir / "tier",
                          chunk_bytes=4096, io_threads=2)  # fmt: skip
        return build_stack(
            self.dir / "tier", size=self.pool_tokens, page_size=self.page_size, write_policy=self.write_policy,
            kv_events=True, tier=tier, admission=self.admission[0], admission_min_tokens=self.admission[1],
            staging_bytes=16 * MiB,
        )  # fmt: skip


TestTwoCachesOnRealClient = TwoCachesOnRealClient.TestCase
TestTwoCachesOnRealClient.settings = on_master._SETTINGS


def test_the_machine_stages_in_the_real_clients_memory() -> None:
    """Each cache's staging is shared memory the real client maps (not anonymous memory by mistake):
    a transfer goes straight into and out of it."""
    machine = TwoCachesOnRealClient()
    try:
        for server in machine.servers:
            controller = server.stack.cache.controller
            assert controller.tier._client.addressable(controller.staging.arena)
    finally:
        machine.teardown()
