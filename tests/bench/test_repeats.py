"""Repeats and the peer at its strongest: medians and spreads over repeats, the best HiCache
configuration and the gate on medians, the interleaved order, the final line's keys, the CLI's
presets, and page-cache drops kept out of the timed windows."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp import web
from tqdm import tqdm

from benchmarks.bench import aggregate, drive, gate, report, run, systems
from benchmarks.bench.aggregate import Measured
from benchmarks.bench.cli import parser, spec_from
from benchmarks.bench.client import Result
from benchmarks.bench.spec import (
    HICACHE,
    LMCACHE,
    SYSTEMS,
    Gate,
    HiCacheConfig,
    HostPool,
    MultiTurn,
    Shape,
    SpecError,
    expand_systems,
)
from benchmarks.bench.summary import Figures, ratios, summarize
from benchmarks.bench.workload import Request

NAN = math.nan


def figures(ttft_resume: float, tput: float, errors: int = 0) -> Figures:
    r = Result("a", "w", 1, True, prompt_tokens=10, ttft_ms=1.0, output_ids=[1])
    return replace(
        summarize([r], 1.0, {}), ttft_resume_p50_ms=ttft_resume, throughput_tok_s=tput, errors=errors
    )


def measured(*runs: tuple[float, float]) -> Measured:
    return Measured(tuple(figures(t, x) for t, x in runs))


def test_median_and_spread_over_repeats() -> None:
    m = Measured((figures(300, 10, errors=1), figures(100, 30), figures(200, NAN), figures(NAN, 20)))
    assert m.median.ttft_resume_p50_ms == 200 and m.median.throughput_tok_s == 20  # NaN repeats left out
    assert (m.low.ttft_resume_p50_ms, m.high.ttft_resume_p50_ms) == (100, 300)
    assert (m.low.throughput_tok_s, m.high.throughput_tok_s) == (10, 30)
    assert m.median.errors == 1 and m.median.requests == 4  # counts are summed: an error in any repeat shows
    assert math.isnan(Measured((figures(NAN, 1),)).median.ttft_resume_p50_ms)


def test_versus_best_uses_medians_and_pairs_repeats() -> None:
    workloads = {
        "mt": {
            "ours": measured((100, 30), (120, 28), (90, 33)),
            "hicache-wait-r2": measured((200, 20), (150, 25), (1000, 2)),  # median 200: the best
            "hicache-timeout-budget": measured(
                (120, 40), (400, 40), (400, 40)
            ),  # one lucky repeat: median 400
            "recompute": measured((50, 1), (50, 1), (50, 1)),  # fast but not a HiCache configuration
        },
        "trace": {"ours": measured((100, 10)), "hicache-buffer": measured((400, 5))},
    }
    vs = aggregate.versus_best(workloads)
    ttft, tput = vs["hicache", "ttft"], vs["hicache", "throughput"]
    assert ttft.config == {"mt": "hicache-wait-r2", "trace": "hicache-buffer"}
    assert tput.config == {"mt": "hicache-timeout-budget", "trace": "hicache-buffer"}
    assert ttft.ratio["mt"] == 100 / 200 and tput.ratio["mt"] == 30 / 40  # each against the best at it
    assert ttft.range["mt"] == pytest.approx((90 / 1000, 120 / 150))  # repeat k against repeat k
    assert tput.range["mt"] == (28 / 40, 33 / 40)
    assert ttft.ratio["overall"] == pytest.approx(math.sqrt(0.5 * 0.25))
    assert tput.ratio["overall"] == pytest.approx(math.sqrt(0.75 * 2.0))
    assert vs["lmcache", "ttft"].config == {"mt": None, "trace": None}  # no LMCache configuration ran
    assert math.isnan(vs["lmcache", "ttft"].ratio["mt"])
    medians = aggregate.medians(workloads)
    assert ratios(medians["mt"])["ttft_vs_hicache"] == ttft.ratio["mt"]
    assert ratios(medians["mt"])["throughput_vs_hicache"] == tput.ratio["mt"]
    assert gate.check(Gate(), medians) == [
        "mt: throughput ours/hicache-timeout-budget = 0.750, needs >= 1.00"
    ]


def test_gate_is_judged_on_medians() -> None:
    one_bad_repeat = {"w": {"ours": measured((100, 30), (100, 30), (900, 1)),
                            "hicache-wait-r2": measured((200, 20), (200, 20), (200, 20))}}  # fmt: skip
    assert gate.check(Gate(), aggregate.medians(one_bad_repeat)) == []
    two_bad = {"w": {**one_bad_repeat["w"], "ours": measured((100, 30), (900, 1), (900, 1))}}
    assert gate.check(Gate(), aggregate.medians(two_bad)) == [
        "w: resumed TTFT p50 ours/hicache-wait-r2 = 4.500, needs <= 0.75",
        "w: throughput ours/hicache-wait-r2 = 0.050, needs >= 1.00",
    ]


def test_resident_reference_bounds_what_any_cache_can_reach() -> None:
    """The resident reference (a pool holding the whole workload) against the best HiCache
    configuration of the same figure: in the final line, and in a failed gate's reason, so a reader
    sees whether the threshold is reachable on that machine at all."""
    workloads = {
        "mt": {
            "ours": measured((90, 30), (100, 30)),
            "hicache-wait-r2": measured((100, 20), (100, 20)),  # the best at TTFT
            "hicache-buffer": measured((200, 40), (200, 40)),  # the best at throughput
            "resident": measured((80, 50), (90, 50)),  # median TTFT 85
        },
        "trace": {"ours": measured((100, 10)), "hicache-buffer": measured((400, 5))},  # no resident
    }
    vs = aggregate.versus_best(workloads)
    assert vs["hicache", "ttft"].resident["mt"] == pytest.approx(85 / 100)
    assert vs["hicache", "throughput"].resident["mt"] == pytest.approx(50 / 40)
    assert math.isnan(vs["hicache", "ttft"].resident["trace"]) and math.isnan(
        vs["hicache", "ttft"].resident["overall"]
    )
    line = report.versus_best_keys(vs, workloads)
    assert line["resident_ttft_vs_best_hicache"]["mt"] == pytest.approx(0.85)
    assert line["resident_throughput_vs_best_hicache"]["mt"] == pytest.approx(1.25)
    assert gate.check(Gate(), {"mt": aggregate.medians(workloads)["mt"]}) == [
        "mt: resumed TTFT p50 ours/hicache-wait-r2 = 0.950, needs <= 0.75 "
        "(resident, a pool holding the whole workload: 0.850)",
        "mt: throughput ours/hicache-buffer = 0.750, needs >= 1.00 "
        "(resident, a pool holding the whole workload: 1.250)",
    ]


def test_geomean() -> None:
    assert aggregate.geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert math.isnan(aggregate.geomean([2.0, NAN])) and math.isnan(aggregate.geomean([]))


def test_schedule_interleaves_and_rotates() -> None:
    order = run.schedule(["a", "b", "c", "d"], 3)
    assert order == [(0, "a"), (0, "b"), (0, "c"), (0, "d"),
                     (1, "b"), (1, "c"), (1, "d"), (1, "a"),
                     (2, "c"), (2, "d"), (2, "a"), (2, "b")]  # fmt: skip
    assert run.schedule(["a", "b"], 1) == [(0, "a"), (0, "b")]
    every = run.schedule(SYSTEMS, 3)
    for r in range(3):
        assert sorted(s for k, s in every if k == r) == sorted(SYSTEMS)  # every pass runs every system once
    firsts = {every[r * len(SYSTEMS)] for r in range(3)}
    assert len({s for _, s in firsts}) == 3  # three first systems


def test_final_line_keeps_todays_keys_and_adds_the_repeats_ones() -> None:
    workloads = {
        "multiturn_c8": {"ours": measured((100, 30), (110, 31)), "hicache-wait-r2": measured((200, 20), (220, 21)),
                         "recompute": measured((400, 10), (400, 10))},
        "trace": {"ours": measured((100, 10), (100, 10)), "hicache-buffer": measured((125, 10), (125, 10))},
    }  # fmt: skip
    medians = aggregate.medians(workloads)
    extra = {"model": "smollm2", "repeats": 2, "page_cache": "drop_caches"}
    extra.update(report.versus_best_keys(aggregate.versus_best(workloads), workloads))
    line = report.final_line(medians, {w: ratios(f) for w, f in medians.items()}, extra)
    today = {"headline_workload", "ttft_resume_p50_ms", "throughput_tok_s", "ttft_vs_recompute", "ttft_vs_hicache",
             "ttft_vs_resident", "throughput_vs_recompute", "throughput_vs_hicache", "throughput_vs_resident",
             "errors", "workloads", "page_cache"}  # fmt: skip
    new = {"model", "repeats", "ttft_vs_best_hicache", "throughput_vs_best_hicache", "best_hicache_config"}
    assert today | new <= set(line)
    assert line["model"] == "smollm2" and line["repeats"] == 2
    assert line["best_hicache_config"] == {"multiturn_c8": "hicache-wait-r2", "trace": "hicache-buffer"}
    assert line["ttft_vs_best_hicache"] == {
        "multiturn_c8": 0.5,
        "trace": 0.8,
        "overall": pytest.approx(0.6325, 1e-3),
    }
    assert line["ttft_vs_hicache"] == line["ttft_vs_best_hicache"]["multiturn_c8"]
    assert line["ttft_resume_p50_ms_range"]["ours"] == [100, 110]
    json.dumps(line, allow_nan=False)


def test_cli_presets_and_system_names() -> None:
    def spec(*argv: str):  # type: ignore[no-untyped-def]
        return spec_from(parser().parse_args(list(argv)))

    assert spec().repeats == 3 and spec().shape.model == "smollm2"
    assert spec("--quick").repeats == 1 and spec("--quick", "--repeats", "2").repeats == 2
    assert spec("--systems", "ours,hicache").systems == (*(n for n in HICACHE if n != "hicache-nixl"), "ours")
    assert spec("--systems", "ours,hicache", "--device", "cuda").systems == (*HICACHE, "ours")
    assert expand_systems("resident,recompute") == ("recompute", "resident")  # in SYSTEMS order
    assert spec("--systems", "lmcache,ours").systems == (*LMCACHE, "ours")
    with pytest.raises(SpecError, match="unknown system"):
        expand_systems("ours,vllm")
    with pytest.raises(SpecError, match="repeats must be >= 1"):
        spec("--repeats", "0")


def _flag(flags: tuple[str, ...], name: str) -> str:
    return flags[flags.index(name) + 1]


@pytest.mark.parametrize("config", list(HICACHE.values()), ids=lambda c: c.name)
def test_each_hicache_configuration_is_its_flags(
    config: HiCacheConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "m"
    model.mkdir()
    model.joinpath("config.json").write_text(json.dumps(
        {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
         "hidden_size": 576}))  # fmt: skip
    monkeypatch.setattr(systems, "nixl_unavailable", lambda shape: None)  # as on a GPU box with nixl
    shape = Shape(pool_tokens=2048, host_budget_mb=64, disk_read_mib_s=450.0)
    system = systems.build(config.name, shape, model, tmp_path)
    assert _flag(system.flags, "--hicache-storage-prefetch-policy") == config.prefetch_policy
    assert _flag(system.flags, "--hicache-host-memory-mode") == config.memory_mode
    assert _flag(system.flags, "--hicache-storage-backend") == config.backend
    assert ("--hicache-storage-backend-extra-config" in system.flags) == config.tuned_timeout
    host_tokens = float(_flag(system.flags, "--hicache-ratio")) * shape.pool_tokens
    if config.host is HostPool.BUDGET:  # the device pool + 64 MiB of 23040-byte tokens
        assert int(host_tokens) == shape.pool_tokens + 64 * 2**20 // 23040
    else:
        assert host_tokens == (1.2 if config.memory_mode == "buffer_only" else 2.0) * shape.pool_tokens
    backend_dir = {
        "file": "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR",
        "nixl": "SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR",
    }
    assert dict(system.env)[backend_dir[config.backend]] == str(system.tier_dir)


@pytest.fixture
def instant_server() -> Iterator[str]:
    """A stand-in `/generate` that answers every request at once with the tokens it asked for."""

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = body["sampling_params"]["max_new_tokens"]
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(
            b"data: " + json.dumps({"output_ids": list(range(1, n + 1)), "meta_info": {}}).encode() + b"\n\n"
        )
        return resp

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/generate", handler)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_multiturn_drops_the_page_cache_outside_the_timed_rounds(instant_server: str) -> None:
    drops: list[float] = []

    def slow_drop() -> None:
        drops.append(time.perf_counter())
        time.sleep(0.3)

    spec = MultiTurn(concurrency=2, rounds=3, first_tokens=20, question_tokens=5, output_tokens=2)
    t = time.perf_counter()
    driven = asyncio.run(drive.multiturn(instant_server, spec, 1000, 1, slow_drop, tqdm(disable=True)))
    elapsed = time.perf_counter() - t
    assert len(drops) == 3 and elapsed >= 0.9  # one barrier before each round
    assert driven.wall_s < 0.45, "the drops' 0.9 s are not in the timed window"
    assert all(r.error is None for r in driven.results) and len(driven.results) == 6


def test_trace_replay_drops_before_the_clock_starts(instant_server: str) -> None:
    drops: list[float] = []

    def slow_drop() -> None:
        drops.append(time.perf_counter())
        time.sleep(0.3)

    reqs = [Request(f"t{i}", 0, 0, (100 + i, 101), 1, False, at_s=0.05 * i) for i in range(3)]
    driven = asyncio.run(drive.replay(instant_server, reqs, slow_drop, tqdm(disable=True)))
    assert len(drops) == 1 and driven.wall_s < 0.3  # the replay is shorter than DROP_EVERY_S
    assert all(r.error is None for r in driven.results)
