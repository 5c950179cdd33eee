"""The patched server end to end: our registered cache serves a multi-turn chat on CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench.server_process import ServerStartError
from tests.server.conftest import lines_of_ours, metrics, post_json

pytestmark = pytest.mark.server


def chat(base_url: str, turns: list[str], max_tokens: int = 12) -> list[dict[str, Any]]:
    messages: list[dict[str, str]] = []
    usages = []
    for text in turns:
        messages.append({"role": "user", "content": text})
        body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        response = post_json(base_url + "/v1/chat/completions", body)
        messages.append({"role": "assistant", "content": response["choices"][0]["message"]["content"]})
        usages.append(response["usage"])
    return usages


TURNS = ["How fast is the disk?", "Can you summarize our chat?", "Which tool should I call next?"]


def test_three_turn_chat_is_served_by_our_cache(tiny_model: Path, tmp_path: Path, start_server: Any) -> None:
    server = start_server(tiny_model, "--enable-hicache-spill", "--hicache-spill-dir", str(tmp_path / "tier"))
    usages = chat(server.base_url, TURNS)
    cached = [(u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usages]
    assert cached[0] == 0
    # Turns 2 and 3 reuse at least the previous turn's whole prompt.
    assert cached[1] >= usages[0]["prompt_tokens"] and cached[2] >= usages[1]["prompt_tokens"], usages
    series = metrics(server.base_url)
    assert series['sglang:hicache_spill_info{backend="hicache_spill",enabled="true",tp_rank="0"}'] == 1.0
    assert series['sglang:hicache_spill_match_requests_total{tp_rank="0"}'] >= len(TURNS)


def test_plain_sglang_launcher_selects_our_backend_by_flag(
    tiny_model: Path, tmp_path: Path, start_server: Any
) -> None:
    server = start_server(tiny_model, "--radix-cache-backend", "hicache_spill", module="sglang.launch_server",
                          env={"SGL_HICACHE_SPILL_DIR": str(tmp_path / "tier"), "SGL_HICACHE_SPILL_CAPACITY": "3G"})  # fmt: skip
    chat(server.base_url, TURNS[:1])
    series = metrics(server.base_url)
    assert series['sglang:hicache_spill_tier_capacity_bytes{tp_rank="0"}'] == 3 * 2**30
    assert series['sglang:hicache_spill_match_requests_total{tp_rank="0"}'] >= 1


@pytest.mark.slow  # a control: a plain server that fails, none of our code on its path
def test_plain_sglang_that_fails_to_start_shows_nothing_of_ours(
    tiny_model: Path, tmp_path: Path, start_server: Any
) -> None:
    """Issue 24: a plain server that stops at start-up (its scheduler fails after every process loaded
    our plugin; sglang then kills its process tree) logs no error of ours on the way down."""
    with pytest.raises(ServerStartError, match="server exited"):
        start_server(tiny_model, "--radix-cache-backend", "nonexistent", module="sglang.launch_server")
    log = tmp_path / "server0.log"
    assert "'nonexistent' is not registered" in log.read_text()
    assert lines_of_ours(log) == []
