"""`--servers 2` (benchmarks/bench/cluster.py) without servers: the CLI's checks, the configurations, each
server's own CPUs, the order that moves every turn to the other server, and the final line."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web
from tqdm import tqdm

from benchmarks.bench import cluster, cluster_line, drive, systems
from benchmarks.bench.cli import cluster_run, main, parser, spec_from
from benchmarks.bench.client import ROUTED_HEADER, Result
from benchmarks.bench.lmcache_process import DaemonSpec
from benchmarks.bench.server_process import ServerStartError
from benchmarks.bench.spec import HICACHE, LMCACHE, HostPool, MultiTurn, Shape, SpecError
from benchmarks.bench.summary import Figures, summarize
from sgl_hicache.config import MooncakeConfig
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
    rr, approx, events = cluster.Router.ROUND_ROBIN, cluster.Router.APPROX_TREE, cluster.Router.KV_EVENTS
    dir_, mooncake, lmcache = cluster.Store.DIRECTORY, cluster.Store.MOONCAKE, cluster.Store.LMCACHE
    alt, shuf, sticky = drive.Dispatch.ALTERNATE, drive.Dispatch.SHUFFLED, drive.Dispatch.STICKY
    assert [(c.name, c.system, c.shared, c.store, c.router, c.dispatch) for c in cluster.CONFIGS] == [
        ("ours-shared", "ours", True, dir_, rr, alt), ("ours-shared-write-back", "ours", True, dir_, rr, alt),
        ("ours-separate", "ours", False, dir_, rr, alt), ("hicache-shared", "hicache-wait-r2", True, dir_, rr, alt),
        ("ours-mooncake", "ours", True, mooncake, rr, alt), ("ours-mooncake-by-group", "ours", True, mooncake, rr, alt),
        ("ours-mooncake-local", "ours", True, mooncake, rr, alt),
        ("ours-shared-sticky", "ours", True, dir_, rr, sticky), ("ours-mooncake-sticky", "ours", True, mooncake, rr, sticky),
        ("ours-mooncake-local-sticky", "ours", True, mooncake, rr, sticky),
        ("hicache-mooncake", "hicache-wait-r2", True, mooncake, rr, alt),
        ("ours-mooncake-standalone", "ours", True, mooncake, rr, alt),
        ("ours-mooncake-standalone-sticky", "ours", True, mooncake, rr, sticky),
        ("hicache-mooncake-standalone", "hicache-wait-r2", True, mooncake, rr, alt),
        ("lmcache-shared", "lmcache-disk", True, lmcache, rr, alt),
        ("route-round-robin", "ours", False, dir_, rr, shuf), ("route-approx-tree", "ours", False, dir_, approx, shuf),
        ("route-approx-tree-protected", "ours", False, dir_, cluster.Router.APPROX_TREE_PROTECTED, shuf),
        ("route-kv-events", "ours", False, dir_, events, shuf),
        ("route-round-robin-grpc", "ours", False, dir_, cluster.Router.ROUND_ROBIN_GRPC, shuf),
    ]  # fmt: skip
    policies = {c.name: c.flags for c in cluster.CONFIGS}
    assert (
        policies["ours-shared"]
        == policies["ours-separate"]
        == policies["ours-mooncake"]
        == policies["ours-mooncake-by-group"]
        == policies["ours-mooncake-local"]
        == policies["ours-shared-sticky"]
        == policies["ours-mooncake-sticky"]
        == policies["ours-mooncake-local-sticky"]
        == policies["ours-mooncake-standalone"]
        == policies["ours-mooncake-standalone-sticky"]
        == cluster.WRITE_THROUGH
    )
    assert [c.name for c in cluster.CONFIGS if c.standalone] == [
        "ours-mooncake-standalone",
        "ours-mooncake-standalone-sticky",
        "hicache-mooncake-standalone",
    ]
    assert (
        policies["ours-shared-write-back"]
        == policies["hicache-shared"]
        == policies["hicache-mooncake-standalone"]
        == policies["route-round-robin"]
        == ()
    )
    assert policies["route-approx-tree"] == () and policies["route-kv-events"] == cluster.EVENTS_MEDIUM
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


@dataclass
class FakeCluster:
    """What `run_config` asked of the stand-ins."""

    # (system, cpus, gRPC, command line, environment) of each server
    servers: list[tuple[str, tuple[int, ...] | None, bool, tuple[str, ...], dict[str, str]]] = field(
        default_factory=list
    )
    routers: list[tuple[list[str], str, tuple[str, ...]]] = field(default_factory=list)
    drives: list[tuple[drive.Dispatch, str | None]] = field(default_factory=list)  # (dispatch, model)
    masters: list[Path] = field(default_factory=list)
    real_clients: list[tuple[object, int]] = field(default_factory=list)  # (master, segment bytes)
    daemons: list[DaemonSpec] = field(default_factory=list)  # LMCache daemons started
    events: list[str] = field(
        default_factory=list
    )  # servers started and stopped, masters, real clients and daemons stopped

    def clear(self) -> None:
        for part in (self.servers, self.routers, self.drives, self.masters, self.real_clients, self.daemons,
                     self.events):  # fmt: skip
            part.clear()


class FakeMaster:
    def __init__(self, log_dir: Path, fake: FakeCluster) -> None:
        self.log_dir, self.fake = log_dir, fake
        fake.masters.append(log_dir)

    def __enter__(self) -> Any:
        return SimpleNamespace(config=lambda segment_bytes: MooncakeConfig(
            master="127.0.0.1:1", metadata_server="http://127.0.0.1:2/metadata", protocol="tcp",
            global_segment_size=segment_bytes, local_buffer_size=16 * 2**20))  # fmt: skip

    def __exit__(self, *exc: object) -> None:
        self.fake.events.append("stop master")


class FakeRealClient:
    address = "127.0.0.1:3"

    def __init__(self, master: object, log_dir: Path, segment_bytes: int, fake: FakeCluster) -> None:
        self.fake = fake
        fake.real_clients.append((master, segment_bytes))

    def __enter__(self) -> FakeRealClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.fake.events.append("stop real client")


class FakeDaemon:
    def __init__(self, spec: DaemonSpec, log_path: Path, fake: FakeCluster) -> None:
        self.spec, self.fake = spec, fake

    def __enter__(self) -> FakeDaemon:
        self.fake.daemons.append(self.spec)
        return self

    def write_config(self, path: Path) -> Path:
        path.write_text("mp_host: 127.0.0.1\nmp_port: 1\n")
        return path

    def __exit__(self, *exc: object) -> None:
        self.fake.events.append("stop daemon")


@dataclass
class HttpStandIn:
    """A stand-in server; `/metrics` says which server and which way it was read."""

    k: int
    events: list[str]

    @property
    def base_url(self) -> str:
        return f"http://s{self.k}"

    def start(self) -> None:
        self.events.append(f"start s{self.k}")

    def stop(self) -> None:
        self.events.append(f"stop s{self.k}")


class GrpcStandIn(HttpStandIn):
    @property
    def grpc_url(self) -> str:
        return f"grpc://s{self.k}"

    def metrics(self) -> dict[str, float]:  # the sidecar's, renamed (GrpcServer.metrics)
        return {key: 100 * v for key, v in http_metrics(self.base_url).items()}


READS: dict[str, int] = {}


def http_metrics(url: str) -> dict[str, float]:
    """Server k's counter grows by k at each read."""
    READS[url] = READS.get(url, 0) + 1
    return {"sglang:hicache_spill_lookups_total": float(url.removeprefix("http://s")) * READS[url]}


