"""sglang's own HiCache (host L2 + `file` L3) on CPU with our compat patches, on the real server.

Conversation A is served, then pushed out of the device pool (1024 tokens) and the host pool
(1.5 x 1024) by other traffic; A's next turn must come back from the storage tier with the same
greedy tokens it got while A was resident.
"""

from __future__ import annotations

import json
import random
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from sgl_hicache_cpu.hicache_cpu_compat import ENV_VAR

from benchmarks.bench.server_process import CPU_FLAGS, ServerProcess
from tests.server.conftest import lines_of_ours, post_json

pytestmark = pytest.mark.server

POOL = 1024  # device KV pool, tokens
HOST_RATIO = 1.5  # host pool: 1536 tokens (+ one padding page)
PROMPT = 300  # above sglang's default L3 prefetch threshold (256 tokens)
PUSH_PROMPTS = 12  # 3600 tokens of other traffic: more than device + host hold
HICACHE_FLAGS = (
    "--enable-hierarchical-cache",
    "--hicache-io-backend", "direct",
    "--hicache-mem-layout", "layer_first",
    "--hicache-ratio", str(HOST_RATIO),
    "--hicache-storage-backend", "file",
    # Wait for the whole L3 read, so the hit length does not depend on the machine's load.
    "--hicache-storage-prefetch-policy", "wait_complete",
)  # fmt: skip


def tokens(seed: int, n: int = PROMPT) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(20, 1000) for _ in range(n)]


def generate(base: str, ids: list[int], n: int = 8) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}}
    return post_json(base + "/generate", body)


def storage_hits_total(base: str) -> float:
    """`sglang:cached_tokens_total{cache_source="storage"}` (0 before the first storage hit)."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    pattern = r'^sglang:cached_tokens_total\{[^}]*cache_source="storage"[^}]*\} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, flags=re.M))


@pytest.fixture(scope="module")
def hicache_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One server for the module; once it is stopped, its log names nothing of ours (the plugin is
    loaded in each of its processes but was not selected)."""
    tmp = tmp_path_factory.mktemp("hicache")
    storage = tmp / "l3"
    env = {ENV_VAR: "1", "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(storage)}
    args = (*CPU_FLAGS, "--enable-metrics", "--enable-cache-report", *HICACHE_FLAGS)
    server = ServerProcess(
        tiny_model, POOL, args, module="sglang.launch_server", log_path=tmp / "server.log", env=env
    )
    with server:
        server.storage_dir = storage  # type: ignore[attr-defined]
        yield server
    assert lines_of_ours(tmp / "server.log") == []


# Out of `make test` for now: in one of three full-suite runs on 2 December (and every time when the
# setup first waited for HiCache's storage backup) the resumed turn had no cached tokens at all; it
# passes alone. Not understood yet (sglang's own HiCache on CPU, the bench's peer, not our cache).
@pytest.mark.slow
def test_turn_evicted_from_device_and_host_resumes_from_file_storage(hicache_server: Any) -> None:
    base = hicache_server.base_url
    turn1 = tokens(1)
    out1 = generate(base, turn1)["output_ids"]
    turn2 = turn1 + out1 + tokens(2, 20)
    resident = generate(base, turn2)
    assert resident["meta_info"]["cached_tokens"] >= len(turn1)  # A was resident (device or host)

    for k in range(PUSH_PROMPTS):
        generate(base, tokens(1000 + k), n=1)
    hits_before = storage_hits_total(base)
    resumed = generate(base, turn2)

    assert resumed["output_ids"] == resident["output_ids"]
    details = resumed["meta_info"]["cached_tokens_details"]
    assert details["device"] == 0 and details["host"] == 0, details  # pushed out of both pools
    assert details["storage"] >= len(turn1), details
    assert details["storage_backend"] == "HiCacheFile"
    assert resumed["meta_info"]["cached_tokens"] == details["storage"]
    assert storage_hits_total(base) - hits_before == details["storage"]
    assert len(list(hicache_server.storage_dir.glob("*.bin"))) >= details["storage"]  # one file per page


@pytest.mark.slow  # a control: test_plugin.py checks per process that unselected schedulers get no hook
def test_none_of_our_hooks_is_applied_where_our_backend_was_not_selected(hicache_server: Any) -> None:
    """Issues 24 and 28: only the compat patches asked for by the variable; no route, no state of ours."""
    base = hicache_server.base_url
    with urllib.request.urlopen(base + "/server_info", timeout=60) as r:
        states = json.loads(r.read())["internal_states"]
    assert states and all("hicache_spill" not in s for s in states)
    with pytest.raises(urllib.error.HTTPError) as refused:
        post_json(base + "/hicache/prefetch", {"input_ids": tokens(1)})
    assert refused.value.code == 404
    assert generate(base, tokens(1))["output_ids"]  # and it serves
