"""Bad input to `python -m sgl_hicache.bench` is one line on stderr and exit status 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize(
    "args, message",
    [
        (["--systems", "recompute,vllm"], "unknown system(s) ['vllm']"),
        (["--pool-tokens", "10"], "pool_tokens must be >= 256"),
        (["--page-size", "3"], "page_size must be a power of two"),
        (["--trace", "/nonexistent.jsonl"], "trace file not found: /nonexistent.jsonl"),
        (["--concurrency", "", "--no-trace"], "nothing to run"),
        (["--rounds", "0"], "multi-turn rounds must be >= 1"),
        (["--model", "/nonexistent-model"], "neither smollm2, a generated size"),
        (["--repeats", "0"], "repeats must be >= 1"),
        (["--concurrency", "8,x"], "--concurrency takes comma-separated integers, got '8,x'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    p = subprocess.run([sys.executable, "-m", "sgl_hicache.bench", "--out", str(tmp_path), *args],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("error: ")
    assert message in p.stderr
    assert p.stdout == ""