@pytest.fixture
def fake_cluster(monkeypatch: pytest.MonkeyPatch) -> FakeCluster:
    """`run_config` with stand-ins for the servers (gRPC ones where asked), the router, the Mooncake
    master, the driver (one answer, 1 of 2 tokens cached on device) and `/metrics` (a lookup counter
    growing by the server's number, by 100 times it when read over gRPC), on a machine of 4 CPUs;
    returns what each was asked."""
    fake = FakeCluster()

    def server(self: systems.System, model: Path, log: Path, cpus: tuple[int, ...] | None = None,
               grpc: bool = False) -> Any:  # fmt: skip
        fake.servers.append((self.name, cpus, grpc, self.flags, dict(self.env)))
        return (GrpcStandIn if grpc else HttpStandIn)(len(fake.servers), fake.events)

    def router(urls: list[str], policy: str = "round_robin", log_path: Path | None = None,
               extra_args: tuple[str, ...] = ()) -> Any:  # fmt: skip
        fake.routers.append((list(urls), policy, tuple(extra_args)))
        return contextlib.nullcontext(SimpleNamespace(base_url="http://router"))

    async def multiturn(*args: Any) -> drive.Driven:
        fake.drives.append((args[6], args[7]))
        answer = Result("c0r1", "multiturn_c2", 1, True, 2, ttft_ms=1.0, cached_tokens=1,
                        cached={"device": 1, "host": 0, "storage": 0})  # fmt: skip
        return drive.Driven("multiturn_c2", [answer], 1.0)

    monkeypatch.setattr(systems.System, "server", server)
    monkeypatch.setattr(cluster, "RouterProcess", router)
    monkeypatch.setattr(cluster, "MooncakeMaster", lambda log_dir: FakeMaster(log_dir, fake))
    monkeypatch.setattr(cluster, "MooncakeRealClient", lambda master, log_dir, segment_bytes: FakeRealClient(
        master, log_dir, segment_bytes, fake))  # fmt: skip
    monkeypatch.setattr(cluster, "LMCacheDaemon", lambda spec, log_path: FakeDaemon(spec, log_path, fake))
    monkeypatch.setattr(cluster, "GrpcServer", GrpcStandIn)
    monkeypatch.setattr(cluster, "scrape", http_metrics)
    monkeypatch.setattr(cluster.run, "vocab_size", lambda model: 1000)
    monkeypatch.setattr(cluster.drive, "multiturn", multiturn)
    monkeypatch.setattr(cluster.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    return fake


def test_each_configuration_runs_its_two_servers_on_distinct_cpus(
    tmp_path: Path, fake_cluster: FakeCluster
) -> None:
    cpus = cluster.server_cpus()
    assert cpus == ((0, 1), (2, 3))
    spec = spec_from(parser().parse_args(["--servers", "2", "--concurrency", "2", "--out", str(tmp_path)]))
    for config in cluster.CONFIGS:
        fake_cluster.clear()
        cluster.run_config(config, spec, tmp_path, tmp_path, 0, cpus)
        assert [(s[0], s[1]) for s in fake_cluster.servers] == [
            (config.system, (0, 1)),
            (config.system, (2, 3)),
        ]


def test_each_configuration_has_its_router_store_and_dispatch(
    tmp_path: Path, fake_cluster: FakeCluster
) -> None:
    spec = spec_from(parser().parse_args(["--servers", "2", "--concurrency", "2", "--out", str(tmp_path)]))
    model = tmp_path / "model"
    seen = {}
    for config in cluster.CONFIGS:
        fake_cluster.clear()
        done = cluster.run_config(config, spec, model, tmp_path, 0, ((0,), (1,)))
        [(urls, policy, extra)] = fake_cluster.routers
        grpc = {s[2] for s in fake_cluster.servers}
        mooncake = [flag_value(s[3], "--hicache-spill-mooncake-config") or flag_value(
            s[3], "--hicache-storage-backend-extra-config") for s in fake_cluster.servers]  # fmt: skip
        seen[config.name] = (policy, urls, grpc, len(fake_cluster.masters), list(fake_cluster.drives))
        protected = config.router is cluster.Router.APPROX_TREE_PROTECTED  # smg's defaults
        assert ("--disable-worker-overload-protection" in extra) == (
            policy == "cache_aware" and not protected
        )
        # a new conversation goes to the least loaded worker: loads read each second, not each 10
        assert (flag_value(extra, "--load-monitor-interval") == "1") == (
            policy == "cache_aware" and not protected
        )
        if grpc == {True}:  # smg tokenizes for gRPC workers, in blocks of a page
            assert flag_value(extra, "--block-size") == str(spec.shape.page_size)
            assert flag_value(extra, "--model-path") == str(model)
        # each server's counters, read its own way (the sidecar's over gRPC), and the split by tier
        # left unknown where smg's answers over gRPC name none
        k = 100 if grpc == {True} else 1
        assert [c["lookups"] for c in done.by_server] == [k * 1, k * 2], config.name
        [answer] = done.outcome.results["multiturn_c2"]
        assert answer.cached == (None if grpc == {True} else {"device": 1, "host": 0, "storage": 0})
        if config.store is cluster.Store.MOONCAKE:  # one master, both servers its clients, stopped last
            assert len(fake_cluster.masters) == 1 and mooncake[0] == mooncake[1] is not None
            assert fake_cluster.events[-1] == "stop master"
            if config.standalone:  # through one real client, stopped before the master
                assert len(fake_cluster.real_clients) == 1 and "127.0.0.1:3" in str(mooncake[0])
                assert fake_cluster.events[-2] == "stop real client"
            else:
                assert "127.0.0.1:1" in str(mooncake[0]) and str(1024 * 2**20) in str(mooncake[0])
                assert fake_cluster.real_clients == []
        else:
            assert fake_cluster.masters == fake_cluster.real_clients == [] and mooncake == [None, None]
    alt, shuf, sticky = drive.Dispatch.ALTERNATE, drive.Dispatch.SHUFFLED, drive.Dispatch.STICKY
    http, grpc_urls = ["http://s1", "http://s2"], ["grpc://s1", "grpc://s2"]
    assert seen["ours-shared"] == ("round_robin", http, {False}, 0, [(alt, None)])
    assert seen["ours-mooncake"] == ("round_robin", http, {False}, 1, [(alt, None)])
    assert seen["ours-mooncake-sticky"] == ("round_robin", http, {False}, 1, [(sticky, None)])
    assert seen["ours-shared-sticky"] == ("round_robin", http, {False}, 0, [(sticky, None)])
    assert seen["route-round-robin"] == ("round_robin", http, {False}, 0, [(shuf, None)])
    assert seen["route-approx-tree"] == ("cache_aware", http, {False}, 0, [(shuf, None)])
    assert seen["route-approx-tree-protected"] == ("cache_aware", http, {False}, 0, [(shuf, None)])
    assert seen["route-kv-events"] == ("cache_aware", grpc_urls, {True}, 0, [(shuf, str(model))])
    assert seen["route-round-robin-grpc"] == ("round_robin", grpc_urls, {True}, 0, [(shuf, str(model))])


def flag_value(args: tuple[str, ...], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_a_hicache_shape_that_cannot_hold_a_conversation_is_refused_before_any_server(
    tmp_path: Path, fake_cluster: FakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cluster.run, "resolve_model", lambda name, cache_dir: tmp_path)
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = ["--servers", "2", "--concurrency", "2", "--pool-tokens", "256", "--first-tokens", "2000",
            "--out", str(tmp_path / "out")]  # fmt: skip
    with pytest.raises(SpecError, match=r"^hicache-wait-r2: its host pool holds 256 tokens"):
        cluster.execute(spec_from(parser().parse_args(args)), cluster.select("ours-shared,hicache-shared"))
    assert fake_cluster.servers == [] and not (tmp_path / "out").exists()
    cluster.execute(
        spec_from(parser().parse_args(args)), cluster.select("ours-shared")
    )  # ours: no such bound


def test_configs_selects_and_rejects(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert [c.name for c in cluster.select("route-kv-events, ours-shared")] == [
        "ours-shared",
        "route-kv-events",
    ]
    assert cluster.select(None) == cluster.CONFIGS
    for bad in ("ours-nope", " , "):
        with pytest.raises(SpecError, match=r"--configs: unknown .*\(known: ours-shared, "):
            cluster.select(bad)
    assert main(["--out", str(tmp_path), "--configs", "ours-shared"]) == 2
    assert "--configs names configurations of --servers 2" in capsys.readouterr().err
    # a configuration that cannot run on CPU (none is now), asked for alone: refused in one line
    monkeypatch.setattr(cluster, "UNAVAILABLE_ON_CPU", {"hicache-mooncake": "no such copy on CPU"})

    def build_model(*a: object) -> None:  # on a fresh machine: minutes, and a progress bar on stderr
        raise AssertionError("the model was built before the configurations were checked")

    monkeypatch.setattr(cluster.run, "resolve_model", build_model)
    only_skipped = ["--out", str(tmp_path / "x"), "--servers", "2", "--configs", "hicache-mooncake"]
    assert main(only_skipped) == 2  # on CPU
    err = capsys.readouterr().err
    assert err.startswith("error: --configs: none of hicache-mooncake can run here: no such copy on CPU")
    assert len(err.strip().splitlines()) == 1


def test_the_final_line_names_each_servers_cpus_and_what_was_skipped(
    tmp_path: Path, fake_cluster: FakeCluster, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setattr(cluster.run, "resolve_model", lambda name, cache_dir: tmp_path)
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))  # HiCache's host pool is checked in tokens
    args = ["--servers", "2", "--concurrency", "2", "--repeats", "1", "--out", str(tmp_path)]
    assert cluster.execute(spec_from(parser().parse_args(args))) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["server_cpus"] == [[0, 1], [2, 3]]
    assert {s[1] for s in fake_cluster.servers} == {(0, 1), (2, 3)}
    # every configuration runs on CPU (hicache-mooncake on the profile's copies) but those that run nowhere
    assert line["skipped"] == cluster.UNAVAILABLE and set(cluster.UNAVAILABLE) == {
        "hicache-mooncake-standalone"
    }
    assert set(line["router"]) == set(cluster.BY_NAME) - set(cluster.UNAVAILABLE)
    assert line["router"]["route-kv-events"] == cluster.Router.KV_EVENTS.value
    # every configuration's directories (an LMCache daemon's disk tier too), not a Mooncake Store
    assert set(line["tier_mb"]) == {c.name for c in cluster.CONFIGS if c.store is not cluster.Store.MOONCAKE}
    # after each run, its requests so far (a run stopped midway keeps them): after the last, all
    (run_dir,) = tmp_path.glob("run-*")
    partial = json.loads((run_dir / "partial" / "results.json").read_text())
    assert partial["final"] == {"runs_done": len(line["order"]), "runs": len(line["order"])}
    assert (run_dir / "partial" / "requests.csv").read_text() == (run_dir / "requests.csv").read_text()
    gpu = replace(spec_from(parser().parse_args(args)), shape=Shape(device="cuda"))
    assert all(cluster.unavailable(c, gpu.shape) == cluster.UNAVAILABLE.get(c.name) for c in cluster.CONFIGS)


def test_a_configuration_that_cannot_run_here_is_named_in_skipped_and_not_run(
    tmp_path: Path, fake_cluster: FakeCluster, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setattr(cluster.run, "resolve_model", lambda name, cache_dir: tmp_path)
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(cluster, "UNAVAILABLE_ON_CPU", {"hicache-mooncake": "no such copy on CPU"})
    args = ["--servers", "2", "--concurrency", "2", "--repeats", "1", "--out", str(tmp_path)]
    chosen = cluster.select("ours-mooncake,hicache-mooncake")
    assert cluster.execute(spec_from(parser().parse_args(args)), chosen) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["skipped"] == {"hicache-mooncake": "no such copy on CPU"}
    assert set(line["router"]) == {"ours-mooncake"} and {s[0] for s in fake_cluster.servers} == {"ours"}
    assert line["ttft_mooncake_vs_hicache_mooncake"] is None


def test_hicache_mooncake_is_sglangs_mooncake_l3_on_a_master_of_its_own_like_ours(
    tmp_path: Path, fake_cluster: FakeCluster
) -> None:
    """Issue 40: `hicache-mooncake` runs on CPU: both servers are sglang HiCache (the strongest
    configuration's flags) with the `mooncake` L3 on one master started for the run, in the
    page_first_direct layout with the direct I/O backend and the CPU patches switched on; the store
    settings are ours-mooncake's (same kind of master, same segment per server, TCP on loopback)."""
    spec = spec_from(parser().parse_args(["--servers", "2", "--concurrency", "2", "--out", str(tmp_path)]))
    seen = {}
    for name in ("ours-mooncake", "hicache-mooncake"):
        fake_cluster.clear()
        cluster.run_config(cluster.BY_NAME[name], spec, tmp_path, tmp_path, 0, ((0,), (1,)))
        assert len(fake_cluster.masters) == 1 and fake_cluster.events[-1] == "stop master"
        seen[name] = [(s[0], s[3], s[4]) for s in fake_cluster.servers]
    hicache = seen["hicache-mooncake"]
    assert [system for system, _, _ in hicache] == [cluster.STRONGEST_HICACHE] * 2
    assert hicache[0][1] == hicache[1][1] and hicache[0][2] == hicache[1][2]  # one store, one command line
    flags, env = hicache[0][1], hicache[0][2]
    strongest = HICACHE[cluster.STRONGEST_HICACHE]
    assert (
        "--enable-hierarchical-cache" in flags
        and flag_value(flags, "--hicache-storage-backend") == "mooncake"
    )
    assert flag_value(flags, "--hicache-io-backend") == "direct"
    assert flag_value(flags, "--hicache-mem-layout") == "page_first_direct"  # sglang's for a mooncake L3
    assert flag_value(flags, "--hicache-storage-prefetch-policy") == strongest.prefetch_policy
    assert env == {"SGL_HICACHE_CPU_HICACHE_COMPAT": "1"}  # no file backend directory
    extra = json.loads(flag_value(flags, "--hicache-storage-backend-extra-config") or "{}")
    ours = json.loads(flag_value(seen["ours-mooncake"][0][1], "--hicache-spill-mooncake-config") or "{}")
    assert extra == {systems.MOONCAKE_EXTRA_CONFIG[k]: v for k, v in ours.items()}
    assert extra["master_server_address"] == "127.0.0.1:1" and extra["protocol"] == "tcp"
    assert extra["global_segment_size"] == cluster.MOONCAKE_SEGMENT


@pytest.mark.parametrize(
    ("name", "like"),
    [("ours-mooncake-standalone", "ours-mooncake"), ("ours-mooncake-standalone-sticky", "ours-mooncake-sticky"),
     ("hicache-mooncake-standalone", "hicache-mooncake")],
)  # fmt: skip
def test_a_standalone_configuration_joins_through_one_real_client_holding_both_segments(
    tmp_path: Path, fake_cluster: FakeCluster, name: str, like: str
) -> None:
    """Issue 40: the standalone configurations start one real client after the master, with both
    servers' segments in its own, and stop it before the master; each server joins the store
    through it and is otherwise its counterpart's: ours with `real_client` and its own staging
    buffer only (no master, segment or transport: the real client's; placement left at "any"),
    HiCache with sglang's `standalone_storage` and `client_server_address` only."""
    spec = spec_from(parser().parse_args(["--servers", "2", "--concurrency", "2", "--out", str(tmp_path)]))
    seen = {}
    for config in (cluster.BY_NAME[like], cluster.BY_NAME[name]):  # the standalone one last
        fake_cluster.clear()
        cluster.run_config(config, spec, tmp_path, tmp_path, 0, ((0,), (1,)))
        seen[config.name] = [(s[0], s[3], s[4]) for s in fake_cluster.servers]
    [(master, segment)] = fake_cluster.real_clients
    assert segment == cluster.SERVERS * cluster.MOONCAKE_SEGMENT and len(fake_cluster.masters) == 1
    assert isinstance(master, FakeMaster) and fake_cluster.events[-2:] == ["stop real client", "stop master"]
    standalone, counterpart = seen[name], seen[like]
    assert standalone[0] == standalone[1]  # one store, one command line
    given = {flag: flag_value(standalone[0][1], flag) for flag in (
        "--hicache-spill-mooncake-config", "--hicache-storage-backend-extra-config")}  # fmt: skip
    if cluster.BY_NAME[name].system == "ours":
        settings = json.loads(given["--hicache-spill-mooncake-config"] or "{}")
        own = json.loads(flag_value(counterpart[0][1], "--hicache-spill-mooncake-config") or "{}")
        assert settings == {"real_client": "127.0.0.1:3", "local_buffer_size": own["local_buffer_size"]}
        assert MooncakeConfig.from_user(settings).placement == "any"
    else:
        extra = json.loads(given["--hicache-storage-backend-extra-config"] or "{}")
        assert extra == {"standalone_storage": True, "client_server_address": "127.0.0.1:3"}
        assert flag_value(standalone[0][1], "--hicache-mem-layout") == "page_first_direct"
    assert [s[0] for s in standalone] == [s[0] for s in counterpart] and standalone[0][2] == counterpart[0][2]
    drop = {"--hicache-spill-mooncake-config", "--hicache-storage-backend-extra-config"}
    renamed = [a.replace(f"/{name}/", f"/{like}/") for a in standalone[0][1]]  # its tier directory
    assert without(renamed, drop) == without(counterpart[0][1], drop)


def without(args: Sequence[str], flags: set[str]) -> list[str]:
    """`args` less each of `flags` and its value."""
    out, skip = [], False
    for a in args:
        if not skip and a not in flags:
            out.append(a)
        skip = a in flags
    return out


@pytest.mark.parametrize(
    ("variant", "setting"),
    [("ours-mooncake-by-group", ("load_calls", "by_group")), ("ours-mooncake-local", ("placement", "local")),
     ("ours-mooncake-local-sticky", ("placement", "local"))],
)  # fmt: skip
def test_an_ours_mooncake_variant_is_ours_mooncake_with_one_setting_more(
    tmp_path: Path, fake_cluster: FakeCluster, variant: str, setting: tuple[str, str]
) -> None:
    """Issue 40's switches side by side: the same store settings, but one (`load_calls` by_group;
    `placement` local); the defaults (merged, any) are not written out."""
    spec = spec_from(parser().parse_args(["--servers", "2", "--concurrency", "2", "--out", str(tmp_path)]))
    seen = {}
    for name in ("ours-mooncake", variant):
        fake_cluster.clear()
        cluster.run_config(cluster.BY_NAME[name], spec, tmp_path, tmp_path, 0, ((0,), (1,)))
        seen[name] = [json.loads(flag_value(s[3], "--hicache-spill-mooncake-config") or "{}")
                      for s in fake_cluster.servers]  # fmt: skip
    default, (key, value) = seen["ours-mooncake"], setting
    assert default[0]["master"] == "127.0.0.1:1" and key not in default[0]
    assert seen[variant] == [{**c, key: value} for c in default]


def test_two_servers_share_a_single_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster.os, "sched_getaffinity", lambda pid: {5})
    assert cluster.server_cpus() == ((5,), (5,))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8])
