"""`hicache-nixl` (HiCache's `nixl` L3) is refused in one line, exit 2, before any server starts,
without the `nixl` package or a GPU; never skipped silently."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.bench import cli, systems

real_find_spec = importlib.util.find_spec


def _argv(model: Path, out: Path, *more: str) -> list[str]:
    return ["--model", str(model), "--systems", "ours,hicache-nixl", "--no-trace", "--out", str(out), *more]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    code = cli.main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


def test_without_the_nixl_package(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setattr(
        systems.importlib.util, "find_spec", lambda n: None if n == "nixl" else real_find_spec(n)
    )
    assert _run(_argv(model, tmp_path / "o"), capsys) == (
        2, ["error: hicache-nixl: the nixl package is not installed here (HiCache's nixl L3 needs it, and a GPU)"]
    )  # fmt: skip
    assert not list((tmp_path / "o").glob("run-*"))


def test_with_nixl_but_on_cpu_or_without_cuda(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    fake = SimpleNamespace(name="nixl", origin="/nixl/__init__.py")
    monkeypatch.setattr(
        systems.importlib.util, "find_spec", lambda n: fake if n == "nixl" else real_find_spec(n)
    )
    assert _run(_argv(model, tmp_path / "o"), capsys) == (
        2, ["error: hicache-nixl: HiCache's nixl L3 runs on a GPU: give --device cuda"]
    )  # fmt: skip
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _run(_argv(model, tmp_path / "o", "--device", "cuda"), capsys) == (
        2, ["error: hicache-nixl: HiCache's nixl L3 runs on a GPU, and CUDA sees none here"]
    )  # fmt: skip
    assert not list((tmp_path / "o").glob("run-*"))


def test_everywhere_here_it_is_refused_not_skipped(model: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """On this CPU machine, whatever is installed, `hicache-nixl` never runs quietly as something else."""
    code, err = _run(_argv(model, tmp_path / "o"), capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: hicache-nixl: ")
