"""`python -m benchmarks.long_history`: its arguments, and the figures it derives from rows."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
from sgl_hicache_cpu.cpu_prefix_attention import ENV_VAR as PREFIX_ATTENTION_ENV

from benchmarks import long_history as lh
from benchmarks import resume
from benchmarks.bench import lmcache_process
from benchmarks.bench.lmcache_process import L2, LMCacheServer
from benchmarks.bench.spec import HICACHE, LMCACHE, Shape
from benchmarks.bench.systems import kv_bytes_per_token
from sgl_hicache.server.prompt_fit import prefill_room


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


def _tiny_vocab_model(tmp_path: Path, vocab: int) -> Path:
    m = tmp_path / "tiny"
    m.mkdir()
    m.joinpath("config.json").write_text(json.dumps(
        {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
         "vocab_size": vocab}))  # fmt: skip
    return m


def _record_run(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    vocab: int,
    new_tokens: tuple[int, ...] = (lh.QUESTION,),
    length: int = 512,
) -> tuple[list[dict], list[list[int]]]:
    """One round of one system against a stand-in server: the rows and every prompt sent, in order."""
    model = _tiny_vocab_model(tmp_path, vocab)
    sent: list[list[int]] = []

    def ttft(base: str, ids: list[int]) -> tuple[float, int]:
        sent.append(ids)
        return 1.0, 0

    class Server:
        base_url = "http://127.0.0.1:1"

        def start(self, timeout_s: float) -> Server:
            return self

        def __enter__(self) -> Server:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    system = SimpleNamespace(name="recompute", tier_dir=None, server=lambda model, log: Server())
    monkeypatch.setattr(lh, "ttft", ttft)
    monkeypatch.setattr(lh, "settle", lambda system, base: None)
    shape = Shape(model=str(model), pool_tokens=1024, host_budget_mb=1, page_size=16)
    rows = lh.run_server(system, shape, model, [length], 1, 0, tmp_path, new_tokens)  # type: ignore[arg-type]
    return rows, sent


def test_every_token_sent_is_in_the_models_vocabulary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--model tiny` (vocabulary 1,024) crashed: the prompts held ids up to 8,099. Every id of every
    request of a round (history, resident turns, other work, resumes) is now below the vocabulary."""
    vocab = 1024
    rows, sent = _record_run(tmp_path, monkeypatch, vocab)
    assert len(rows) == 1 and len(sent) > 4
    assert min(min(ids) for ids in sent) >= 0
    assert max(max(ids) for ids in sent) < vocab