def test_send_order_moves_every_turn_to_the_other_server(n: int) -> None:
    counter, last = 0, {}
    for round_ in range(5):
        order = drive.send_order(n, round_, drive.Dispatch.ALTERNATE)
        assert sorted(order) == list(range(n))
        for conv in order:  # a round robin over two servers, taking requests as sent
            server, counter = counter % 2, counter + 1
            assert last.get(conv) != server
            last[conv] = server
    assert drive.send_order(n, 3, drive.Dispatch.TOGETHER) == list(range(n))  # --servers 1: as today


@pytest.mark.parametrize("n", [2, 4, 8])
def test_sticky_turns_stay_on_their_server_under_round_robin(n: int) -> None:
    """STICKY: every round the same order, one after another: a round robin over two servers gives
    each conversation the server of its previous turns (an even count of them)."""
    counter, first = 0, {}
    for round_ in range(5):
        order = drive.send_order(n, round_, drive.Dispatch.STICKY)
        assert order == list(range(n))
        for conv in order:
            server, counter = counter % 2, counter + 1
            assert first.setdefault(conv, server) == server


def test_shuffled_turns_move_about_half_of_them_under_round_robin() -> None:
    """SHUFFLED: a permutation per round, the same for the same seed (every routing configuration
    gets the same orders), different across rounds; a round robin taking them moves about half of
    the turns (in index order it would move none for an even count)."""
    n, rounds = 8, 40
    orders = [drive.send_order(n, k, drive.Dispatch.SHUFFLED, seed=3) for k in range(rounds)]
    assert all(sorted(o) == list(range(n)) for o in orders)
    assert orders == [drive.send_order(n, k, drive.Dispatch.SHUFFLED, seed=3) for k in range(rounds)]
    assert len({tuple(o) for o in orders}) > rounds // 2
    assert drive.send_order(n, 0, drive.Dispatch.SHUFFLED, seed=4) != orders[0]
    moved, last, counter = 0, {}, 0
    for order in orders:
        for conv in order:
            server, counter = counter % 2, counter + 1
            moved += conv in last and last[conv] != server
            last[conv] = server
    assert 0.3 < moved / (n * (rounds - 1)) < 0.7


