"""Spill on eviction, restore on resume, on the real server (issue 5's server tests).

One server with a small device pool serves the tests of this module, in file order; each test uses
its own token sequences, and the destructive test (tier directory removed) is the last one.
"""

from __future__ import annotations

import json
import re
import shutil
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench.server_process import ServerProcess
from sgl_hicache.tier.trust import SECRET_NAME
from tests.promql import exported_names, iter_exprs, unexported
from tests.server.conftest import SPILL_FLAGS, eventually, metrics, post_json, raw_metrics
from tests.server.greedy import TOP2

pytestmark = pytest.mark.server

POOL = 1024  # device KV pool, tokens
EXTRA_LABELS = {"team": "kv"}  # --extra-metric-labels: sglang's own series carry them, ours too
ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "examples" / "grafana" / "sgl_hicache.json"
ALERT_RULES = ROOT / "examples" / "prometheus" / "sgl_hicache_alerts.yml"
GUIDE = ROOT / "docs" / "OPERATIONS.md"
PROMPT = 300


def tokens(seed: int, n: int = PROMPT) -> list[int]:
    return [(i * 7 + seed * 131) % 900 + 20 for i in range(n)]


def generate_full(
    base: str, ids: list[int], n: int = 8, salt: str | None = None, top2: bool = False
) -> dict[str, Any]:
    """Greedy; with `top2`, also the two likeliest tokens' logprobs per output token (`greedy.TOP2`)."""
    body: dict[str, Any] = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}}
    if salt is not None:
        body["cache_salt"] = salt
    return post_json(base + "/generate", body | (TOP2 if top2 else {}))


def generate(base: str, ids: list[int], n: int = 8, salt: str | None = None) -> tuple[list[int], int]:
    out = generate_full(base, ids, n, salt)
    return out["output_ids"], out["meta_info"]["cached_tokens"]


