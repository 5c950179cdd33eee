"""Two servers writing through to one tier directory (`--hicache-spill-write-policy write_through`):
a conversation whose history is still resident on server A, never evicted, goes on at server B,
which has never seen it. Under write-back the tier would hold nothing of it (B recomputes, as
`test_cluster.py` shows before A evicts); written through, B finds A's KV by lookup, restores it
and answers exactly as A does from its resident copy (greedy, the differential), but for a flip at a
measured near-tie in what B recomputes (`tests/server/greedy.py`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench.probe import spill_state
from benchmarks.bench.server_process import ServerProcess
from tests.server.conftest import SPILL_FLAGS
from tests.server.greedy import Answer, mismatch
from tests.server.test_spill_resume import POOL, counter, generate, generate_full, tokens

pytestmark = [pytest.mark.server, pytest.mark.slow]  # test_cluster.py covers the write-back pair


@pytest.fixture(scope="module")
def pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    tmp = tmp_path_factory.mktemp("write_through")
    args = (*SPILL_FLAGS, "--enable-hicache-spill", "--hicache-spill-dir", str(tmp / "tier"),
            "--hicache-spill-min-free", "0", "--hicache-spill-write-policy", "write_through")  # fmt: skip
    with (
        ServerProcess(tiny_model, POOL, args, log_path=tmp / "a.log") as a,
        ServerProcess(tiny_model, POOL, args, log_path=tmp / "b.log") as b,
    ):
        yield a, b


def test_a_history_resident_on_a_is_restored_on_b_with_the_same_answer(pair: Any) -> None:
    a, b = pair
    turn1 = tokens(1)
    out1, _ = generate(a.base_url, turn1)
    turn2 = turn1 + out1 + tokens(2, 20)
    settled(a.base_url)  # A's write-through of turn 1's decode-made tokens too: B recomputes none of A's hit
    moved = Answer.of(generate_full(b.base_url, turn2))  # B never saw turn 1: A's extents, by lookup
    reference = Answer.of(generate_full(a.base_url, turn2, top2=True))  # A: turn 1 resident, never evicted
    assert reference.cached_tokens >= len(turn1)
    assert counter(a.base_url, "evicted_tokens") == 0  # nothing of A's was ever evicted
    assert counter(a.base_url, "written_through_tokens") >= len(turn1)
    # B finds what lookups can name (aliases every lookup block): turn 1 but a partial last block,
    # not A's decode-made tail, which B recomputes: a flip at a near-tie there is no bug (greedy.py)
    failure = mismatch("turn 2 on B", reference, moved, min_hit=len(turn1) - 16)
    assert failure is None, failure
    assert counter(b.base_url, "lookup_attached_tokens") >= len(turn1) - 16
    assert counter(b.base_url, "restored_tokens") >= len(turn1) - 16
    assert counter(b.base_url, "lookup_refused") == 0


def settled(base: str, timeout_s: float = 60.0) -> None:
    """Wait until the server has no tier write in flight."""
    deadline = time.monotonic() + timeout_s
    while spill_state(base)["writes_in_flight"]:
        assert time.monotonic() < deadline, "writes still in flight"
        time.sleep(0.2)