def figures(ttft_resume: float, tput: float, storage: float = 0.0) -> Figures:
    base = summarize([Result("a", "w", 1, True, 100, ttft_ms=1.0)], 1.0, {})
    return replace(base, ttft_resume_p50_ms=ttft_resume, throughput_tok_s=tput, hit_rate_storage=storage)


def test_final_line_names_each_configuration_and_the_ratios() -> None:
    fs = {
        "ours-shared": figures(100, 20, 0.5),
        "ours-shared-write-back": figures(300, 16),
        "ours-separate": figures(400, 10),
        "hicache-shared": figures(200, 5),
        "lmcache-shared": figures(125, 8, 0.3),
        "ours-mooncake": figures(150, 25, 0.4),
        "hicache-mooncake": figures(300, 10, 0.2),
        "route-round-robin": figures(600, 8, 0.1),
        "route-approx-tree": figures(500, 10, 0.2),
        "route-kv-events": replace(  # its answers named no split by tier
            summarize([Result("a", "w", 1, True, 4, ttft_ms=1.0, cached_tokens=3, cached=None)], 1.0, {}),
            ttft_resume_p50_ms=250,
            throughput_tok_s=16,
        ),
    }
    counters = [dict.fromkeys(cluster_line.LOOKUP_COUNTERS, 1.0), {**dict.fromkeys(cluster_line.LOOKUP_COUNTERS, 0.0),
                "lookup_attached_tokens": 640.0}]  # fmt: skip
    lookups = {
        "ours-shared": counters,
        "ours-separate": [dict.fromkeys(cluster_line.LOOKUP_COUNTERS, 0.0)] * 2,
    }
    extra = {"repeats": 1, "servers": 2, "hicache_config": "hicache-wait-r2"}
    line = cluster_line.final_line({"multiturn_c8": fs, "multiturn_c16": fs}, lookups, extra,
                                   {"ours-shared": []})  # fmt: skip
    json.dumps(line, allow_nan=False)
    pairs = ("shared_vs_separate", "shared_vs_write_back", "shared_vs_hicache", "shared_vs_lmcache", "mooncake_vs_shared",
             "mooncake_vs_hicache", "mooncake_vs_hicache_mooncake", "mooncake_merged_vs_by_group", "mooncake_local_vs_any", "mooncake_vs_shared_sticky", "mooncake_local_vs_any_sticky",
             "mooncake_standalone_vs_shared", "mooncake_standalone_vs_mooncake",
             "mooncake_standalone_vs_hicache_mooncake_standalone", "mooncake_standalone_vs_shared_sticky",
             "events_vs_round_robin", "events_vs_approx_tree",
             "events_vs_round_robin_grpc", "events_vs_approx_tree_protected")  # fmt: skip
    assert set(cluster_line.RATIO_KEYS) == {f"{fig}_{p}" for p in pairs for fig in ("ttft", "throughput")}
    assert line["ttft_mooncake_vs_shared"] == 1.5 and line["throughput_mooncake_vs_hicache"] == 5.0
    assert (
        line["ttft_mooncake_vs_hicache_mooncake"] == 0.5
        and line["throughput_mooncake_vs_hicache_mooncake"] == 2.5
    )
    assert line["ttft_events_vs_round_robin"] == 0.4167 and line["throughput_events_vs_approx_tree"] == 1.6
    assert fs["route-kv-events"].hit_rate == 0.75
    assert line["hit_rate"]["route-kv-events"] == {
        "total": 0.75,
        "device": None,
        "host": None,
        "storage": None,
    }  # no split through smg over gRPC
    assert line["ttft_shared_vs_separate"] == 0.25 and line["throughput_shared_vs_separate"] == 2.0
    assert line["ttft_shared_vs_write_back"] == 0.3333 and line["throughput_shared_vs_write_back"] == 1.25
    assert line["ttft_shared_vs_hicache"] == 0.5 and line["throughput_shared_vs_hicache"] == 4.0
    assert line["ttft_shared_vs_lmcache"] == 0.8 and line["throughput_shared_vs_lmcache"] == 2.5
    assert set(line["workloads"]) == {"multiturn_c8", "multiturn_c16"}
    assert line["headline_workload"] == "multiturn_c8" and line["servers"] == 2
    assert line["hicache_config"] == "hicache-wait-r2" and line["repeats"] == 1
    for key in ("ttft_resume_p50_ms", "throughput_tok_s", "hit_rate"):
        assert set(line[key]) == set(fs)
    assert set(line["hit_rate"]["ours-shared"]) == {"total", "device", "host", "storage"}
    assert line["hit_rate"]["ours-shared"]["storage"] == 0.5
    assert set(line["lookup_counters_total"]) == {"ours-shared", "ours-separate"}  # ours only
    assert line["lookup_counters_total"]["ours-shared"]["lookup_attached_tokens"] == 641
    assert line["lookup_counters_by_server"]["ours-shared"]["lookup_attached_tokens"] == [1, 640]
    assert line["moved_rate"] == {"ours-shared": None}  # no server known
    assert line["moved_rate_by_repeat"] == {"ours-shared": []}


