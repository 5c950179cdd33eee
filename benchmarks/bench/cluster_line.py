"""The final JSON line of `--servers 2` (`bench/cluster.py`): each configuration's figures, the ratios
between configurations, our lookup counters and how often the router moved a conversation."""

from __future__ import annotations

from typing import Any

from benchmarks.bench import report
from benchmarks.bench.client import Result
from benchmarks.bench.probe import total
from benchmarks.bench.summary import NAN, Figures, ratio

LOOKUP_COUNTERS = ("lookups", "lookup_fs_calls", "lookup_found_tokens", "lookup_attached_tokens",
                   "lookup_refused", "lookup_stale", "lookups_waited", "restored_tokens")  # fmt: skip
"""Our counters in the final line (`sglang:hicache_spill_<name>_total` on `/metrics`): the
cross-server lookups and the tokens restored from the tier."""

RATIOS = (
    ("shared_vs_separate", "ours-shared", "ours-separate"),
    ("shared_vs_write_back", "ours-shared", "ours-shared-write-back"),
    ("shared_vs_hicache", "ours-shared", "hicache-shared"),
    ("shared_vs_lmcache", "ours-shared", "lmcache-shared"),
    ("mooncake_vs_shared", "ours-mooncake", "ours-shared"),
    ("mooncake_vs_hicache", "ours-mooncake", "hicache-shared"),
    ("mooncake_vs_hicache_mooncake", "ours-mooncake", "hicache-mooncake"),
    ("mooncake_merged_vs_by_group", "ours-mooncake", "ours-mooncake-by-group"),
    ("mooncake_local_vs_any", "ours-mooncake-local", "ours-mooncake"),
    ("mooncake_vs_shared_sticky", "ours-mooncake-sticky", "ours-shared-sticky"),
    ("mooncake_local_vs_any_sticky", "ours-mooncake-local-sticky", "ours-mooncake-sticky"),
    ("mooncake_standalone_vs_shared", "ours-mooncake-standalone", "ours-shared"),
    ("mooncake_standalone_vs_mooncake", "ours-mooncake-standalone", "ours-mooncake"),
    (
        "mooncake_standalone_vs_hicache_mooncake_standalone",
        "ours-mooncake-standalone",
        "hicache-mooncake-standalone",
    ),
    ("mooncake_standalone_vs_shared_sticky", "ours-mooncake-standalone-sticky", "ours-shared-sticky"),
    ("events_vs_round_robin", "route-kv-events", "route-round-robin"),
    ("events_vs_approx_tree", "route-kv-events", "route-approx-tree"),
    ("events_vs_round_robin_grpc", "route-kv-events", "route-round-robin-grpc"),
    ("events_vs_approx_tree_protected", "route-kv-events", "route-approx-tree-protected"),
)
"""(name, configuration, over configuration): `ttft_<name>` (resumed-turn TTFT p50) and
`throughput_<name>` in the final line."""
RATIO_KEYS = tuple(f"{fig}_{name}" for name, _, _ in RATIOS for fig in ("ttft", "throughput"))
TIER_FIGURES = {"total": "hit_rate", "device": "hit_rate_device", "host": "hit_rate_host",
                "storage": "hit_rate_storage"}  # fmt: skip


def lookup_counters(metrics: dict[str, float]) -> dict[str, float]:
    """Our counters (`LOOKUP_COUNTERS`) in `/metrics` samples (0 for a server without them)."""
    return {name: total(metrics, f"sglang:hicache_spill_{name}_total") for name in LOOKUP_COUNTERS}


def final_line(workloads: dict[str, dict[str, Figures]], lookups: dict[str, list[dict[str, float]]],
               extra: dict[str, Any], moved: dict[str, list[Result]] | None = None) -> dict[str, Any]:  # fmt: skip
    """The headline is the first workload: each configuration's figures (medians over repeats),
    the `RATIOS`, every workload's ratios, our counters (summed over the servers, repeats and
    workloads; and per server) and, from `moved` (each configuration's requests), the share of
    resumed turns the router moved to the other server, over all repeats and per repeat. A hit
    rate by tier is null where the answers named no split (`Result.cached`)."""
    moved = moved or {}
    head = next(iter(workloads), None)
    figures = workloads.get(head, {}) if head else {}

    line: dict[str, Any] = {
        "headline_workload": head,
        "ttft_resume_p50_ms": {c: f.ttft_resume_p50_ms for c, f in figures.items()},
        "throughput_tok_s": {c: f.throughput_tok_s for c, f in figures.items()},
        "hit_rate": {c: {t: getattr(f, k) for t, k in TIER_FIGURES.items()} for c, f in figures.items()},
        **ratios(figures),
        "workloads": {w: ratios(fs) for w, fs in workloads.items()},
        "lookup_counters_total": {c: {k: sum(s[k] for s in by) for k in LOOKUP_COUNTERS} for c, by in lookups.items()},
        "lookup_counters_by_server": {c: {k: [s[k] for s in by] for k in LOOKUP_COUNTERS} for c, by in lookups.items()},
        "errors": sum(f.errors for fs in workloads.values() for f in fs.values()),
        "moved_rate": {c: moved_rate(rs) for c, rs in moved.items()},
        "moved_rate_by_repeat": {c: moved_rate_by_repeat(rs) for c, rs in moved.items()},
        **extra,
    }  # fmt: skip
    return report.clean(line)  # type: ignore[no-any-return]


def moved_rate(results: list[Result]) -> float:
    """Of the resumed turns whose server and previous turn's server are known (`Result.server`),
    the share served by the other server; NaN if none is known."""
    last: dict[tuple[int, str], str | None] = {}
    moved = known = 0
    for r in sorted(results, key=lambda r: (r.repeat, r.round)):
        conversation = (r.repeat, r.key.rsplit("r", 1)[0])  # keys are c<conversation>r<round>
        before = last.get(conversation)
        if r.resumed and r.server and before:
            known += 1
            moved += r.server != before
        last[conversation] = r.server
    return moved / known if known else NAN


def moved_rate_by_repeat(results: list[Result]) -> list[float]:
    """`moved_rate` of each repeat, in repeat order (a repeat whose router did not alternate shows)."""
    repeats = sorted({r.repeat for r in results})
    return [moved_rate([r for r in results if r.repeat == k]) for k in repeats]


def ratios(figures: dict[str, Figures]) -> dict[str, float]:
    """The `RATIOS`: resumed-turn TTFT p50 and throughput; NaN where either side is unmeasured."""
    out = {}
    for name, top, bottom in RATIOS:
        a, b = figures.get(top), figures.get(bottom)
        for fig, attr in (("ttft", "ttft_resume_p50_ms"), ("throughput", "throughput_tok_s")):
            out[f"{fig}_{name}"] = (
                NAN if a is None or b is None else ratio(getattr(a, attr), getattr(b, attr))
            )
    return out
