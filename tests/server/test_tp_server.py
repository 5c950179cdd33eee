"""`--tp-size 2` on CPU (smoke): plain sglang and our server start through our CPU platform
(`sgl_hicache_cpu.cpu_tp_platform`, asked for by `ServerProcess`) and give a `--tp-size 1`
plain server's greedy outputs. Our server's pool holds every token, so nothing is spilled here.
Servers start one after another (a TP=2 server is three sglang processes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench.server_process import ServerProcess
from tests.server.conftest import SPILL_FLAGS, metrics, post_json

pytestmark = pytest.mark.server

PREFIX = [(7 * i) % 900 + 20 for i in range(40)]  # shared by the prompts, so ranks match prefixes
PROMPTS = [
    PREFIX + [101, 102, 103],
    PREFIX + [201, 202],
    [300 + i for i in range(17)],
    PREFIX + [101, 102, 103],
]
MAX_NEW = 8


def generate(base_url: str, ids: list[int]) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}
    return post_json(base_url + "/generate", body)


def serve(base_url: str) -> list[list[int]]:
    return [generate(base_url, ids)["output_ids"] for ids in PROMPTS]


@pytest.fixture(scope="module")
def tp1_outputs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    log = tmp_path_factory.mktemp("tp1") / "server.log"
    with ServerProcess(tiny_model, 2048, SPILL_FLAGS, module="sglang.launch_server", log_path=log) as server:
        return serve(server.base_url)


@pytest.mark.slow  # a control: sglang's own TP2, no code of ours
def test_plain_sglang_tp2_matches_tp1(
    tiny_model: Path, start_server: Any, tp1_outputs: list[list[int]]
) -> None:
    server = start_server(tiny_model, "--tp-size", "2", module="sglang.launch_server")
    assert serve(server.base_url) == tp1_outputs


@pytest.mark.slow  # a smoke: test_tp_exactness_server's TP2 differential starts ours the same way, per-rank series too
def test_our_server_tp2_matches_tp1(
    tiny_model: Path, tmp_path: Path, start_server: Any, tp1_outputs: list[list[int]]
) -> None:
    server = start_server(tiny_model, "--tp-size", "2", "--enable-hicache-spill",
                          "--hicache-spill-dir", str(tmp_path / "tier"))  # fmt: skip
    replies = [generate(server.base_url, ids) for ids in PROMPTS]
    assert [r["output_ids"] for r in replies] == tp1_outputs
    assert replies[-1]["meta_info"]["cached_tokens"] >= len(PROMPTS[-1]) - 1  # the repeat is a hit
    series = metrics(server.base_url)
    assert series['sglang:hicache_spill_info{backend="hicache_spill",enabled="true",tp_rank="0"}'] == 1.0
    assert series['sglang:hicache_spill_match_requests_total{tp_rank="0"}'] >= len(PROMPTS)