def test_a_missing_configuration_is_a_null_ratio() -> None:
    line = cluster_line.final_line({"multiturn_c8": {"ours-shared": figures(100, 20)}}, {}, {})
    assert all(line[k] is None for k in cluster_line.RATIO_KEYS)
    assert math.isnan(cluster_line.ratios({})["ttft_shared_vs_hicache"])


def test_lookup_counters_read_from_metrics() -> None:
    samples = {'sglang:hicache_spill_lookup_attached_tokens_total{tp_rank="0"}': 64.0,
               "sglang:hicache_spill_lookups_total": 2.0, "sglang:num_requests_total": 9.0}  # fmt: skip
    got = cluster_line.lookup_counters(samples)
    assert got["lookup_attached_tokens"] == 64 and got["lookups"] == 2 and got["lookup_stale"] == 0
    assert set(got) == set(cluster_line.LOOKUP_COUNTERS)


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
    assert cluster_line.moved_rate(driven.results) == 1.0


def test_moved_rate_counts_resumed_turns_with_known_servers() -> None:
    def turn(key: str, round_: int, server: str | None, repeat: int = 0) -> Result:
        return Result(key, "w", round_, round_ > 0, 10, server=server, repeat=repeat)

    rs = [turn("c1r0", 0, "a"), turn("c1r1", 1, "b"), turn("c1r2", 2, "b"),  # moved, stayed
          turn("c2r0", 0, None), turn("c2r1", 1, "a"),  # no server known before: not counted
          turn("c1r0", 0, "b", repeat=1), turn("c1r1", 1, "a", repeat=1)]  # fmt: skip
    assert cluster_line.moved_rate(rs) == 2 / 3
    assert cluster_line.moved_rate_by_repeat(rs) == [1 / 2, 1.0]
    assert math.isnan(cluster_line.moved_rate(rs[3:5]))