def test_each_new_token_count_pushes_the_history_out_with_prompts_not_sent_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other work of the second new-token count repeated the first's prompts, so the tiers
    restored it instead of prefilling it, and what they held then differed by cell."""
    rows, sent = _record_run(tmp_path, monkeypatch, 32_000, new_tokens=(0, 256), length=768)
    assert [r["new_tokens"] for r in rows] == [0, 256]
    filler = [tuple(ids) for ids in sent if len(ids) == lh.FILLER]
    assert len(filler) >= 4
    assert len(set(filler)) == len(filler), "a prompt of the other work was sent twice"


def test_lmcache_systems_run_beside_their_daemons(tmp_path: Path) -> None:
    """long_history takes every LMCache configuration: each server is built with its own daemon (L1
    the host budget, a disk tier in the run's directory where it has one), on the CPU profile's
    prefix attention like the others, and its other work overflows the device pool and that L1."""
    if lmcache_process.not_installed():
        pytest.skip("LMCache is not installed here")
    model = _tiny_vocab_model(tmp_path, 1024)
    names = lh._systems("lmcache,ours")
    workdir, _, shape, systems = lh.prepare(tmp_path / "out", "long-", str(model), names, 1024, 64, "cpu")
    assert [s.name for s in systems] == [*LMCACHE, "ours"]
    for system in systems[:-1]:
        server = system.server(model, workdir / "s.log")
        assert isinstance(server, LMCacheServer) and server.daemon is not None, system.name
        assert "--enable-lmcache" in server.command()
        assert (
            dict(system.env)[PREFIX_ATTENTION_ENV] == "1"
            and dict(system.env)["LMCACHE_TRACK_USAGE"] == "false"
        )
        assert server.daemon.spec.l1_mb == shape.host_budget_mb
        disk = LMCACHE[system.name].l2 is not L2.NONE
        assert (server.daemon.spec.l2_dir is not None) == disk and (system.tier_dir is not None) == disk
        l1_tokens = shape.host_budget_mb * 2**20 // kv_bytes_per_token(model)
        assert lh.filler_tokens(system, shape, model) > shape.pool_tokens + l1_tokens


def test_new_token_counts_key_their_figures_and_give_the_hidden_share() -> None:
    """Issue 37: per new-token count, ours and ours-layerwise against resident and the peers, and the
    share of the restore's read time that did not add to the resumed TTFT."""

    def at(system: str, n: int, resume: float, resident: float, read: float) -> dict:
        return row(system, 16384, resume, resident, read=read) | {"new_tokens": n}

    rows = [
        at("ours", 256, 6500.0, 4700.0, read=1.8),  # 1,800 ms of overhead: nothing hidden
        at("ours-layerwise", 256, 5150.0, 4700.0, read=1.8),  # 450 of 1,800 ms exposed: 3/4 hidden
        at("ours-layerwise", 0, 3000.0, 3100.0, read=1.8),  # faster than resident (noise): clamped
        at("hicache-wait-r2", 256, 7000.0, 4700.0, read=0.0),
        row("ours", 16384, 2000.0, 1000.0, read=2.0),  # the default question: keyed by length only
    ]
    f = lh.summarize(rows, raw=[])
    assert f["ours_hidden_share_16384_n256"] == 0.0
    assert f["ours-layerwise_hidden_share_16384_n256"] == pytest.approx(0.75)
    assert f["ours-layerwise_hidden_share_16384_n0"] == 1.0
    assert f["ours-layerwise_vs_resident_16384_n256"] == pytest.approx(5150 / 4700)
    assert f["ours-layerwise_vs_best_hicache_16384_n256"] == pytest.approx(5150 / 7000)
    assert f["ours_read_ms_16384"] == 2000.0 and f["ours_hidden_share_16384"] == pytest.approx(0.5)
    assert "ours-layerwise_resume_ms_16384_n0" in f and "ours_resume_ms_16384_n0" not in f


def test_new_tokens_are_checked_and_layerwise_is_a_system(capsys: pytest.CaptureFixture[str]) -> None:
    assert lh.main(["--new-tokens", "0,-1"]) == 2
    assert "new tokens" in capsys.readouterr().err
    assert lh._systems("ours-layerwise,ours") == ["ours", "ours-layerwise"]
    assert lh.key(8192, lh.QUESTION) == "8192" and lh.key(8192, 0) == "8192_n0"


@pytest.mark.parametrize(
    "longest, new_tokens, page",
    [(16384, 4096, 64), (16384, 4159, 64), (16384, 8000, 64), (8192, 0, 64), (16384, 96, 16), (300, 5000, 1)],
)
def test_the_pool_admits_the_longest_turn(longest: int, new_tokens: int, page: int) -> None:
    """`--lengths 16384 --new-tokens 4096` sized its pool 16384 + 4096 + 64 = 20544 tokens at page 64:
    the turn of 20,480 tokens fits sglang's length check but never its prefill admission (prompt +
    new + page < pool), so the server queued it, and every request after it, forever."""
    pool = lh.pool_tokens(longest, new_tokens, page)
    capacity = pool // page * page  # sglang's pool is whole pages
    assert prefill_room(longest + new_tokens, page, capacity) >= 1, "its one generated token"
    assert pool >= longest + 4096


def test_a_server_that_stops_answering_fails_the_run_naming_its_log(tmp_path: Path) -> None:
    """A request with no answer fails the run (no endless wait) and the message says where the
    server's log is; the listener accepts connections (the kernel's backlog) and never answers."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        base = f"http://127.0.0.1:{listener.getsockname()[1]}"
        log = tmp_path / "ours-r0.log"
        with pytest.raises(resume.NoAnswer) as info, resume.naming_log(log):
            resume.post(base, {"input_ids": [1]}, timeout_s=1)
    assert str(info.value) == f"{base}/generate did not answer within 1 s; the server's log: {log}"


def test_long_history_names_the_log_of_a_server_that_stopped_answering(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _tiny_vocab_model(tmp_path, 1024)

    def ttft(base: str, ids: list[int]) -> tuple[float, int]:
        raise resume.NoAnswer(f"{base}/generate did not answer within 1800 s")

    class Server:
        base_url = "http://127.0.0.1:1"

        def start(self, timeout_s: float) -> Server:
            return self

        def __enter__(self) -> Server:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    system = SimpleNamespace(name="ours", tier_dir=None, server=lambda model, log: Server())
    monkeypatch.setattr(lh, "ttft", ttft)
    shape = Shape(model=str(model), pool_tokens=1024, host_budget_mb=1, page_size=16)
    with pytest.raises(
        resume.NoAnswer, match=re.escape(f"the server's log: {tmp_path / 'ours-r0.log'}") + "$"
    ):
        lh.run_server(system, shape, model, [512], 1, 0, tmp_path)  # type: ignore[arg-type]


def test_each_servers_tier_is_removed_once_measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 16K history leaves GiBs in a tier: the run removes each system's once its server is done
    (after the raw read of ours'), so a long run never fills the disk it measures."""
    tiers = {name: tmp_path / name for name in ("ours", "hicache-wait-r2")}
    for d in tiers.values():
        d.mkdir()
        (d / "extent").write_bytes(b"x" * 4096)
    systems = [SimpleNamespace(name=n, tier_dir=d) for n, d in tiers.items()]
    shape = SimpleNamespace(pool_tokens=2048, host_budget_mb=64)
    monkeypatch.setattr(lh, "prepare", lambda *a, **k: (tmp_path, tmp_path / "model", shape, systems))
    seen: list[tuple[str, bool]] = []

    def run_server(system: SimpleNamespace, *a: object) -> list[dict]:
        seen.append((system.name, system.tier_dir.exists()))
        return []

    def raw_read(root: Path, threads: int) -> tuple[float, int]:
        assert root.exists(), "ours' tier was removed before its raw read"
        return 1.0, 4096

    monkeypatch.setattr(lh, "run_server", run_server)
    monkeypatch.setattr(lh, "raw_read_gbps", raw_read)
    monkeypatch.setattr(lh, "summarize", lambda rows, raw, model="": {})
    monkeypatch.setattr(lh, "emit", lambda figures: None)
    assert (
        lh.main(["--lengths", "512", "--systems", "ours,hicache-wait-r2", "--rounds", "1", "--repeats", "1"])
        == 0
    )
    assert sorted(seen) == [("hicache-wait-r2", True), ("ours", True)]
    assert not any(d.exists() for d in tiers.values()), "a tier was left on the disk"
