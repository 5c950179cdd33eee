"""Flushes and weight updates on the real server never bring back KV computed before them (issue 11).

One server (tiny model, small pool, spill on) serves both tests in file order. A conversation is
spilled, then sglang's own `/flush_cache`, or `/update_weights_from_disk` with a model of other weights,
runs; the resumed turn must restore nothing from the tier, and after the weight update its output must
be the new weights' (a salted request, which no cache entry can serve, is the reference).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench.server_process import ServerProcess
from tests.server.conftest import SPILL_FLAGS, post_json
from tests.server.test_spill_resume import POOL, counter, generate, push_out, tokens

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` architecture with other weights (seed 1)."""
    from benchmarks.modelgen import generate_model

    return generate_model(tmp_path_factory.mktemp("models") / "tiny-seed1", "tiny", seed=1)


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("flush")
    args = (*SPILL_FLAGS, "--enable-hicache-spill", "--hicache-spill-dir", str(tmp / "tier"),
            "--hicache-spill-min-free", "0")  # fmt: skip
    with ServerProcess(tiny_model, POOL, args, log_path=tmp / "server.log") as s:
        yield s


def spilled_conversation(base: str, seed: int) -> list[int]:
    """Turn 1 served, then pushed out of the pool (spilled): returns turn 2's prompt."""
    turn1 = tokens(seed)
    out1, _ = generate(base, turn1)
    spilled = counter(base, "spilled_tokens")
    push_out(base, seed)
    assert counter(base, "spilled_tokens") > spilled, "turn 1 was not spilled"
    return turn1 + out1 + tokens(seed + 1, 20)


def test_flush_cache_endpoint_never_serves_kv_from_before_it(server: ServerProcess) -> None:
    base = server.base_url
    turn2 = spilled_conversation(base, 201)
    reference, _ = generate(base, turn2, salt="flush-reference")
    flushes, restored = counter(base, "flushes"), counter(base, "restored_tokens")
    with urllib.request.urlopen(
        urllib.request.Request(base + "/flush_cache", method="POST"), timeout=60
    ) as r:
        assert r.status == 200
    assert counter(base, "flushes") == flushes + 1
    _, cached = generate(base, turn2)
    assert cached == 0 and counter(base, "restored_tokens") == restored, "KV from before the flush was served"
    push_out(base, 202)  # spilled again after the flush, restored from the new epoch's extents
    again, cached_again = generate(base, turn2)
    assert counter(base, "restored_tokens") > restored and cached_again > 0 and again == reference


def test_weight_update_never_serves_kv_of_the_old_weights(server: ServerProcess, other_model: Path) -> None:
    base = server.base_url
    turn2 = spilled_conversation(base, 301)
    restored = counter(base, "restored_tokens")
    old, _ = generate(base, turn2, salt="old-weights")
    reply: dict[str, Any] = post_json(
        base + "/update_weights_from_disk", {"model_path": str(other_model), "flush_cache": True}
    )
    assert reply["success"], reply
    resumed, cached = generate(base, turn2)
    reference, ref_cached = generate(base, turn2, salt="no-cache-entry-has-this-salt")
    assert ref_cached == 0
    assert cached == 0 and counter(base, "restored_tokens") == restored, "KV of the old weights was served"
    assert resumed == reference
    assert reference != old, "the weight update did not change the model's output"
    # The same conversation spilled again under the new weights must restore the new KV, never the
    # old file of the same tokens (a key that did not change with the weights would find it "present").
    push_out(base, 302)
    again, cached_again = generate(base, turn2)
    assert counter(base, "restored_tokens") > restored, "the re-spilled conversation was not restored"
    assert cached_again > 0 and again == reference
