"""The sgl_kernel CPU shim: what it implements is exact, the rest raises, and it steps aside for real builds."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from sgl_hicache_cpu import cpu_shim_hook, sgl_kernel_cpu_shim


def run_python(code: str, **env: str) -> str:
    import os

    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                            env={**os.environ, **env})  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def ref_assign(
    rows: list[int], req_to_token: torch.Tensor, starts: list[int], ends: list[int], locs: torch.Tensor
) -> None:
    pos = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        for j in range(start, end):
            req_to_token[row, j] = locs[pos]
            pos += 1


def test_assign_req_to_token_pool_matches_reference() -> None:
    rows, starts, ends = [3, 0, 5], [0, 4, 2], [5, 4, 9]
    locs = torch.arange(100, 100 + sum(e - s for s, e in zip(starts, ends, strict=True)), dtype=torch.int64)
    got = torch.full((6, 16), -1, dtype=torch.int32)
    want = got.clone()
    sgl_kernel_cpu_shim.assign_req_to_token_pool_cpu(
        torch.tensor(rows), got, torch.tensor(starts), torch.tensor(ends), locs, got.shape[1]
    )
    ref_assign(rows, want, starts, ends, locs)
    assert torch.equal(got, want)


def test_pinned_sglang_calls_the_shim_with_its_argument_order() -> None:
    # sglang 0.5.23's allocation.assign_req_to_token_pool_func passes req_to_token.shape[1] last.
    out = run_python(
        """
        import torch
        from sglang.srt.mem_cache import allocation
        r2t = torch.full((4, 8), -1, dtype=torch.int32)
        allocation.assign_req_to_token_pool_func(torch.tensor([2, 1]), r2t, torch.tensor([1, 0]),
            torch.tensor([3, 2]), torch.tensor([7, 8, 9, 10]), 2)
        print(r2t[2].tolist(), r2t[1].tolist(), allocation.assign_req_to_token_pool_cpu.__module__)
        """,
        SGLANG_USE_CPU_ENGINE="1",
    )
    assert (
        out
        == "[-1, 7, 8, -1, -1, -1, -1, -1] [9, 10, -1, -1, -1, -1, -1, -1] sgl_hicache_cpu.sgl_kernel_cpu_shim"
    )


def test_unimplemented_names_raise_on_call() -> None:
    fn = sgl_kernel_cpu_shim.fill_bonus_tokens_cpu  # type: ignore[attr-defined]
    with pytest.raises(NotImplementedError, match=r"sgl_kernel\.fill_bonus_tokens_cpu is not implemented"):
        fn(1, 2)
    with pytest.raises(AttributeError):
        sgl_kernel_cpu_shim.__wrapped__  # type: ignore[attr-defined]  # noqa: B018


def test_shim_is_served_as_sgl_kernel_in_a_fresh_interpreter() -> None:
    assert (
        run_python("import sgl_kernel; print(sgl_kernel.__name__)") == "sgl_hicache_cpu.sgl_kernel_cpu_shim"
    )


def test_a_real_sgl_kernel_wins(tmp_path: Path) -> None:
    (tmp_path / "sgl_kernel.py").write_text("WHO = 'real'\n")
    assert run_python("import sgl_kernel; print(sgl_kernel.WHO)", PYTHONPATH=str(tmp_path)) == "real"


def test_finder_declines_when_a_gpu_is_present(monkeypatch: pytest.MonkeyPatch) -> None:
    finder = cpu_shim_hook.SglKernelCpuShimFinder()
    assert finder.find_spec("sgl_kernel") is not None
    assert finder.find_spec("sgl_kernel.kvcacheio") is None
    monkeypatch.setattr(cpu_shim_hook, "gpu_present", lambda: True)
    assert finder.find_spec("sgl_kernel") is None
