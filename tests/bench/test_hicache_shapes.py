"""HiCache as a peer at its strongest and honestly named: `timeout` labelled as sglang's default, the
`-budget` host pools sized device + budget (a host pool about the device pool is degenerate in
`cache` mode), and a HiCache shape whose host pool cannot hold the history it is meant to restore
refused in one line, by the benchmark and by long_history, before any server starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import long_history as lh
from benchmarks.bench import cli, systems
from benchmarks.bench.spec import HICACHE, LMCACHE, HostPool, Shape, SpecError

KV_BYTES = 30 * 2 * 3 * 64 * 2  # per token, of the model below: 23040


def test_timeout_is_labelled_as_sglangs_default_and_budget_as_device_plus_budget() -> None:
    for name, config in HICACHE.items():
        assert ("sglang's default)" in config.label.split(",")[0]) == (config.prefetch_policy == "timeout"), (
            name
        )
        assert ("device + the host budget" in config.label) == (config.host is HostPool.BUDGET), name
        assert name.endswith("-budget") <= (config.host is HostPool.BUDGET), name
    assert "chunk 256 (LMCache's default)" in LMCACHE["lmcache-disk"].label
    assert "store policy skip_l1" in LMCACHE["lmcache-disk-skip-l1"].label
    assert "store policy default" in LMCACHE["lmcache-disk"].label
    assert (
        "capped" in LMCACHE["lmcache-fs-native"].label
        and "chunk 64," in LMCACHE["lmcache-disk-c64"].label + ","
    )


def test_a_budget_host_pool_gives_hicache_the_budget_beside_its_device_copies(model: Path) -> None:
    shape = Shape(pool_tokens=2048, host_budget_mb=64)
    budget = 64 * 2**20 // KV_BYTES
    for name in ("hicache-wait-budget", "hicache-timeout-budget"):
        config = HICACHE[name]
        host = systems.host_tokens(config.host, config.default_ratio, shape, model)
        assert config.cache_tokens(host, shape.pool_tokens) == budget
    r2, buffer = HICACHE["hicache-wait-r2"], HICACHE["hicache-buffer"]
    assert r2.cache_tokens(systems.host_tokens(r2.host, r2.default_ratio, shape, model), 2048) == 2048
    assert buffer.cache_tokens(
        systems.host_tokens(buffer.host, buffer.default_ratio, shape, model), 2048
    ) == int(1.2 * 2048)  # buffer_only: staging, all of it


def test_a_host_pool_that_cannot_hold_the_history_is_refused(model: Path) -> None:
    shape = Shape(pool_tokens=2048, host_budget_mb=64)  # r2: 2048 tokens beside the device copies
    systems.check_hicache_holds(["hicache-wait-r2", "ours", "lmcache-disk"], shape, model, 2048)
    with pytest.raises(SpecError) as e:
        systems.check_hicache_holds(["ours", "hicache-timeout-r2"], shape, model, 2049)
    assert str(e.value) == (
        "hicache-timeout-r2: its host pool holds 2048 tokens beside the device pool's copies, fewer than the "
        "2049-token history it is meant to restore: raise --host-budget-mb or --pool-tokens, or leave it out"
    )
    systems.check_hicache_holds(["ours", "lmcache-disk"], shape, model, 10**9)  # only HiCache is checked


def test_the_benchmark_refuses_it_in_one_line_before_starting_a_server(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = ["--model", str(model), "--systems", "ours,hicache-wait-budget", "--host-budget-mb", "1",
            "--first-tokens", "400", "--out", str(out), "--no-trace"]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: hicache-wait-budget: its host pool holds 45 tokens")
    assert "the 576-token history" in err[0]  # 400 + 2 x 64 + 3 x 16
    assert not list(out.glob("run-*")), "no run was started"


def test_long_history_refuses_it_in_one_line(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", str(model), "--lengths", "8192", "--systems", "ours,hicache-wait-budget",
            "--host-budget-mb", "100", "--dir", str(tmp_path / "long")]  # fmt: skip
    assert lh.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "long_history: hicache-wait-budget: its host pool holds 4551 tokens beside the device pool's copies, "
        "fewer than the 8192-token history it is meant to restore: raise --host-budget-mb or --pool-tokens, "
        "or leave it out"
    ]
