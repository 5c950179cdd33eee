"""`python -m benchmarks.long_history`: its arguments, and the figures it derives from rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import long_history as lh
from benchmarks.bench.spec import HICACHE, LMCACHE


def row(system: str, length: int, resume: float, resident: float, **phases: float) -> dict:
    return dict(system=system, round=0, rep=0, length=length, resume_ms=resume, cached=length,
                resident_ms=resident, restored_bytes=phases.pop("restored_bytes", 0.0),
                **{p: phases.get(lh._short(p), 0.0) for p in lh.PHASES})  # fmt: skip


def test_ours_is_set_against_the_best_hicache_and_the_read_bound() -> None:
    rows = [
        row("hicache-wait-r2", 4096, 900.0, 100.0),
        row("hicache-timeout-r2", 4096, 600.0, 100.0),
        row("ours", 4096, 400.0, 100.0, unpack=0.05, restored_bytes=1e9),
        row("ours", 4096, 500.0, 120.0, unpack=0.07, restored_bytes=1e9),
    ]
    f = lh.summarize(rows, raw=[2.0, 1.0, 4.0])
    assert f["best_hicache_4096"] == "hicache-timeout-r2"
    assert f["ours_resume_ms_4096"] == 450.0 and f["ours_resume_ms_spread_4096"] == [400.0, 500.0]
    assert f["ours_vs_best_hicache_4096"] == pytest.approx(0.75)
    assert f["ours_overhead_ms_4096"] == pytest.approx(340.0)  # median of 300 and 380
    assert f["raw_read_gbps"] == 2.0
    # 1e9 B at 2 GB/s = 500 ms, x 1.25 = 625 ms, + the median unpack 60 ms
    assert f["ours_overhead_bound_ms_4096"] == pytest.approx(685.0)
    assert f["ours_overhead_within_bound_4096"] is True
    with_lmcache = lh.summarize(
        [*rows, row("lmcache-disk", 4096, 800.0, 100.0), row("lmcache-disk-c64", 4096, 700.0, 100.0)], raw=[]
    )
    assert with_lmcache["best_lmcache_4096"] == "lmcache-disk-c64"
    assert with_lmcache["ours_vs_best_lmcache_4096"] == pytest.approx(450.0 / 700.0)
    assert with_lmcache["best_hicache_4096"] == "hicache-timeout-r2"
    slow = lh.summarize([row("ours", 4096, 2000.0, 100.0, restored_bytes=1e9)], raw=[2.0])
    assert slow["ours_overhead_within_bound_4096"] is False


def test_the_issues_target_is_printed_at_16k_on_kvheavy() -> None:
    rows = [row("hicache-wait-r2", 16384, 1000.0, 100.0), row("lmcache-disk", 16384, 700.0, 100.0),
            row("ours", 16384, 400.0, 100.0)]  # fmt: skip
    f = lh.summarize(rows, raw=[], model="kvheavy")
    assert f["target_16384"] == "<= 0.60" and f["target_met_16384"] is True  # 0.40 and 0.57 of the peers
    slower = lh.summarize([*rows[:2], row("ours", 16384, 450.0, 100.0)], raw=[], model="kvheavy")
    assert slower["target_met_16384"] is False  # 450 / 700 = 0.64 of LMCache's best
    assert "target_16384" not in lh.summarize(rows, raw=[], model="smollm2")  # a target for kvheavy only
    assert "target_8192" not in lh.summarize([{**r, "length": 8192} for r in rows], raw=[], model="kvheavy")


def test_systems_are_checked_and_ordered() -> None:
    assert lh._systems("ours,recompute") == ["recompute", "ours"]
    assert lh._systems("hicache") == [n for n in HICACHE if n != "hicache-nixl"]  # the nixl L3: GPU only
    assert lh._systems("hicache", "cuda") == list(HICACHE)
    assert lh._systems("hicache-nixl") == ["hicache-nixl"]  # named alone: kept, so it is refused, not skipped
    assert lh._systems("ours,lmcache") == [*LMCACHE, "ours"]
    with pytest.raises(ValueError, match="resident"):
        lh._systems("ours,resident")


@pytest.mark.parametrize("argv", [["--lengths", "100"], ["--rounds", "0"], ["--systems", "nope"]])
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert lh.main(argv) == 2
    assert capsys.readouterr().err.startswith("long_history: ")


def test_rows_are_saved_whole_and_a_failed_save_does_not_stop_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = (
        [row("ours", 4096, 1.0, 1.0)],
        [row("ours", 4096, 1.0, 1.0), row("recompute", 4096, 9.0, 1.0)],
    )
    lh.save_rows(tmp_path, first)
    lh.save_rows(tmp_path, second)
    assert json.loads((tmp_path / "rows.json").read_text()) == second
    assert [p.name for p in tmp_path.iterdir()] == ["rows.json"]
    (tmp_path / ".rows.json.tmp").mkdir()  # the write fails (a directory in the way)
    lh.save_rows(tmp_path, first)
    assert "could not save rows" in capsys.readouterr().err
    assert json.loads((tmp_path / "rows.json").read_text()) == second, "the last good save stays"
