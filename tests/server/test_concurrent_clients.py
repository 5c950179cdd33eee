"""Several concurrent multi-turn clients on a small pool; the cache's own integrity check stays clean.

The scheduler's state is read through `GET /server_info` (`internal_states[0]["hicache_spill"]`),
which our read-only hook (`sgl_hicache.server.hooks`) adds: this also proves that hook still holds
for the pinned sglang version.
"""

from __future__ import annotations

import json
import random
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import post_json

pytestmark = pytest.mark.server


def spill_state(base: str) -> dict[str, Any]:
    with urllib.request.urlopen(base + "/server_info", timeout=60) as r:
        info = json.loads(r.read())
    state: dict[str, Any] = info["internal_states"][0]["hicache_spill"]
    return state


def client(base: str, seed: int, turns: int = 4) -> list[int]:
    rng = random.Random(seed)
    history = [rng.randrange(20, 900) for _ in range(rng.randrange(100, 250))]
    cached = []
    for _ in range(turns):
        out = post_json(
            base + "/generate",
            {"input_ids": history, "sampling_params": {"max_new_tokens": 6, "temperature": 0}},
        )
        cached.append(out["meta_info"]["cached_tokens"])
        history = history + out["output_ids"] + [rng.randrange(20, 900) for _ in range(rng.randrange(10, 60))]
    return cached


def test_concurrent_clients_end_with_a_clean_integrity_check(
    tiny_model: Path, tmp_path: Path, start_server: Any
) -> None:
    server = start_server(tiny_model, "--enable-hicache-spill", "--hicache-spill-dir", str(tmp_path / "tier"),
                          "--hicache-spill-min-free", "0", max_total_tokens=1024,
                          env={"SGL_HICACHE_REPORT_INTEGRITY": "1"})  # fmt: skip
    assert spill_state(server.base_url)["integrity"] == "ok"
    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(lambda s: client(server.base_url, s), range(12)))
    assert all(len(r) == 4 for r in results)
    state = spill_state(server.base_url)
    assert state["integrity"] == "ok", state["integrity"]
    counters = state["counters"]
    assert counters["spilled_tokens"] > 0 and counters["restored_tokens"] > 0, counters
    assert state["tier"]["extents"] > 0 and state["staging_used_bytes"] >= 0
