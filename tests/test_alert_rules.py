"""The alert rules file (examples/prometheus/sgl_hicache_alerts.yml) and the operator's guide that
documents it (issue 40, 5), without a server: the PromQL reader finds the metric names of tricky
expressions, a misspelt name is reported, and the file is well formed; every name of ours the
Grafana dashboard (examples/grafana/sgl_hicache.json) reads is one our metrics export. That every
name is exported by a real spilling server is checked in tests/server/test_spill_resume.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.promql import alert_rules, exported_names, metric_names, promql_blocks, tokens, unexported

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "examples" / "prometheus" / "sgl_hicache_alerts.yml"
GUIDE = ROOT / "docs" / "OPERATIONS.md"
DASHBOARD = ROOT / "examples" / "grafana" / "sgl_hicache.json"
OURS = "sglang:hicache_spill_"


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (tp_rank, reason) (rate(sglang:a_total{reason=~"x|y", tp_rank!="0"}[5m] offset 1h))',
         {"sglang:a_total"}),
        ("rate(a[5m:1m]) / ignoring (reason) group_left (model_name) b > bool 0.5", {"a", "b"}),
        ("topk(3, sum without (le) (x_bucket)) and on () absent(y)", {"x_bucket", "y"}),
        ('{__name__="sglang:c_total", job="s"} unless d @ start()', {"sglang:c_total", "d"}),
        ('{"sglang:quoted"} or e offset -5m', {"sglang:quoted", "e"}),
        ("histogram_quantile(0.9, sum by (le) (rate(sglang:h_bucket[5m])))", {"sglang:h_bucket"}),
        ('count_values("v", f) > Inf and g < 1e3', {"f", "g"}),
        ('label_replace(h, "dst", "$1", "src", "(.*)")', {"h"}),
        ("SUM BY (x) (i) # a comment names no_metric", {"i"}),
        ("sum(j) by (k) / on (k) group_right count(l)", {"j", "l"}),
    ],
)  # fmt: skip
def test_metric_names_of_tricky_expressions(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_an_expression_it_cannot_read_is_an_error() -> None:
    with pytest.raises(ValueError, match="cannot read PromQL"):
        tokens("rate(x[5m]) $ 3")
    with pytest.raises(ValueError, match="unclosed"):
        metric_names('x{reason="a"')


def test_a_misspelt_or_missing_metric_is_reported() -> None:
    exported = exported_names(
        "# TYPE sglang:hicache_spill_tier_io_errors_total counter\n"
        'sglang:hicache_spill_tier_io_errors_total{tp_rank="0"} 0.0\n'
        'sglang:hicache_spill_restore_seconds_count{tp_rank="0"} 3.0\n'
    )
    assert exported == {
        "sglang:hicache_spill_tier_io_errors_total",
        "sglang:hicache_spill_restore_seconds_count",
    }
    exprs = {
        "right": "increase(sglang:hicache_spill_tier_io_errors_total[5m]) > 0",
        "misspelt": "increase(sglang:hicache_spill_tier_io_error_total[5m]) > 0",
        "no metric": "vector(1) > 0",
    }
    assert unexported(exprs, exported) == {
        "misspelt": ["sglang:hicache_spill_tier_io_error_total"],
        "no metric": ["<none>"],
    }


def test_every_rule_is_complete_ours_and_documented() -> None:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rules = [r for g in groups for r in g["rules"]]
    guide = GUIDE.read_text()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names)) and len(names) == len(alert_rules(RULES)) >= 15
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        read = metric_names(rule["expr"])
        assert read and all(n.startswith("sglang:hicache_spill_") for n in read), (rule["alert"], read)
        assert f"`{rule['alert']}`" in guide, f"docs/OPERATIONS.md does not name alert {rule['alert']}"
    assert "examples/prometheus/sgl_hicache_alerts.yml" in guide
    assert "\ngroups:" not in guide, "the guide keeps an inline copy of the rules: point at the file"


def test_the_guides_promql_is_readable() -> None:
    exprs = promql_blocks(GUIDE.read_text())
    assert len(exprs) >= 3
    for expr in exprs:
        assert metric_names(expr), expr


def test_every_metric_of_ours_the_dashboard_reads_is_exported(exported: Callable[[], str]) -> None:
    """Each panel's PromQL, read as the alerts' is: the names of ours are what `SpillMetrics`
    exports (counters at 0 from the start, gauges once the cache's poll set them), the staging
    counters' panel and the staging holders' panels included. sglang's own names (the hit rate
    panel) are checked against a real server only."""
    import dataclasses

    from sgl_hicache.cache.metrics import STAGING_HELD, STAGING_HELD_TIME, STAGING_USED_TIME, SpillMetrics
    from sgl_hicache.config import SpillConfig
    from sgl_hicache.tier import TierStats

    metrics = SpillMetrics.create(
        SpillConfig(enabled=True), {"model_name": "m", "tp_rank": "0", "pp_rank": "0"}
    )
    metrics.set_tier_stats(TierStats(**{f.name: 0 for f in dataclasses.fields(TierStats)}))
    metrics.set_staging(0, 0, 1 << 20)
    metrics.set_staging_held({})
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = {f"{p['title']} {t['refId']}": t["expr"] for p in panels for t in p["targets"]}
    ours = {k: e for k, e in exprs.items() if any(n.startswith(OURS) for n in metric_names(e))}
    assert len(ours) >= 20, sorted(exprs)
    assert unexported(ours, exported_names(exported())) == {}
    read = set().union(*(metric_names(e) for e in ours.values()))
    staging = {
        f"{OURS}{n}_total"
        for n in (
            "restores_streamed",
            "restore_staging_waits",
            "restores_too_large",
            "spills_refused_reserved",
            "staging_spoiled_bytes",
        )
    } | {
        f"{OURS}{STAGING_HELD[0]}",
        f"{OURS}{STAGING_HELD_TIME[0]}_total",
        f"{OURS}{STAGING_USED_TIME[0]}_total",
    }
    assert staging <= read, sorted(staging - read)
