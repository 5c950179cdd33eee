"""Write a run's results: JSON (everything), CSV (one row per request, one per system and
workload) and a PNG of TTFT per round per system; and build the final stdout line."""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.bench.aggregate import COUNTS, Measured, VersusBest
from benchmarks.bench.client import TIERS, Result
from benchmarks.bench.spec import COMPARED, FAMILIES
from benchmarks.bench.summary import EARLY_COUNTS, Figures, pct

REQUEST_FIELDS = ("system", "repeat", "workload", "key", "round", "resumed", "prompt_tokens", "prefix_tokens",
                  "follows", "sent_s", "done_s", "ttft_ms", "latency_ms", "output_tokens", "cached_tokens",
                  "cached_device", "cached_host", "cached_storage", "error", "server")  # fmt: skip


_RATIOS = tuple(f"{c.key}_vs_{base}" for c in COMPARED for base in ("recompute", *FAMILIES, "resident"))


def clean(x: Any) -> Any:
    if isinstance(x, float):
        return None if math.isnan(x) else float(f"{x:.4g}")
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [clean(v) for v in x]
    return x


def final_line(workloads: dict[str, dict[str, Figures]], ratios: dict[str, dict[str, float]],
               extra: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """The headline is the first workload (the lowest-concurrency multi-turn run); every workload's
    ratios follow under its name."""
    head = next(iter(workloads), None)
    figures = workloads.get(head, {}) if head else {}
    line: dict[str, Any] = {
        "headline_workload": head,
        "ttft_resume_p50_ms": {s: f.ttft_resume_p50_ms for s, f in figures.items()},
        "throughput_tok_s": {s: f.throughput_tok_s for s, f in figures.items()},
        **(ratios[head] if head else dict.fromkeys(_RATIOS)),
        "errors": sum(f.errors for figures in workloads.values() for f in figures.values()),
        "workloads": {name: ratios[name] for name in workloads},
        **extra,
    }
    return clean(line)  # type: ignore[no-any-return]


PER_SYSTEM = ("ttft_p50_ms", "ttft_resume_p50_ms", "ttft_resume_p90_ms", "queue_mean_ms", "throughput_tok_s",
              "resumed_resident", "resumed_restored", "resumed_recomputed", *EARLY_COUNTS, "tokens_restored",
              "tokens_recomputed", "disk_write_mb", "write_per_restored")  # fmt: skip
"""The figures the final line gives for every system on every workload (`per_system`)."""


def per_system(workloads: dict[str, dict[str, Figures]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per workload and system, the figures of `PER_SYSTEM` (medians over repeats; turn counts summed)."""
    return {
        w: {s: {k: getattr(f, k) for k in PER_SYSTEM} for s, f in fs.items()} for w, fs in workloads.items()
    }


def versus_best_keys(
    vs: dict[tuple[str, str], VersusBest], measured: dict[str, dict[str, Measured]]
) -> dict[str, Any]:
    """The final line's figures against the best configuration of each peer (`aggregate.versus_best`;
    medians over repeats, per workload and "overall"): `best_<peer>_config` (the best at the first
    compared figure, resumed TTFT) and `best_<peer>_config_<figure>` (at each other one),
    `<figure>_vs_best_<peer>`, their per-repeat ranges and the `resident` reference's; and the
    headline workload's spread of each compared figure per system."""
    head = next(iter(measured), None)
    by = measured.get(head, {}) if head else {}
    out: dict[str, Any] = {}
    for (peer, key), v in vs.items():
        out[f"best_{peer}_config" + ("" if key == COMPARED[0].key else f"_{key}")] = v.config
        out[f"{key}_vs_best_{peer}"] = v.ratio
        out[f"{key}_vs_best_{peer}_range"] = {w: list(r) for w, r in v.range.items()}
        out[f"resident_{key}_vs_best_{peer}"] = v.resident
    for c in COMPARED:
        out[f"{c.field}_range"] = {
            s: [getattr(m.low, c.field), getattr(m.high, c.field)] for s, m in by.items()
        }
    return out


def figures_doc(workloads: dict[str, dict[str, Figures]],
                spread: dict[str, dict[str, Measured]] | None) -> dict[str, Any]:  # fmt: skip
    """Each system's figures per workload (medians over repeats) with, given repeats, each figure's
    min-max spread and the per-repeat figures."""
    doc: dict[str, Any] = {w: {s: f.to_json() for s, f in fs.items()} for w, fs in workloads.items()}
    for w, by in (spread or {}).items():
        for s, m in by.items():
            lo, hi = m.low.to_json(), m.high.to_json()
            doc[w][s]["spread"] = {k: [lo[k], hi[k]] for k in lo if k not in COUNTS}
            doc[w][s]["repeats"] = [r.to_json() for r in m.runs]
    return doc


def write(out_dir: Path, results: dict[str, dict[str, list[Result]]],
          workloads: dict[str, dict[str, Figures]], line: dict[str, Any],
          metrics: dict[str, dict[str, dict[str, float]]] | None = None,
          spread: dict[str, dict[str, Measured]] | None = None) -> list[Path]:  # fmt: skip
    """`metrics`: per system and workload, how each `/metrics` series moved (only those that did);
    `spread`: every system's figures per repeat (summary.csv then has `<figure>_min`/`_max`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [
        out_dir / "results.json",
        out_dir / "requests.csv",
        out_dir / "summary.csv",
        out_dir / "ttft_per_round.png",
    ]
    doc: dict[str, Any] = {"final": line, "figures": figures_doc(workloads, spread),
           "requests": [_row(s, r) for s, by in results.items() for rs in by.values() for r in rs],
           "metrics": {s: {w: {k: v for k, v in m.items() if v} for w, m in by.items()}
                       for s, by in (metrics or {}).items()}}  # fmt: skip
    with replaced_whole(paths[0]) as tmp:
        tmp.write_text(json.dumps(clean(doc), indent=1) + "\n")
    _csv(paths[1], REQUEST_FIELDS, doc["requests"])
    rows = [
        {"workload": w, "system": s, **_flat(f)} for w, fs in doc["figures"].items() for s, f in fs.items()
    ]
    _csv(paths[2], tuple(rows[0]) if rows else ("workload",), rows)
    _plot(paths[3], results)
    return paths


def _flat(figures: dict[str, Any]) -> dict[str, Any]:
    spread = figures.get("spread", {})
    out = {k: v for k, v in figures.items() if k not in ("spread", "repeats")}
    for k, (lo, hi) in spread.items():
        out[f"{k}_min"], out[f"{k}_max"] = lo, hi
    return out


def _row(system: str, r: Result) -> dict[str, Any]:
    d = {k: v for k, v in asdict(r).items() if k in REQUEST_FIELDS}
    d.update(system=system, output_tokens=len(r.output_ids), cached_tokens=r.cached_tokens,
             **{f"cached_{t}": "" if r.cached is None else r.cached[t] for t in TIERS})  # fmt: skip
    return d


@contextlib.contextmanager
def replaced_whole(path: Path) -> Iterator[Path]:
    """A temporary path beside `path` to write; once the block ends without an exception it
    replaces `path` at once, so a run killed (or failing) mid-write leaves the previous file."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _csv(path: Path, fields: tuple[str, ...], rows: list[dict[str, Any]]) -> None:
    with replaced_whole(path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(fields), extrasaction="ignore")
        w.writeheader()
        w.writerows(clean(rows))


def _plot(path: Path, results: dict[str, dict[str, list[Result]]]) -> None:
    """TTFT p50 per round per system, one panel per workload (trace: rounds = reused blocks)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({w for by in results.values() for w in by})
    fig, axes = plt.subplots(1, max(1, len(names)), figsize=(5 * max(1, len(names)), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=False):
        for system, by in results.items():
            ok = [r for r in by.get(name, []) if r.error is None]
            rounds = sorted({r.round for r in ok})
            ax.plot(
                rounds, [pct([r.ttft_ms for r in ok if r.round == k], 50) for k in rounds], "o-", label=system
            )
        ax.set_title(name)
        ax.set_xlabel("round" if name.startswith(("multiturn", "agents")) else "blocks reused")
        ax.set_ylabel("TTFT p50 (ms)")
        ax.set_yscale("log")
        ax.legend()
    fig.tight_layout()
    with replaced_whole(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
