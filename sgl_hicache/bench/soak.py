"""`--soak MINUTES`: closed-loop multi-turn load on ours for that long, new conversations each
cycle, while a thread samples the server's RSS and the tier's bytes on disk.

It fails on any failed request, on RSS growing more than `rss_growth_mb` from the end of warm-up
(the first fifth of the soak) to the end, or on the tier ever holding more than its capacity.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from sgl_hicache.bench import drive, pagecache, systems
from sgl_hicache.bench.probe import Sampler
from sgl_hicache.bench.spec import BenchSpec, Soak

SALT_BASE = 1000


@dataclass
class SoakOutcome:
    requests: int = 0
    errors: int = 0
    samples: list[tuple[float, float, int]] = field(default_factory=list)  # (t_s, rss_mb, tier_bytes)

    def failures(self, soak: Soak) -> list[str]:
        out = []
        if not self.requests:
            out.append("soak: no request completed")
        if self.errors:
            out.append(f"soak: {self.errors} of {self.requests} requests failed")
        if not self.samples:
            return [*out, "soak: no samples taken"]
        end = self.samples[-1][0]
        warm = [rss for t, rss, _ in self.samples if t >= end / 5] or [self.samples[-1][1]]
        growth = self.samples[-1][1] - warm[0]
        if growth > soak.rss_growth_mb:
            out.append(f"soak: RSS grew {growth:.0f} MiB after warm-up, bound {soak.rss_growth_mb:.0f}")
        peak_tier = max(b for _, _, b in self.samples)
        if peak_tier > soak.tier_capacity_mb * 2**20:
            out.append(f"soak: tier held {peak_tier / 2**20:.0f} MiB, capacity {soak.tier_capacity_mb}")
        return out

    def figures(self) -> dict[str, float]:
        rss = [s[1] for s in self.samples] or [0.0]
        return {"soak_requests": self.requests, "soak_errors": self.errors, "soak_rss_start_mb": rss[0],
                "soak_rss_end_mb": rss[-1], "soak_rss_peak_mb": max(rss),
                "soak_tier_peak_mb": max((s[2] for s in self.samples), default=0) / 2**20}  # fmt: skip


def run(spec: BenchSpec, soak: Soak, model: Path, workdir: Path, vocab: int) -> SoakOutcome:
    system = systems.build("ours", spec.shape, model, workdir, tier_capacity_mb=soak.tier_capacity_mb)
    outcome = SoakOutcome()
    load = soak.load

    def drop() -> None:
        if spec.drop_page_cache:
            pagecache.drop([system.tier_dir] if system.tier_dir else [])

    with (
        system.server(model, workdir / "soak.log") as server,
        Sampler(server.proc.pid if server.proc else 0, system.tier_dir, soak.sample_s) as sampler,
        tqdm(total=round(soak.minutes * 60), desc="soak", file=sys.stderr, unit="s") as bar,
    ):
        deadline = time.monotonic() + soak.minutes * 60  # from the moment the server is up
        quiet = tqdm(disable=True)  # the soak's bar shows elapsed time, not requests
        cycle = 0
        while time.monotonic() < deadline:
            t = time.monotonic()
            driven = asyncio.run(
                drive.multiturn(server.base_url, load, vocab, SALT_BASE + cycle, drop, quiet)
            )
            outcome.requests += len(driven.results)
            outcome.errors += sum(r.error is not None for r in driven.results)
            bar.update(round(time.monotonic() - t))
            cycle += 1
    outcome.samples = sampler.samples
    return outcome
