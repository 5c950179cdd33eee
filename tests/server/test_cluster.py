"""Two servers on one tier directory behind sglang's router (issue 15, cross-server reuse).

Servers A and B (our launcher, small device pools, one shared tier directory) and the router
(smg, round robin) in front, shared by the tests of this module. A conversation's turn is answered
by A while its history is resident (the never-evicted reference), A is made to spill it, and the
same turn is then sent through the router twice: one copy lands on A (its own restore), the other
on B, which has never seen the prompt and must find A's extents by lookup, restore them and answer
exactly the same. A deletion by A (its tier evicting) is a clean miss for B.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench.router_process import RouterProcess
from benchmarks.bench.server_process import ServerProcess
from tests.server.conftest import SPILL_FLAGS
from tests.server.test_spill_resume import POOL, counter, generate, push_out, tokens

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    tmp = tmp_path_factory.mktemp("cluster")
    tier = tmp / "tier"
    args = (
        *SPILL_FLAGS,
        "--enable-hicache-spill",
        "--hicache-spill-dir",
        str(tier),
        "--hicache-spill-min-free",
        "0",
    )
    with (
        ServerProcess(tiny_model, POOL, args, log_path=tmp / "a.log") as a,
        ServerProcess(tiny_model, POOL, args, log_path=tmp / "b.log") as b,
        RouterProcess([a.base_url, b.base_url], log_path=tmp / "router.log") as router,
    ):
        yield a, b, router, tier


def test_next_turn_on_the_other_server_is_restored_from_the_tier(cluster: Any) -> None:
    a, b, router, _ = cluster
    turn1 = tokens(1)
    out1, _ = generate(a.base_url, turn1)
    turn2 = turn1 + out1 + tokens(2, 20)
    reference, cached = generate(a.base_url, turn2)  # turn 1 resident: never evicted
    assert cached >= len(turn1)
    push_out(a.base_url, 1)  # A's pool overflows: the conversation is spilled to the shared tier
    assert counter(a.base_url, "spilled_tokens") >= len(turn2) - 8
    answers = [generate(router.base_url, turn2) for _ in range(2)]  # round robin: one on A, one on B
    assert [out for out, _ in answers] == [reference, reference]
    assert all(cached > 0 for _, cached in answers), answers
    assert counter(b.base_url, "lookup_attached_tokens") >= len(turn1)
    assert counter(b.base_url, "restored_tokens") >= len(turn1)
    assert counter(b.base_url, "lookup_refused") == 0


def test_deleted_by_one_server_is_a_clean_miss_for_the_other(cluster: Any) -> None:
    a, b, _, tier = cluster
    turn = tokens(5)
    reference, _ = generate(a.base_url, turn)
    push_out(a.base_url, 5)
    for path in Path(tier).rglob("*.ext"):  # what A's tier does when it evicts: unlink
        path.unlink()
    out, cached = generate(b.base_url, turn)
    assert out == reference
    assert cached == 0
    assert counter(b.base_url, "lookup_stale") > 0
    assert counter(b.base_url, "lookup_refused") == 0