async def _drive(handler: Any, spec: MultiTurn) -> drive.Driven:
    async with serving(handler) as url:
        with tqdm(disable=True) as bar:
            return await drive.multiturn(url, spec, 1000, 1, lambda: None, bar, drive.Dispatch.ALTERNATE)


def test_each_configuration_gives_its_servers_its_flags(tmp_path: Path, fake_cluster: FakeCluster) -> None:
    spec = spec_from(parser().parse_args(["--servers", "2", "--concurrency", "2", "--out", str(tmp_path)]))
    for config in cluster.CONFIGS:
        fake_cluster.clear()
        cluster.run_config(config, spec, tmp_path, tmp_path, 0, ((0,), (1,)))
        commands = [s[3] for s in fake_cluster.servers]
        policy = [flag_value(f, "--hicache-spill-write-policy") for f in commands]
        assert policy == [("write_through" if config.flags == cluster.WRITE_THROUGH else None)] * 2, (
            config.name
        )
        medium = [flag_value(f, "--hicache-spill-kv-events-medium") for f in commands]
        assert medium == [("cpu_pinned" if config.router.grpc else None)] * 2
        backend = [flag_value(f, "--hicache-spill-backend") or flag_value(f, "--hicache-storage-backend")
                   for f in commands]  # fmt: skip
        want = (
            "mooncake"
            if config.store is cluster.Store.MOONCAKE
            else None
            if config.system == "ours" or config.system in LMCACHE
            else "file"
        )
        assert backend == [want] * 2, config.name
        lmcache = [flag_value(f, "--lmcache-config-file") for f in commands]
        if config.store is cluster.Store.LMCACHE:  # both on the one daemon, started for the run
            assert len(set(lmcache)) == 1 and None not in lmcache and "--enable-lmcache" in commands[0]
            [daemon] = fake_cluster.daemons
            assert daemon.l1_mb == 2 * spec.shape.host_budget_mb  # both servers' host budgets
            assert daemon.l2_dir is not None and daemon.l2_dir.parent == tmp_path / config.name
            assert fake_cluster.events[-1] == "stop daemon"  # after the servers
        else:
            assert lmcache == [None] * 2 and fake_cluster.daemons == []


