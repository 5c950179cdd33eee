"""Spill and restore with a paged pool (`--page-size 16`, as GPU deployments and the benchmark run
it): the tree keys on whole pages, extents hold whole pages, and a resumed turn whose history does
not end on a page boundary still gets the resident run's greedy output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench.server_process import ServerProcess
from tests.server.conftest import SPILL_FLAGS
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
