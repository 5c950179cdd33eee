"""Figures from per-request results, ratios, the gate, and the written report."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.bench import gate, report
from benchmarks.bench.client import Result
from benchmarks.bench.spec import Gate
from benchmarks.bench.summary import Figures, best_hicache, ratios, summarize

METRICS = {
    'sglang:hicache_spill_restored_bytes_total{tp_rank="0"}': 4e9,
    'sglang:hicache_spill_restore_seconds_sum{tp_rank="0"}': 2.0,
    'sglang:queue_time_seconds_sum{engine_type="unified",tp_rank="0"}': 3.0,
    'sglang:queue_time_seconds_count{engine_type="unified",tp_rank="0"}': 4.0,
}


def result(key: str, ttft: float, resumed: bool, *, cached: int = 0, error: str | None = None) -> Result:
    r = Result(key, "w", int(resumed), resumed, prompt_tokens=100, ttft_ms=ttft, itl_ms=[5.0, 7.0],
               output_ids=[1, 2, 3], cached_tokens=cached, error=error)  # fmt: skip
    r.cached = {"device": cached // 2, "host": 0, "storage": cached - cached // 2}
    return r


def test_summarize_counts_only_successful_requests() -> None:
    rs = [result("a", 100, False), result("b", 10, True, cached=80), result("c", 30, True, cached=60),
          result("d", 1, True, error="HTTP 500")]  # fmt: skip
    f = summarize(rs, wall_s=3.0, metrics=METRICS)
    assert (f.requests, f.errors, f.resumed) == (4, 1, 2)
    assert f.ttft_resume_p50_ms == 20.0 and f.ttft_p50_ms == 30.0
    assert f.throughput_tok_s == 3.0  # 9 tokens in 3 s
    assert f.hit_rate == pytest.approx(140 / 300)
    assert f.hit_rate_storage == pytest.approx(70 / 300) and f.hit_rate_host == 0
    assert f.itl_p50_ms == 6.0
    assert f.restore_gbps == 2.0
    assert math.isnan(summarize(rs[:1], 1.0, {}).restore_gbps)
    assert f.queue_mean_ms == 750.0  # sglang's queue time: 3 s over 4 requests
    assert math.isnan(summarize(rs[:1], 1.0, {}).queue_mean_ms)


def figures(ttft_resume: float, tput: float, errors: int = 0) -> Figures:
    base = summarize([result("a", 1, True)], 1.0, {})
    return replace(base, ttft_resume_p50_ms=ttft_resume, throughput_tok_s=tput, errors=errors)


def test_ratios_and_gate_against_the_best_hicache_configuration() -> None:
    fs = {"recompute": figures(400, 10), "hicache-timeout-budget": figures(300, 25),
          "hicache-wait-r2": figures(200, 20), "ours": figures(100, 30)}  # fmt: skip
    r = ratios({**fs, "resident": figures(80, 40)})
    assert math.isnan(r.pop("ttft_vs_lmcache")) and math.isnan(r.pop("throughput_vs_lmcache"))  # not run
    assert r == {"ttft_vs_recompute": 0.25, "throughput_vs_recompute": 3.0,
                 "ttft_vs_hicache": 0.5, "throughput_vs_hicache": 1.2,  # the best at each figure
                 "ttft_vs_resident": 1.25, "throughput_vs_resident": 0.75,
                 "ttft_vs_hicache-timeout-budget": 1 / 3, "throughput_vs_hicache-timeout-budget": 1.2,
                 "ttft_vs_hicache-wait-r2": 0.5, "throughput_vs_hicache-wait-r2": 1.5}  # fmt: skip
    assert gate.check(Gate(), {"w": fs}) == []
    slow = {**fs, "ours": figures(160, 30)}
    assert gate.check(Gate(), {"w": slow}) == [
        "w: resumed TTFT p50 ours/hicache-wait-r2 = 0.800, needs <= 0.75"
    ]
    # throughput is judged against the highest throughput of any configuration, not the TTFT-best's
    weak = {**fs, "ours": figures(100, 24)}
    assert gate.check(Gate(), {"w": weak}) == [
        "w: throughput ours/hicache-timeout-budget = 0.960, needs >= 1.00"
    ]
    broken = {**fs, "recompute": figures(400, 10, errors=2)}
    assert gate.check(Gate(), {"w": broken}) == ["w: recompute had 2 failed requests"]
    assert gate.check(Gate(), {"w": {"ours": fs["ours"]}}) == [
        "w: the gate compares ours with the peers (HiCache, LMCache); run ours and some"
    ]
    assert math.isnan(ratios({"ours": fs["ours"]})["ttft_vs_hicache"])


def test_best_hicache_is_the_lowest_resumed_ttft_then_throughput() -> None:
    assert best_hicache({"ours": figures(1, 99), "hicache-wait-r2": figures(200, 20),
                         "hicache-buffer": figures(150, 5)}) == "hicache-buffer"  # fmt: skip
    tie = {"hicache-wait-r2": figures(200, 20), "hicache-timeout-r2": figures(200, 21)}
    assert best_hicache(tie) == "hicache-timeout-r2"
    assert best_hicache({"hicache-wait-r2": figures(math.nan, 20), "hicache-buffer": figures(300, 1)}) == (
        "hicache-buffer"
    )  # a configuration with no resumed turn measured is never best
    assert best_hicache({"ours": figures(1, 1), "recompute": figures(1, 1)}) is None


def test_best_hicache_for_throughput_is_the_highest_throughput_then_ttft() -> None:
    fs = {"ours": figures(1, 99), "hicache-wait-r2": figures(200, 20), "hicache-buffer": figures(150, 5)}
    assert best_hicache(fs, "throughput") == "hicache-wait-r2"
    tie = {"hicache-wait-r2": figures(200, 20), "hicache-timeout-r2": figures(190, 20)}
    assert best_hicache(tie, "throughput") == "hicache-timeout-r2"


def test_report_files_and_final_line(tmp_path: Path) -> None:
    rs = {"ours": {"w": [result("a", 10, False), result("b", 5, True, cached=50)]},
          "recompute": {"w": [result("a", 12, False), result("b", 20, True)]}}  # fmt: skip
    rs["ours"]["w"][1].server = "http://s1"  # the worker a router picked, kept per request
    workloads = {"w": {s: summarize(by["w"], 1.0, {}) for s, by in rs.items()}}
    line = report.final_line(workloads, {"w": ratios(workloads["w"])}, {"page_cache": "drop_caches"})
    assert line["ttft_resume_p50_ms"] == {"ours": 5.0, "recompute": 20.0}
    assert line["ttft_vs_recompute"] == 0.25 and line["ttft_vs_hicache"] is None
    assert line["errors"] == 0 and line["page_cache"] == "drop_caches"
    json.dumps(line, allow_nan=False)  # no NaN reaches the JSON line
    moved = {"ours": {"w": {"a": 2.0, "b": 0.0}}}
    paths = report.write(tmp_path, rs, workloads, line, moved)
    doc = json.loads(paths[0].read_text())
    assert doc["metrics"] == {"ours": {"w": {"a": 2.0}}}
    assert doc["final"] == line and len(doc["requests"]) == 4
    rows = list(csv.DictReader(paths[1].open()))
    assert {(r["system"], r["key"], r["cached_storage"], r["server"]) for r in rows} >= {
        ("ours", "b", "25", "http://s1")
    }
    assert {r["server"] for r in doc["requests"]} == {None, "http://s1"}
    assert [r["system"] for r in csv.DictReader(paths[2].open())] == ["ours", "recompute"]
    assert paths[3].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths)  # no temp left


def test_a_report_write_that_fails_midway_leaves_each_file_whole(tmp_path: Path, monkeypatch) -> None:
    """`bench --servers 2` rewrites `partial/` after every run: a kill or a failure mid-write must
    leave the previous files, never a truncated one."""
    rs = {"ours": {"w": [result("a", 10, False), result("b", 5, True, cached=50)]}}
    workloads = {"w": {s: summarize(by["w"], 1.0, {}) for s, by in rs.items()}}
    line = report.final_line(workloads, {"w": ratios(workloads["w"])}, {})
    paths = report.write(tmp_path, rs, workloads, line)
    before = {p: p.read_bytes() for p in paths}
    real_writer = csv.DictWriter

    def writer_that_fails(*args, **kwargs):
        w = real_writer(*args, **kwargs)
        w.writerows = lambda rows: (_ for _ in ()).throw(OSError(28, "No space left on device"))
        return w

    monkeypatch.setattr(report.csv, "DictWriter", writer_that_fails)
    rs["ours"]["w"].append(result("c", 7, True))
    with pytest.raises(OSError):
        report.write(tmp_path, rs, workloads, line)
    assert paths[1].read_bytes() == before[paths[1]], "requests.csv was truncated by the failed write"
    assert json.loads(paths[0].read_text())["requests"]  # replaced whole by the new write
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths)  # no temp left


def test_soak_verdicts() -> None:
    from benchmarks.bench.soak import SoakOutcome
    from benchmarks.bench.spec import Soak

    soak = Soak(minutes=1, rss_growth_mb=100, tier_capacity_mb=1)
    steady = SoakOutcome(requests=10, samples=[(0, 900, 0), (20, 1000, 2**19), (60, 1090, 2**20)])
    assert steady.failures(soak) == []  # growth is counted from the end of warm-up (t >= 12 s)
    growing = SoakOutcome(requests=10, samples=[(0, 900, 0), (20, 1000, 0), (60, 1101, 0)])
    assert growing.failures(soak) == ["soak: RSS of server 1 grew 101 MiB after warm-up, bound 100"]
    # A crash at 30 s and a warm restart: each server's life has its own warm-up; the restarted
    # one starts low (a fresh process), which is no shrinking to credit the first one with.
    lives = [(0, 900, 0), (20, 1000, 0), (29, 1050, 0), (31, 0, 0), (33, 800, 0), (40, 850, 0), (60, 949, 0)]
    restarted = SoakOutcome(requests=10, samples=lives, restarted_at_s=30, restored_after_restart=5)
    assert restarted.failures(soak) == []
    assert replace(restarted, samples=[*lives[:-1], (60, 960, 0)]).failures(soak) == [
        "soak: RSS of server 2 grew 110 MiB after warm-up, bound 100"
    ]
    assert replace(restarted, restored_after_restart=0).failures(soak) == [
        "soak: the restarted server restored nothing of the cycle before the crash"
    ]
    over = SoakOutcome(requests=10, errors=1, samples=[(0, 900, 0), (60, 900, 2**20 + 1)])
    assert over.failures(soak) == ["soak: 1 of 10 requests failed", "soak: tier held 1 MiB, capacity 1"]
    assert SoakOutcome().failures(soak) == ["soak: no request completed", "soak: no samples taken"]
    assert steady.figures()["soak_rss_peak_mb"] == 1090
