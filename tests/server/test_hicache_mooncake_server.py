"""sglang's own HiCache with its `mooncake` L3 on CPU (issue 40): the benchmark's `hicache-mooncake`
server, on a real Mooncake master, through the CPU profile's page_first_direct copies.

The server is built exactly as `--servers 2` builds each of `hicache-mooncake`'s
(`systems.build` with the run's Mooncake settings; a 1,024-token device pool here). A prompt is
served, its pages are backed up to the store (sglang's `backuped_tokens_total`), `/flush_cache`
empties the device and host pools (not the store), and the same prompt is served again with the
same greedy tokens, its cached tokens read from the store. Without the copies the server dies at
its first backup (`transfer_kv_all_layer_direct_lf_pf` is not defined on CPU).
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest

from benchmarks.bench import cluster, systems
from benchmarks.bench.spec import Shape
from tests.mooncake_master import MooncakeMaster
from tests.server.conftest import eventually
from tests.server.test_hicache_cpu_compat_server import generate, storage_hits_total, tokens

pytestmark = [pytest.mark.server, pytest.mark.slow]  # ~50 s on a quiet 2-vCPU machine, most of it the start

SHAPE = Shape(model="tiny", pool_tokens=1024)
PROMPT = 300  # above sglang's default L3 prefetch threshold (256 tokens)
WHOLE_PAGES = PROMPT // SHAPE.page_size * SHAPE.page_size  # what HiCache stores of the prompt


def backuped_tokens(base: str) -> float:
    """`sglang:backuped_tokens_total`: tokens HiCache has written to its L3."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(
        float(v) for v in re.findall(r"^sglang:backuped_tokens_total(?:\{[^}]*\})? (\S+)$", text, re.M)
    )


def flush(base: str) -> str:
    req = urllib.request.Request(base + "/flush_cache", b"", method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read().decode()


def test_a_prompt_flushed_from_device_and_host_comes_back_from_the_mooncake_store(
    tiny_model: Path, tmp_path: Path, mooncake_master: MooncakeMaster
) -> None:
    store = mooncake_master.config(segment_bytes=64 << 20)
    system = systems.build(cluster.STRONGEST_HICACHE, SHAPE, tiny_model, tmp_path, mooncake=store)
    assert "page_first_direct" in system.flags  # the layout whose copies the CPU profile provides
    with system.server(tiny_model, tmp_path / "server.log") as server:
        base = server.base_url
        prompt = tokens(40, PROMPT)
        first = generate(base, prompt)
        assert first["meta_info"]["cached_tokens"] == 0
        assert eventually(lambda: backuped_tokens(base) >= WHOLE_PAGES, timeout_s=60.0)
        assert flush(base).startswith("Cache flushed")
        hits_before = storage_hits_total(base)
        again = generate(base, prompt)
        hits = storage_hits_total(base) - hits_before

    assert again["output_ids"] == first["output_ids"]
    details = again["meta_info"]["cached_tokens_details"]
    assert details["device"] == 0 and details["host"] == 0, details  # flushed from both pools
    assert details["storage"] == WHOLE_PAGES and details["storage_backend"] == "MooncakeStore", details
    assert again["meta_info"]["cached_tokens"] == WHOLE_PAGES == hits