def test_a_server_that_does_not_start_stops_the_other_at_once(
    tmp_path: Path, fake_cluster: FakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Server 1 boots until its process is stopped (as a real one then fails at once); server 2
    fails: server 1 is stopped then, not after its whole boot, and no router starts."""
    made = systems.System.server
    stopped = threading.Event()

    def booting() -> None:
        fake_cluster.events.append("start s1")
        if not stopped.wait(10):
            fake_cluster.events.append("s1 booted: not stopped")
        raise ServerStartError("server exited with code -9")

    def server(self: systems.System, *args: Any, **kwargs: Any) -> Any:
        proc = made(self, *args, **kwargs)
        if len(fake_cluster.servers) == 1:
            proc.start, stop = booting, proc.stop
            proc.stop = lambda: (stopped.set(), stop())
        else:
            proc.start = lambda: (_ for _ in ()).throw(ServerStartError("server exited with code 1"))
        return proc

    monkeypatch.setattr(systems.System, "server", server)
    spec = spec_from(parser().parse_args(["--servers", "2", "--concurrency", "2", "--out", str(tmp_path)]))
    with pytest.raises(ServerStartError, match="code 1"):  # the first failure
        cluster.run_config(cluster.CONFIGS[0], spec, tmp_path, tmp_path, 0, ((0,), (1,)))
    assert "s1 booted: not stopped" not in fake_cluster.events
    assert {"start s1", "stop s1", "stop s2"} <= set(fake_cluster.events) and fake_cluster.routers == []


def test_a_run_stopped_midway_keeps_the_runs_finished_before(
    tmp_path: Path, fake_cluster: FakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cluster.run, "resolve_model", lambda name, cache_dir: tmp_path)
    real, calls = cluster.run_config, []

    def second_fails(*args: Any) -> Any:
        calls.append(args[0].name)
        if len(calls) == 2:
            raise KeyboardInterrupt  # what Ctrl-C or a crash midway leaves
        return real(*args)

    monkeypatch.setattr(cluster, "run_config", second_fails)
    args = ["--servers", "2", "--repeats", "1", "--out", str(tmp_path)]
    two = cluster.select("ours-shared,ours-separate")
    with pytest.raises(KeyboardInterrupt):
        cluster.execute(spec_from(parser().parse_args(args)), two)
    (run_dir,) = tmp_path.glob("run-*")
    partial = json.loads((run_dir / "partial" / "results.json").read_text())
    assert partial["final"] == {"runs_done": 1, "runs": 2}
    assert {r["system"] for r in partial["requests"]} == {calls[0]} and len(partial["requests"]) == 1
    assert not (run_dir / "results.json").exists()


def test_a_partial_write_that_fails_does_not_stop_the_runs(
    tmp_path: Path,
    fake_cluster: FakeCluster,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(cluster.run, "resolve_model", lambda name, cache_dir: tmp_path)
    real = cluster.report.write

    def full_disk(where: Path, *args: Any) -> Any:
        if where.name == "partial":
            raise OSError(28, "No space left on device")
        return real(where, *args)

    monkeypatch.setattr(cluster.report, "write", full_disk)
    args = ["--servers", "2", "--repeats", "1", "--out", str(tmp_path)]
    two = cluster.select("ours-shared,ours-separate")
    assert cluster.execute(spec_from(parser().parse_args(args)), two) == 0
    out = capsys.readouterr()
    line = json.loads(out.out.strip().splitlines()[-1])
    assert sorted(line["order"]) == ["ours-separate/r0", "ours-shared/r0"]  # both ran to the end
    assert (next(tmp_path.glob("run-*")) / "results.json").exists()
    assert out.err.count("warning: could not write") == 2
