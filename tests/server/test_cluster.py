"""Two servers sharing one tier behind sglang's router (issues 15 and 26, cross-server reuse).

Servers A and B (our launcher, small device pools) and the router (smg, round robin) in front,
shared by the tests of this module, once per backend: one tier directory (`file`), or one Mooncake
Store (`mooncake`: a real master on loopback, each server a client with its own segment, the
secret of their common `--hicache-spill-dir`; skipped without the Mooncake client). A
conversation's turn is answered by A while its history is resident (the never-evicted reference),
A is made to spill it, and the same turn is then sent through the router twice: one copy lands on
A (its own restore), the other on B, which has never seen the prompt and must find A's extents by
lookup, restore them and answer exactly the same. Extents gone from the tier (a file tier's
eviction unlinks them; on Mooncake the master evicts them or another client removes them) are a
clean miss for B.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from benchmarks.bench.router_process import RouterProcess
from benchmarks.bench.server_process import ServerProcess
from sgl_hicache.config import MooncakeConfig
from tests.server.conftest import SPILL_FLAGS
from tests.server.greedy import Answer, mismatch
from tests.server.test_spill_resume import POOL, counter, generate, generate_full, push_out, tokens

pytestmark = pytest.mark.server

# an extent's header and chunk objects, of any salt (tier/mooncake/client.py), not its aliases
EXTENT_OBJECTS = r"^sglhc2/[0-9a-f]{32}/(-|[0-9a-f]{32})/[0-9a-f]{32}(\.[0-9a-f]{16}\.[0-9]+)?$"


@dataclasses.dataclass
class Cluster:
    a: ServerProcess
    b: ServerProcess
    router: RouterProcess
    remove_extents: Callable[[], int]  # every extent's data gone from the tier (aliases stay): how many


def unlink_extents(tier: Path) -> int:
    """What A's file tier does when it evicts: unlink the extent files."""
    paths = list(tier.rglob("*.ext"))
    for path in paths:
        path.unlink()
    return len(paths)


def remove_objects(cfg: MooncakeConfig) -> int:
    """What the master's eviction or another client's removal does: a third client of the store
    (no segment of its own) removes every extent's header and chunks, of every namespace (the
    session's master holds nothing another test still needs then)."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(
        cfg.local_hostname, cfg.metadata_server, 0, cfg.local_buffer_size, cfg.protocol, "", cfg.master
    )
    assert rc == 0, f"a third Mooncake client could not join (code {rc})"
    try:
        return int(store.remove_by_regex(EXTENT_OBJECTS, True))
    finally:
        store.close()


@pytest.fixture(
    scope="module",
    # Mooncake: a repeat on the other backend (test_mooncake_server.py runs it through a server in CI)
    params=["file", pytest.param("mooncake", marks=pytest.mark.slow)],
)
def cluster(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp(f"cluster-{request.param}")
    tier = tmp / "tier"  # on Mooncake, where the secret both servers seal headers with lives
    args: tuple[str, ...] = (*SPILL_FLAGS, "--enable-hicache-spill", "--hicache-spill-dir", str(tier),
                             "--hicache-spill-min-free", "0")  # fmt: skip
    remove = functools.partial(unlink_extents, tier)
    if request.param == "mooncake":  # the session's master; skips without the Mooncake client
        cfg = request.getfixturevalue("mooncake_master").config(segment_bytes=64 << 20)
        settings = {k: v for k, v in dataclasses.asdict(cfg).items() if v}
        args += (
            "--hicache-spill-backend",
            "mooncake",
            "--hicache-spill-mooncake-config",
            json.dumps(settings),
        )
        remove = functools.partial(remove_objects, cfg)
    with (
        ServerProcess(tiny_model, POOL, args, log_path=tmp / "a.log") as a,
        ServerProcess(tiny_model, POOL, args, log_path=tmp / "b.log") as b,
        RouterProcess([a.base_url, b.base_url], log_path=tmp / "router.log") as router,
    ):
        yield Cluster(a, b, router, remove)


def test_next_turn_on_the_other_server_is_restored_from_the_tier(cluster: Cluster) -> None:
    a, b = cluster.a.base_url, cluster.b.base_url
    turn1 = tokens(1)
    out1, _ = generate(a, turn1)
    turn2 = turn1 + out1 + tokens(2, 20)
    reference = Answer.of(generate_full(a, turn2, top2=True))  # turn 1 resident: never evicted
    assert reference.cached_tokens >= len(turn1)
    push_out(a, 1)  # A's pool overflows: the conversation is spilled to the shared tier
    assert counter(a, "spilled_tokens") >= len(turn2) - 8
    # round robin: one on A, one on B; each must reuse all the reference did (the whole conversation
    # was spilled), so no difference is a near-tie of a recompute (tests/server/greedy.py)
    answers = [Answer.of(generate_full(cluster.router.base_url, turn2)) for _ in range(2)]
    failures = [mismatch(f"answer {k} through the router", reference, answer, reference.cached_tokens)
                for k, answer in enumerate(answers)]  # fmt: skip
    assert failures == [None, None], failures
    assert counter(b, "lookup_attached_tokens") >= len(turn1)
    assert counter(b, "restored_tokens") >= len(turn1)
    assert counter(b, "lookup_refused") == 0


def test_deleted_from_the_tier_is_a_clean_miss_for_the_other(cluster: Cluster) -> None:
    a, b = cluster.a.base_url, cluster.b.base_url
    turn = tokens(5)
    reference = Answer.of(generate_full(a, turn))
    push_out(a, 5)
    assert cluster.remove_extents() > 0
    answer = Answer.of(generate_full(b, turn))
    assert answer.cached_tokens == 0
    assert mismatch("B, all recomputed", reference, answer) is None  # as A computed it: no near-tie
    assert counter(b, "lookup_stale") > 0
    assert counter(b, "lookup_refused") == 0