def push_out(base: str, seed: int) -> None:
    """Serve enough unrelated prompts to evict everything else from the device pool."""
    for k in range(POOL // PROMPT + 2):
        generate(base, tokens(10_000 + seed * 10 + k), n=1)


def counter(base: str, name: str) -> float:
    return metrics(base).get(f'sglang:hicache_spill_{name}_total{{tp_rank="0"}}', 0.0)


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("spill")
    tier = tmp / "tier"
    args = (
        *SPILL_FLAGS,
        "--enable-hicache-spill",
        "--hicache-spill-dir",
        str(tier),
        "--hicache-spill-min-free",
        "0",
        "--extra-metric-labels",
        json.dumps(EXTRA_LABELS),
        # evictions store here, as without clean-ahead (the exactness server test runs the default)
        "--hicache-spill-extra-config",
        json.dumps({"clean_ahead": 0}),
    )
    with ServerProcess(tiny_model, POOL, args, log_path=tmp / "server.log") as s:
        s.tier_dir = tier  # type: ignore[attr-defined]
        yield s


def two_turns(base: str, seed: int, salt: str | None = None) -> tuple[list[int], list[int], int]:
    """Turn 1, then turn 2 served while turn 1 is resident: returns (turn-2 ids, its output, turn-1 length)."""
    turn1 = tokens(seed)
    out1, _ = generate(base, turn1, salt=salt)
    turn2 = turn1 + out1 + tokens(seed + 1, 20)
    reference, cached = generate(base, turn2, salt=salt)
    assert cached >= len(turn1)
    return turn2, reference, len(turn1)


def extent_files(tier: Path) -> list[Path]:
    return [p for p in tier.rglob("*.ext") if p.is_file()]


def test_resume_restores_history_with_output_identical_to_resident_run(server: Any) -> None:
    base = server.base_url
    turn2, reference, history = two_turns(base, 1)
    spilled, restored, read = (
        counter(base, n) for n in ("spilled_tokens", "restored_tokens", "restored_bytes")
    )
    push_out(base, 1)
    assert counter(base, "spilled_tokens") > spilled
    out = generate_full(base, turn2)
    resumed, cached = out["output_ids"], out["meta_info"]["cached_tokens"]
    assert cached >= history, f"the resumed turn reused only {cached} of {history} history tokens"
    assert out["meta_info"]["cached_tokens_details"]["storage"] >= history, (
        "restored tokens are the storage tier's"
    )
    assert counter(base, "restored_tokens") - restored >= history
    assert counter(base, "restored_bytes") > read, "the tier's read counter did not move"
    assert resumed == reference
    series = metrics(base)
    assert series['sglang:hicache_spill_restore_seconds_count{tp_rank="0"}'] >= 1
    assert series['sglang:hicache_spill_tier_used_bytes{tp_rank="0"}'] > 0
    assert series['sglang:hicache_spill_tier_extents{tp_rank="0"}'] > 0

    # Issue 37: the bytes written to the tier are its files (the first test: no other extents yet),
    # and their ratio to the bytes restored is exported as a gauge.
    def written_is_on_disk() -> bool:
        return counter(base, "tier_written_bytes") == sum(
            p.stat().st_size for p in extent_files(server.tier_dir)
        )

    def ratio_exported() -> bool:
        ratio = metrics(base).get('sglang:hicache_spill_tier_written_per_restored_byte{tp_rank="0"}')
        return ratio == counter(base, "tier_written_bytes") / counter(base, "restored_bytes")

    assert eventually(written_is_on_disk) and eventually(ratio_exported)


def test_metrics_have_sglangs_shape_and_the_dashboard_queries_exist(server: Any) -> None:
    """Issue 28: our series carry sglang's labels (and --extra-metric-labels), running totals are
    counters, drops are one counter by reason, staging is exported; every metric the Grafana
    dashboard queries is one this server exports (after the restore above)."""
    ours = raw_metrics(server.base_url)
    model = str(server.model_path)
    for key in ours:
        for label, value in (
            ("model_name", model),
            ("pp_rank", "0"),
            ("tp_rank", "0"),
            *EXTRA_LABELS.items(),
        ):
            assert f'{label}="{value}"' in key, f"{key} lacks {label}"
    names = {key.partition("{")[0] for key in ours}
    for counter in ("tier_io_errors", "tier_no_space", "tier_evictions", "restored_tokens", "dropped_tokens"):
        assert f"sglang:hicache_spill_{counter}_total" in names, counter
    assert {"sglang:hicache_spill_staging_used_bytes", "sglang:hicache_spill_staging_peak_bytes"} <= names
    reasons = {m.group(1) for key in ours if (m := re.search(r'reason="(\w+)"', key))}
    assert {"too_short", "staging_full", "too_large", "no_tier", "internal_error"} <= reasons
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as r:
        exported = {
            line.split("{")[0].split(" ")[0] for line in r.read().decode().splitlines() if line[:1] != "#"
        }
    queried = set(re.findall(r"sglang:[a-z_]+", json.dumps(json.loads(DASHBOARD.read_text())["panels"])))
    assert len(queried) >= 20 and queried <= exported, sorted(queried - exported)


def test_every_alert_rule_and_guide_query_reads_metrics_this_server_exports(server: Any) -> None:
    """Issue 40 (5): every metric name the alert rules file's expressions and the operator's guide's
    PromQL read is one this spilling server exports; a misspelt one would be reported. Counters are
    exported at 0 before their first event (an alert's increase() needs the series):
    `purges_incomplete`, which the file tier never counts, is there at 0."""
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    exported = exported_names(text)
    exprs = dict(iter_exprs(ALERT_RULES, GUIDE))
    assert len(exprs) >= 20, sorted(exprs)
    assert unexported(exprs, exported) == {}
    misspelt = {"misspelt": "increase(sglang:hicache_spill_tier_io_error_total[10m]) > 0"}
    assert unexported(misspelt, exported) == {"misspelt": ["sglang:hicache_spill_tier_io_error_total"]}
    zero = [
        v
        for k, v in raw_metrics(server.base_url).items()
        if k.startswith("sglang:hicache_spill_purges_incomplete_total{")
    ]
    assert zero == [0.0], zero


def test_prefetch_at_arrival_feeds_the_restore(server: Any) -> None:
    base = server.base_url
    turn2, reference, history = two_turns(base, 11)
    push_out(base, 11)
    requests, hits = counter(base, "prefetch_requests"), counter(base, "prefetch_hits")
    resumed, cached = generate(base, turn2)
    assert counter(base, "prefetch_requests") > requests, "the arrival hook did not prefetch"
    assert counter(base, "prefetch_hits") > hits, "the restore did not use the prefetched read"
    assert cached >= history and resumed == reference


def test_tenants_never_restore_each_others_kv(server: Any) -> None:
    base = server.base_url
    turn2, reference, history = two_turns(base, 21, salt="alice")
    push_out(base, 21)
    restored = counter(base, "restored_tokens")
    _, cached_bob = generate(base, turn2, salt="bob")
    assert cached_bob == 0 and counter(base, "restored_tokens") == restored
    resumed, cached_alice = generate(base, turn2, salt="alice")
    assert cached_alice >= history and resumed == reference


def test_corrupt_extent_recomputes_with_identical_output(server: Any) -> None:
    base = server.base_url
    turn2, reference, _ = two_turns(base, 41)
    push_out(base, 41)
    for path in extent_files(server.tier_dir):
        data = bytearray(path.read_bytes())
        data[-4096 - 1] ^= 0xFF  # last byte of the last payload chunk's page-aligned region
        path.write_bytes(bytes(data))
    corrupt = counter(base, "corrupt_extents")
    resumed, _ = generate(base, turn2)
    assert counter(base, "corrupt_extents") > corrupt
    assert resumed == reference


def test_warm_restart_resumes_a_conversation_from_the_tier(
    tiny_model: Path, tmp_path: Path, start_server: Any
) -> None:
    tier = tmp_path / "restart-tier"
    args = ("--enable-hicache-spill", "--hicache-spill-dir", str(tier), "--hicache-spill-min-free", "0")
    first = start_server(tiny_model, *args, max_total_tokens=POOL)
    turn2, reference, history = two_turns(first.base_url, 81)
    salted2, salted_ref, salted_history = two_turns(first.base_url, 91, salt="erin")
    push_out(first.base_url, 81)
    written = counter(first.base_url, "spilled_bytes")
    deadline = time.monotonic() + 30
    while sum(p.stat().st_size for p in extent_files(tier)) < written and time.monotonic() < deadline:
        time.sleep(0.2)  # spills are acknowledged once their write completes
    first.stop()
    second = start_server(tiny_model, *args, max_total_tokens=POOL)
    resumed, cached = generate(second.base_url, turn2)
    assert cached >= history, f"after restart the resumed turn reused only {cached} of {history} tokens"
    assert resumed == reference
    assert generate(second.base_url, salted2, salt="frank")[1] == 0
    resumed, cached = generate(second.base_url, salted2, salt="erin")
    assert cached >= salted_history and resumed == salted_ref


def test_client_hint_warms_a_conversation_before_its_next_turn(server: Any) -> None:
    base = server.base_url
    turn2, reference, history = two_turns(base, 101)
    push_out(base, 101)
    issued, hits = counter(base, "prefetch_issued"), counter(base, "prefetch_hits")
    hint = post_json(base + "/hicache/prefetch", {"input_ids": turn2[:-20]})
    assert hint == {"accepted": True, "prompt_tokens": len(turn2) - 20}, hint
    assert eventually(lambda: counter(base, "prefetch_issued") > issued)
    resumed, cached = generate(base, turn2)
    assert counter(base, "prefetch_hits") > hits, "the resumed turn did not use the hinted reads"
    assert cached >= history and resumed == reference


def test_resume_hint_example_runs(server: Any) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "resume_hint.py"
    out = subprocess.run(
        [sys.executable, str(example), "--base-url", server.base_url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "hint:" in out.stdout and "next turn:" in out.stdout


def test_client_hint_with_chat_messages_and_bad_bodies(server: Any) -> None:
    base = server.base_url
    reply = post_json(base + "/hicache/prefetch", {"messages": [{"role": "user", "content": "hello there"}]})
    assert reply["accepted"] is True and reply["prompt_tokens"] > 0
    with pytest.raises(urllib.error.HTTPError) as err:
        post_json(base + "/hicache/prefetch", {"text": "no"})
    assert err.value.code == 400


def rm_rf_while_written(path: Path, tries: int = 50) -> None:
    """`rm -rf` of a directory the server may be writing into: a spill that lands between the
    listing and the removal leaves it "not empty", so it is removed again, as an operator would."""
    for _ in range(tries - 1):
        try:
            shutil.rmtree(path)
            return
        except OSError:
            time.sleep(0.1)
    shutil.rmtree(path)


def test_tier_directory_removed_while_serving(server: Any) -> None:
    """`rm -rf` of the tier directory: the next spill re-creates it (private, with the same secret)
    and spilling, then restoring from the tier, resume."""
    base = server.base_url
    turn2, reference, _ = two_turns(base, 61)
    push_out(base, 61)
    secret = (server.tier_dir / SECRET_NAME).read_bytes()
    rm_rf_while_written(server.tier_dir)
    resumed, _ = generate(base, turn2)  # its extents went with the directory: recomputed
    assert resumed == reference
    later2, later_reference, history = two_turns(base, 63)
    spilled, restored = counter(base, "spilled_tokens"), counter(base, "restored_tokens")
    push_out(base, 63)
    assert counter(base, "spilled_tokens") > spilled, "spilling did not resume"
    resumed, cached = generate(base, later2)
    assert cached >= history and resumed == later_reference
    assert counter(base, "restored_tokens") - restored >= history, "not restored from the tier"
    assert metrics(base)['sglang:hicache_spill_tier_recreations_total{tp_rank="0"}'] >= 1
    assert stat.S_IMODE(server.tier_dir.stat().st_mode) == 0o700
    assert (server.tier_dir / SECRET_NAME).read_bytes() == secret
