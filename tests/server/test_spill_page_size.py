"""Spill and restore with a paged pool (`--page-size 16`, as GPU deployments and the benchmark run
it): the tree keys on whole pages, extents hold whole pages, and a resumed turn whose history does
not end on a page boundary still gets the resident run's greedy output."""

from __future__ import annotations

import urllib.error
from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench.server_process import ServerProcess
from tests.server.conftest import SPILL_FLAGS, post_json
from tests.server.test_spill_resume import POOL, counter, generate, generate_full, push_out, tokens

pytestmark = pytest.mark.server

PAGE = 16


@pytest.fixture(scope="module")
def paged_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("paged")
    args = (*SPILL_FLAGS, "--page-size", str(PAGE), "--enable-hicache-spill", "--hicache-spill-dir",
            str(tmp / "tier"), "--hicache-spill-min-free", "0")  # fmt: skip
    with ServerProcess(tiny_model, POOL, args, log_path=tmp / "server.log") as s:
        yield s


@pytest.mark.parametrize("seed, length", [(41, 300), (43, 256)])  # 300: not a page multiple
def test_paged_resume_is_restored_and_identical(paged_server: Any, seed: int, length: int) -> None:
    base = paged_server.base_url
    turn1 = tokens(seed, length)
    out1, _ = generate(base, turn1)
    turn2 = turn1 + out1 + tokens(seed + 1, 21)
    reference, cached = generate(base, turn2)
    assert cached >= (length // PAGE) * PAGE
    restored = counter(base, "restored_tokens")
    push_out(base, seed)
    out = generate_full(base, turn2)
    storage = out["meta_info"]["cached_tokens_details"]["storage"]
    assert storage >= (length // PAGE) * PAGE and storage % PAGE == 0, storage
    assert counter(base, "restored_tokens") - restored >= storage
    assert out["output_ids"] == reference


def test_a_prompt_no_pool_could_admit_is_refused_and_the_server_goes_on(paged_server: Any) -> None:
    """A prompt of pool - page tokens passes sglang's length check (< pool - 5) but never its prefill
    admission (prompt + new tokens + page < pool): sglang queued it forever, and every request after
    it (the long-history benchmark's server, pool 20544, page 64, a prompt of 20,480 tokens). Now it
    is refused at arrival (sglang's own error), and a prompt one page shorter is still served."""
    base = paged_server.base_url
    body = {"input_ids": tokens(47, POOL - PAGE), "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    with pytest.raises(urllib.error.HTTPError) as info:
        post_json(base + "/generate", body)
    assert info.value.code == 400
    assert "exceeds the KV memory budget" in info.value.read().decode()
    out, _ = generate(base, tokens(48, POOL - 2 * PAGE), n=1)
    assert len(out) == 1
