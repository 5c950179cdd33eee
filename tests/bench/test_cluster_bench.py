"""`--servers 2` (benchmarks/bench/cluster.py) without servers: the CLI's checks, the configurations, each
server's own CPUs, the order that moves every turn to the other server, and the final line."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import random
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web
from tqdm import tqdm

from benchmarks.bench import cluster, drive, systems
from benchmarks.bench.cli import cluster_run, main, parser, spec_from
from benchmarks.bench.client import ROUTED_HEADER, Result
from benchmarks.bench.spec import HICACHE, HostPool, MultiTurn, Shape
from benchmarks.bench.summary import Figures, summarize
from tests.bench.standin_http import serving


@pytest.mark.parametrize(
    "args, message",
    [
        (["--servers", "0"], "--servers must be 1 or 2, got 0"),
        (["--servers", "3"], "--servers must be 1 or 2, got 3"),
        (["--servers", "2", "--gate"], "not with --servers 2 (it runs its own configurations): --gate"),
        (["--servers", "2", "--systems", "ours", "--soak", "1"], "configurations): --systems, --soak"),
        (["--servers", "2", "--concurrency", ""], "--servers 2 runs the multi-turn workloads"),
    ],
)
def test_bad_servers_input_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr()
    assert err.err.strip().splitlines() == [f"error: {err.err.strip().removeprefix('error: ')}"]
    assert message in err.err and err.out == ""
    assert not any(tmp_path.iterdir())  # nothing ran


def test_servers_1_is_the_default_run() -> None:
    args = parser().parse_args([])
    assert args.servers == 1 and not cluster_run(args, spec_from(args))
    two = parser().parse_args(["--servers", "2", "--concurrency", "4,8"])
    assert cluster_run(two, spec_from(two))


def test_the_configurations(tmp_path: Path) -> None:
    assert [(c.name, c.system, c.shared) for c in cluster.CONFIGS] == [
        ("ours-shared", "ours", True), ("ours-shared-write-back", "ours", True),
        ("ours-separate", "ours", False), ("hicache-shared", "hicache-wait-r2", True),
    ]  # fmt: skip
    policies = {c.name: c.flags for c in cluster.CONFIGS}
    assert policies["ours-shared"] == policies["ours-separate"] == cluster.WRITE_THROUGH
    assert policies["ours-shared-write-back"] == policies["hicache-shared"] == ()
    strongest = HICACHE[cluster.STRONGEST_HICACHE]
    assert strongest.prefetch_policy == "wait_complete" and strongest.host is HostPool.DEFAULT
    for config in cluster.CONFIGS:
        built = [
            systems.build(config.system, Shape(), tmp_path, cluster._root(tmp_path, config, k))
            for k in (0, 1)
        ]
        tiers = {s.tier_dir for s in built}
        assert len(tiers) == (1 if config.shared else 2) and None not in tiers
        if config.system in HICACHE:  # HiCache's file backend finds its directory in the env
            assert {dict(s.env)["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] for s in built} == {str(*tiers)}


@pytest.fixture
def fake_cluster(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[int, ...] | None]]:
    """`run_config` with stand-ins for the servers, the router, the driver and `/metrics`, on a
    machine of 4 CPUs; returns the (system, cpus) each `System.server` call was given."""
    given: list[tuple[str, tuple[int, ...] | None]] = []

    def server(self: systems.System, model: Path, log: Path, cpus: tuple[int, ...] | None = None) -> Any:
        given.append((self.name, cpus))
        return contextlib.nullcontext(SimpleNamespace(base_url=f"http://s{len(given)}"))

    async def multiturn(*args: Any, **kwargs: Any) -> drive.Driven:
        return drive.Driven("multiturn_c2", [], 0.0)

    monkeypatch.setattr(systems.System, "server", server)
    monkeypatch.setattr(cluster, "RouterProcess", lambda urls, log_path: contextlib.nullcontext(
        SimpleNamespace(base_url="http://router")))  # fmt: skip
    monkeypatch.setattr(cluster, "scrape", lambda url: {})
    monkeypatch.setattr(cluster.run, "vocab_size", lambda model: 1000)
    monkeypatch.setattr(cluster.drive, "multiturn", multiturn)
    monkeypatch.setattr(cluster.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    return given


def test_each_configuration_runs_its_two_servers_on_distinct_cpus(
    tmp_path: Path, fake_cluster: list[tuple[str, tuple[int, ...] | None]]
) -> None:
    cpus = cluster.server_cpus()
    assert cpus == ((0, 1), (2, 3))
    spec = spec_from(parser().parse_args(["--servers", "2", "--concurrency", "2", "--out", str(tmp_path)]))
    for config in cluster.CONFIGS:
        fake_cluster.clear()
        cluster.run_config(config, spec, tmp_path, tmp_path, 0, cpus)
        assert fake_cluster == [(config.system, (0, 1)), (config.system, (2, 3))], config.name


def test_the_final_line_names_each_servers_cpus(
    tmp_path: Path, fake_cluster: list[tuple[str, tuple[int, ...] | None]], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setattr(cluster.run, "resolve_model", lambda name, cache_dir: tmp_path)
    args = ["--servers", "2", "--concurrency", "2", "--repeats", "1", "--out", str(tmp_path)]
    assert cluster.execute(spec_from(parser().parse_args(args))) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["server_cpus"] == [[0, 1], [2, 3]]
    assert {cpus for _, cpus in fake_cluster} == {(0, 1), (2, 3)}


def test_two_servers_share_a_single_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster.os, "sched_getaffinity", lambda pid: {5})
    assert cluster.server_cpus() == ((5,), (5,))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8])
def test_send_order_moves_every_turn_to_the_other_server(n: int) -> None:
    counter, last = 0, {}
    for round_ in range(5):
        order = drive.send_order(n, round_, alternate=True)
        assert sorted(order) == list(range(n))
        for conv in order:  # a round robin over two servers, taking requests as sent
            server, counter = counter % 2, counter + 1
            assert last.get(conv) != server
            last[conv] = server
    assert drive.send_order(n, 3, alternate=False) == list(range(n))  # --servers 1: as today


def figures(ttft_resume: float, tput: float, storage: float = 0.0) -> Figures:
    base = summarize([Result("a", "w", 1, True, 100, ttft_ms=1.0)], 1.0, {})
    return replace(base, ttft_resume_p50_ms=ttft_resume, throughput_tok_s=tput, hit_rate_storage=storage)


def test_final_line_names_each_configuration_and_the_ratios() -> None:
    fs = {
        "ours-shared": figures(100, 20, 0.5),
        "ours-shared-write-back": figures(300, 16),
        "ours-separate": figures(400, 10),
        "hicache-shared": figures(200, 5),
    }
    counters = [dict.fromkeys(cluster.LOOKUP_COUNTERS, 1.0), {**dict.fromkeys(cluster.LOOKUP_COUNTERS, 0.0),
                "lookup_attached_tokens": 640.0}]  # fmt: skip
    lookups = {"ours-shared": counters, "ours-separate": [dict.fromkeys(cluster.LOOKUP_COUNTERS, 0.0)] * 2}
    line = cluster.final_line({"multiturn_c8": fs, "multiturn_c16": fs}, lookups, {"repeats": 1},
                              {"ours-shared": []})  # fmt: skip
    json.dumps(line, allow_nan=False)
    assert set(cluster.RATIO_KEYS) == {"ttft_shared_vs_separate", "throughput_shared_vs_separate",
                                       "ttft_shared_vs_write_back", "throughput_shared_vs_write_back",
                                       "ttft_shared_vs_hicache", "throughput_shared_vs_hicache"}  # fmt: skip
    assert line["ttft_shared_vs_separate"] == 0.25 and line["throughput_shared_vs_separate"] == 2.0
    assert line["ttft_shared_vs_write_back"] == 0.3333 and line["throughput_shared_vs_write_back"] == 1.25
    assert line["ttft_shared_vs_hicache"] == 0.5 and line["throughput_shared_vs_hicache"] == 4.0
    assert set(line["workloads"]) == {"multiturn_c8", "multiturn_c16"}
    assert line["headline_workload"] == "multiturn_c8" and line["servers"] == 2
    assert line["hicache_config"] == "hicache-wait-r2" and line["repeats"] == 1
    for key in ("ttft_resume_p50_ms", "throughput_tok_s", "hit_rate"):
        assert set(line[key]) == {c.name for c in cluster.CONFIGS}
    assert set(line["hit_rate"]["ours-shared"]) == {"total", "device", "host", "storage"}
    assert line["hit_rate"]["ours-shared"]["storage"] == 0.5
    assert set(line["lookup_counters_total"]) == {"ours-shared", "ours-separate"}  # ours only
    assert line["lookup_counters_total"]["ours-shared"]["lookup_attached_tokens"] == 641
    assert line["lookup_counters_by_server"]["ours-shared"]["lookup_attached_tokens"] == [1, 640]
    assert line["moved_rate"] == {"ours-shared": None}  # no server known
    assert line["moved_rate_by_repeat"] == {"ours-shared": []}


def test_a_missing_configuration_is_a_null_ratio() -> None:
    line = cluster.final_line({"multiturn_c8": {"ours-shared": figures(100, 20)}}, {}, {})
    assert all(line[k] is None for k in cluster.RATIO_KEYS)
    assert math.isnan(cluster.ratios({})["ttft_shared_vs_hicache"])


def test_lookup_counters_read_from_metrics() -> None:
    samples = {'sglang:hicache_spill_lookup_attached_tokens_total{tp_rank="0"}': 64.0,
               "sglang:hicache_spill_lookups_total": 2.0, "sglang:num_requests_total": 9.0}  # fmt: skip
    got = cluster.lookup_counters(samples)
    assert got["lookup_attached_tokens"] == 64 and got["lookups"] == 2 and got["lookup_stale"] == 0
    assert set(got) == set(cluster.LOOKUP_COUNTERS)


@pytest.mark.parametrize("concurrency", [3, 4])
def test_a_round_robin_router_puts_every_turn_on_the_other_server(concurrency: int) -> None:
    """A stand-in router: round robin over two servers at the moment it takes a request, after a
    random delay (two requests sent at once may be taken in either order); it answers one token."""
    served: dict[tuple[int, ...], list[int]] = {}  # a conversation's opening tokens -> its servers
    taken = 0
    rng = random.Random(0)

    async def handler(request: web.Request) -> web.StreamResponse:
        nonlocal taken
        body = await request.json()
        await asyncio.sleep(rng.uniform(0, 0.02))
        server = taken % 2
        served.setdefault(tuple(body["input_ids"][:8]), []).append(server)
        taken += 1
        resp = web.StreamResponse(headers={ROUTED_HEADER: f"http://s{server}"})
        await resp.prepare(request)
        await asyncio.sleep(0.01)
        await resp.write(b"data: " + json.dumps({"output_ids": [7], "meta_info": {}}).encode() + b"\n\n")
        return resp

    spec = MultiTurn(concurrency=concurrency, rounds=4, first_tokens=8, question_tokens=2, output_tokens=1)
    driven = asyncio.run(_drive(handler, spec))
    assert [r.error for r in driven.results] == [None] * concurrency * 4
    assert len(served) == concurrency
    for servers in served.values():
        assert all(a != b for a, b in itertools.pairwise(servers)), served
    assert cluster.moved_rate(driven.results) == 1.0


def test_moved_rate_counts_resumed_turns_with_known_servers() -> None:
    def turn(key: str, round_: int, server: str | None, repeat: int = 0) -> Result:
        return Result(key, "w", round_, round_ > 0, 10, server=server, repeat=repeat)

    rs = [turn("c1r0", 0, "a"), turn("c1r1", 1, "b"), turn("c1r2", 2, "b"),  # moved, stayed
          turn("c2r0", 0, None), turn("c2r1", 1, "a"),  # no server known before: not counted
          turn("c1r0", 0, "b", repeat=1), turn("c1r1", 1, "a", repeat=1)]  # fmt: skip
    assert cluster.moved_rate(rs) == 2 / 3
    assert cluster.moved_rate_by_repeat(rs) == [1 / 2, 1.0]
    assert math.isnan(cluster.moved_rate(rs[3:5]))


async def _drive(handler: Any, spec: MultiTurn) -> drive.Driven:
    async with serving(handler) as url:
        with tqdm(disable=True) as bar:
            return await drive.multiturn(url, spec, 1000, 1, lambda: None, bar, alternate=True)


def test_each_configuration_gives_its_servers_its_flags(
    tmp_path: Path, fake_cluster: list[tuple[str, tuple[int, ...] | None]], monkeypatch: pytest.MonkeyPatch
) -> None:
    commands: list[tuple[str, ...]] = []

    def server(self: systems.System, model: Path, log: Path, cpus: tuple[int, ...] | None = None) -> Any:
        commands.append(self.flags)
        return contextlib.nullcontext(SimpleNamespace(base_url=f"http://s{len(commands)}"))

    monkeypatch.setattr(systems.System, "server", server)
    spec = spec_from(parser().parse_args(["--servers", "2", "--concurrency", "2", "--out", str(tmp_path)]))
    for config in cluster.CONFIGS:
        commands.clear()
        cluster.run_config(config, spec, tmp_path, tmp_path, 0, ((0,), (1,)))
        policy = [f[i + 1] for f in commands for i, a in enumerate(f) if a == "--hicache-spill-write-policy"]
        assert policy == (["write_through"] * 2 if config.flags else []), config.name
