"""The LMCache systems of the benchmark, without starting anything: each configuration's daemon at
ours' memory (L1 = the host budget, a disk tier in the run's directory, `fs_native` capped at ours'
tier capacity), a server that starts and stops its daemon, and the best configuration reported."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.bench import cli, lmcache_process, run, systems
from benchmarks.bench.client import Result
from benchmarks.bench.lmcache_process import L2, DaemonSpec, LMCacheServer
from benchmarks.bench.probe import Sampler
from benchmarks.bench.spec import LMCACHE, LMCacheConfig, Shape, SpecError
from benchmarks.bench.summary import Figures, best_lmcache, ratios, summarize


def _flag(args: list[str] | tuple[str, ...], name: str) -> str:
    return args[list(args).index(name) + 1]


@pytest.mark.parametrize("config", list(LMCACHE.values()), ids=lambda c: c.name)
def test_each_lmcache_configuration_is_its_daemon(config: LMCacheConfig, model: Path, tmp_path: Path) -> None:
    shape = Shape(pool_tokens=2048, host_budget_mb=96, page_size=16)
    system = systems.build(config.name, shape, model, tmp_path, tier_capacity_mb=3072)
    assert (
        system.module == "sglang.launch_server" and "--enable-lmcache" not in system.flags
    )  # the server adds it
    assert dict(system.env)["LMCACHE_TRACK_USAGE"] == "false"
    daemon = system.lmcache
    assert daemon is not None
    args = daemon.args()
    assert float(_flag(args, "--l1-size-gb")) * 1024 == pytest.approx(96)  # the host budget
    assert _flag(args, "--chunk-size") == str(config.chunk_size)
    assert _flag(args, "--supported-transfer-mode") == "auto"  # sglang's connector moves KV itself
    if config.l2 is L2.NONE:
        assert "--l2-adapter" not in args and "--l2-store-policy" not in args and system.tier_dir is None
        return
    assert _flag(args, "--l2-store-policy") == config.l2_store_policy
    adapter = json.loads(_flag(args, "--l2-adapter"))
    assert adapter["type"] == config.l2.value and adapter["base_path"] == str(system.tier_dir)
    assert system.tier_dir is not None and system.tier_dir.parent == tmp_path  # beside ours' tier
    if config.l2 is L2.FS_NATIVE:
        assert adapter["max_capacity_gb"] == 3.0  # ours' tier capacity
        assert adapter["eviction"] == {"eviction_policy": "LRU"}  # without it the capacity bounds nothing


def test_a_chunk_that_is_not_a_page_multiple_is_refused(model: Path, tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="not a multiple of the page size 128"):
        systems.build("lmcache-disk-c64", Shape(page_size=128), model, tmp_path)


def test_a_daemon_spec_names_its_directory_and_capacity_exactly_when_it_needs_them(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="directory"):
        DaemonSpec(l1_mb=8, l2=L2.FS)
    with pytest.raises(ValueError, match="directory"):
        DaemonSpec(l1_mb=8, l2_dir=tmp_path)
    with pytest.raises(ValueError, match="capacity"):
        DaemonSpec(l1_mb=8, l2=L2.FS_NATIVE, l2_dir=tmp_path)
    with pytest.raises(ValueError, match="capacity"):
        DaemonSpec(l1_mb=8, l2=L2.FS, l2_dir=tmp_path, l2_capacity_mb=1)
    with pytest.raises(ValueError, match="store policy 'skip_l1' with L2 none"):
        DaemonSpec(l1_mb=8, l2_store_policy="skip_l1")  # nothing to skip L1 for
    with pytest.raises(ValueError, match="store policy 'keep'"):
        DaemonSpec(l1_mb=8, l2=L2.FS, l2_dir=tmp_path, l2_store_policy="keep")


def test_a_server_of_an_lmcache_system_carries_its_daemon(model: Path, tmp_path: Path) -> None:
    system = systems.build("lmcache-disk", Shape(), model, tmp_path)
    server = system.server(model, tmp_path / "s.log", cpus=None)
    assert isinstance(server, LMCacheServer) and server.daemon is not None
    config = Path(_flag(server.command(), "--lmcache-config-file"))
    assert config == tmp_path / "s.log.lmcache.yaml"
    server.daemon.write_config(config)
    assert config.read_text() == f"mp_host: 127.0.0.1\nmp_port: {server.daemon.port}\n"
    assert server.daemon.port != server.port and server.daemon.log_path == tmp_path / "s.log.lmcache.log"
    assert dict(server.env)["LMCACHE_TRACK_USAGE"] == "false"
    with pytest.raises(ValueError, match="gRPC"):
        system.server(model, tmp_path / "g.log", grpc=True)


def _figures(ttft: float, tput: float) -> Figures:
    r = Result("a", "w", 1, True, prompt_tokens=10, ttft_ms=1.0, output_ids=[1])
    return replace(summarize([r], 1.0, {}), ttft_resume_p50_ms=ttft, throughput_tok_s=tput)


def test_ours_is_set_against_the_best_lmcache_configuration_of_each_figure() -> None:
    figures = {"ours": _figures(50, 40), "lmcache-disk": _figures(100, 20), "lmcache-disk-c64": _figures(80, 10),
               "hicache-wait-r2": _figures(200, 30)}  # fmt: skip
    assert (
        best_lmcache(figures) == "lmcache-disk-c64" and best_lmcache(figures, "throughput") == "lmcache-disk"
    )
    r = ratios(figures)
    assert r["ttft_vs_lmcache"] == 50 / 80 and r["throughput_vs_lmcache"] == 40 / 20
    assert r["ttft_vs_lmcache-disk"] == 0.5 and r["ttft_vs_hicache"] == 0.25
    assert best_lmcache({"ours": _figures(50, 40)}) is None


def test_the_benchmark_refuses_such_a_chunk_before_it_starts_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert (
        cli.main(["--systems", "ours,lmcache-disk-c64", "--page-size", "128", "--out", "/nonexistent"]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert err == "error: lmcache-disk-c64: its chunk of 64 tokens is not a multiple of the page size 128"


def test_an_lmcache_servers_memory_includes_its_daemons(model: Path, tmp_path: Path) -> None:
    server = systems.build("lmcache-disk", Shape(), model, tmp_path).server(model, tmp_path / "s.log")
    assert isinstance(server, LMCacheServer) and server.daemon is not None
    assert run._daemons(server) == ()  # not started
    server.daemon.proc = SimpleNamespace(pid=4321)  # type: ignore[assignment]
    assert run._daemons(server) == (4321,)
    me = os.getpid()
    with Sampler(me, every_s=60) as alone:
        pass
    with Sampler(me, every_s=60, also=(me,)) as twice:
        pass
    assert twice.peak_rss_mb == pytest.approx(2 * alone.peak_rss_mb, rel=0.1)


def test_without_lmcache_installed_the_benchmark_says_so_in_one_line(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = lmcache_process.importlib.util.find_spec
    monkeypatch.setattr(
        lmcache_process.importlib.util, "find_spec", lambda name: None if name == "lmcache" else real(name)
    )
    argv = [
        "--model",
        str(model),
        "--systems",
        "ours,lmcache-disk",
        "--no-trace",
        "--out",
        str(tmp_path / "o"),
    ]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: lmcache-disk: " + lmcache_process.not_installed()]  # type: ignore[operator]
    assert not list((tmp_path / "o").glob("run-*"))
