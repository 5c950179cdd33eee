"""`python -m sgl_hicache.bench` end to end on the tiny model: the systems (with one HiCache
configuration, `buffer_only`, the one furthest from sglang's defaults) serve the same workloads
without errors, each reuses KV from the tier it has, and the report is complete."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.server
ROOT = Path(__file__).resolve().parents[2]
HICACHE = "hicache-buffer"


@pytest.mark.slow  # the bench's parts have their own tests; the soak below runs it end to end
def test_all_systems_side_by_side(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "sgl_hicache.bench", "--model", "tiny", "--pool-tokens", "1024",
           "--host-budget-mb", "1", "--concurrency", "4", "--rounds", "3", "--first-tokens", "300",
           "--question-tokens", "40", "--output-tokens", "4", "--trace-requests", "8",
           "--token-scale", "0.05", "--time-scale", "0.05", "--gate", "--out", str(tmp_path),
           "--systems", f"recompute,{HICACHE},ours,resident", "--repeats", "1"]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert p.returncode in (0, 1), p.stderr[-3000:]  # 1: the gate may fail on this toy shape
    line = json.loads(p.stdout.strip().splitlines()[-1])
    assert line["errors"] == 0, p.stderr[-3000:]
    assert set(line["ttft_resume_p50_ms"]) == {"recompute", HICACHE, "ours", "resident"}
    for key in ("ttft_vs_recompute", "ttft_vs_hicache", "throughput_vs_recompute", "throughput_vs_hicache"):
        assert line[key] > 0, key
    assert line["model"] == "tiny" and line["repeats"] == 1
    assert line["best_hicache_config"] == {"multiturn_c4": HICACHE, "trace": HICACHE}
    assert line["ttft_vs_best_hicache"]["multiturn_c4"] == line["ttft_vs_hicache"]
    assert set(line["throughput_vs_best_hicache"]) == {"multiturn_c4", "trace", "overall"}
    assert line["gate"] in ("pass", "fail") and (line["gate"] == "pass") == (p.returncode == 0)
    assert line["page_cache"] in ("drop_caches", "fadvise")
    run_dir = next(tmp_path.glob("run-*"))
    doc = json.loads((run_dir / "results.json").read_text())
    mt = doc["figures"]["multiturn_c4"]
    assert mt["ours"]["hit_rate_storage"] > 0, "resumed conversations were restored from our tier"
    assert mt[HICACHE]["hit_rate_host"] + mt[HICACHE]["hit_rate_storage"] > 0
    assert mt["recompute"]["hit_rate_host"] == mt["recompute"]["hit_rate_storage"] == 0
    assert {r["system"] for r in doc["requests"]} == {"recompute", HICACHE, "ours", "resident"}
    res = mt["resident"]
    assert res["hit_rate_device"] >= mt["ours"]["hit_rate"] - 0.05, (
        "the reference keeps every prefix on device"
    )
    for name in ("requests.csv", "summary.csv", "ttft_per_round.png"):
        assert (run_dir / name).stat().st_size > 0


def test_soak_alone_passes_and_reports(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "sgl_hicache.bench", "--model", "tiny", "--pool-tokens", "512",
           "--concurrency", "", "--no-trace", "--rounds", "2", "--first-tokens", "200",
           "--output-tokens", "4", "--soak", "0.4", "--out", "relative/out"]  # fmt: skip
    # a relative --out, so from another directory: the checkout's root on the import path instead
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
    }
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    line = json.loads(p.stdout.strip().splitlines()[-1])
    assert line["gate"] == "pass" and line["gate_failures"] == []
    assert (
        line["soak_requests"] >= 16 and line["soak_errors"] == 0
    )  # 8 conversations x 2 rounds, at least once
    assert 0 < line["soak_tier_peak_mb"] <= 512
    assert line["soak_rss_peak_mb"] >= line["soak_rss_start_mb"] > 0
    assert line["soak_restored_after_restart"] > 0, "the server SIGKILLed halfway restarted warm"


@pytest.mark.slow  # two fresh servers: 8.4 min on this 2-core box under load; the parts have fast tests
@pytest.mark.timeout(1800)
def test_agents_workload_end_to_end(tmp_path: Path) -> None:
    """`--workload agents --quick` on the tiny model (12 agents at token scale 1/16: a host budget of
    1 MiB holds 4,096 of its tokens, so shorter contexts would stay in memory): every turn answered,
    ours restores resumed turns' contexts from its tier and recompute cannot, each resumed turn is
    counted where it found its prefix, and ours' disk writes are set against what it restored."""
    cmd = [sys.executable, "-m", "sgl_hicache.bench", "--model", "tiny", "--workload", "agents", "--quick",
           "--systems", "ours,recompute", "--agents", "12", "--token-scale", "0.0625", "--out", str(tmp_path)]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1700)
    assert p.returncode == 0, p.stderr[-3000:]
    line = json.loads(p.stdout.strip().splitlines()[-1])
    assert line["errors"] == 0 and line["headline_workload"] == "agents"
    assert line["workload"]["agents"]["token_scale"] == 0.0625 and line["workload"]["agents"]["count"] == 12
    assert line["ttft_vs_recompute"] > 0 and line["throughput_vs_recompute"] > 0
    ours, recompute = line["figures"]["agents"]["ours"], line["figures"]["agents"]["recompute"]
    resumed = line["workload"]["agents"]["turns"] - 12
    for f in (ours, recompute):
        assert f["resumed_resident"] + f["resumed_restored"] + f["resumed_recomputed"] == resumed
    assert ours["resumed_restored"] > 0 and ours["tokens_restored"] > 0
    assert ours["disk_write_mb"] > 0 and ours["write_per_restored"] > 0
    assert recompute["resumed_restored"] == 0 and recompute["tokens_restored"] == 0
    assert recompute["write_per_restored"] is None, "nothing restored: no ratio"
