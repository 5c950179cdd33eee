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


def test_device_cuda_runs_every_system_with_sglangs_gpu_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 28: a user measures their own GPU box. `--device cuda` drops every CPU flag, the CPU
    engine's environment and our HiCache CPU patches; HiCache runs with its GPU defaults (kernel
    I/O, page_first layout: no --hicache-io-backend / --hicache-mem-layout)."""
    from benchmarks.bench import systems
    from benchmarks.bench.cli import parser, spec_from
    from benchmarks.bench.spec import HICACHE

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(
        '{"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4}'
    )
    monkeypatch.setattr(systems, "nixl_unavailable", lambda shape: None)  # a GPU box with nixl installed
    argv = ["--device", "cuda", "--model-path", str(tmp_path / "m"), "--disk-read-mib-s", "900"]
    spec = spec_from(parser().parse_args(argv))
    assert spec.shape.device == "cuda" and spec.shape.model == str(tmp_path / "m")
    for name in ("recompute", "ours", "resident", *HICACHE):
        system = systems.build(name, spec.shape, tmp_path / "m", tmp_path)
        flags = " ".join(system.flags)
        assert "--device cuda" in flags and "cpu" not in flags and "torch_native" not in flags, name
        assert "--hicache-io-backend" not in flags and "--hicache-mem-layout" not in flags, name
        assert "SGL_HICACHE_CPU_HICACHE_COMPAT" not in dict(system.env), name
        assert not system.server(tmp_path / "m", tmp_path / "log").on_cpu
    cpu = systems.build("ours", spec_from(parser().parse_args([])).shape, tmp_path / "m", tmp_path)
    assert cpu.server(tmp_path / "m", tmp_path / "log").on_cpu and "--device cpu" in " ".join(cpu.flags)
