"""`--soak MINUTES`: closed-loop multi-turn load on ours for that long, new conversations each
cycle, while a thread samples the server's RSS and the tier's bytes on disk. Halfway, between two
cycles (nothing in flight), the server's whole process group is SIGKILLed (a crash: nothing of ours
runs) and a new server starts on the same tier (a warm restart); it first replays the cycle before
the crash, whose prompts it has never seen but its tier holds.

It fails on any failed request, on RSS growing more than `rss_growth_mb` from the end of warm-up
(the first fifth of each server's life) to the end of that life, on the tier ever holding more than
its capacity, and on a warm restart that restored nothing of the replayed cycle.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from benchmarks.bench import drive, pagecache, systems
from benchmarks.bench.probe import Sampler
from benchmarks.bench.server_process import ServerProcess
from benchmarks.bench.spec import BenchSpec, Soak

SALT_BASE = 1000


@dataclass
class SoakOutcome:
    requests: int = 0
    errors: int = 0
    samples: list[tuple[float, float, int]] = field(default_factory=list)  # (t_s, rss_mb, tier_bytes)
    restarted_at_s: float | None = None  # sampler time of the SIGKILL
    restored_after_restart: int = 0  # prompt tokens the restarted server took from its tier (replay)

    def lives(self) -> list[list[tuple[float, float, int]]]:
        """The samples of each server's life (one, or two around the restart)."""
        if self.restarted_at_s is None:
            return [self.samples]
        cut = self.restarted_at_s
        return [[s for s in self.samples if s[0] < cut], [s for s in self.samples if s[0] > cut and s[1] > 0]]

    def failures(self, soak: Soak) -> list[str]:
        out = []
        if not self.requests:
            out.append("soak: no request completed")
        if self.errors:
            out.append(f"soak: {self.errors} of {self.requests} requests failed")
        if not self.samples:
            return [*out, "soak: no samples taken"]
        for i, life in enumerate(self.lives()):
            if life:
                growth = _growth(life)
                if growth > soak.rss_growth_mb:
                    out.append(f"soak: RSS of server {i + 1} grew {growth:.0f} MiB after warm-up, "
                               f"bound {soak.rss_growth_mb:.0f}")  # fmt: skip
        peak_tier = max(b for _, _, b in self.samples)
        if peak_tier > soak.tier_capacity_mb * 2**20:
            out.append(f"soak: tier held {peak_tier / 2**20:.0f} MiB, capacity {soak.tier_capacity_mb}")
        if self.restarted_at_s is not None and not self.restored_after_restart:
            out.append("soak: the restarted server restored nothing of the cycle before the crash")
        return out

    def figures(self) -> dict[str, float]:
        rss = [s[1] for s in self.samples] or [0.0]
        lives = [life for life in self.lives() if life]
        return {"soak_requests": self.requests, "soak_errors": self.errors, "soak_rss_start_mb": rss[0],
                "soak_rss_end_mb": rss[-1], "soak_rss_peak_mb": max(rss),
                "soak_rss_growth_mb": max((_growth(life) for life in lives), default=0.0),
                "soak_tier_peak_mb": max((s[2] for s in self.samples), default=0) / 2**20,
                "soak_tier_end_mb": self.samples[-1][2] / 2**20 if self.samples else 0.0,
                "soak_restored_after_restart": self.restored_after_restart}  # fmt: skip


def _growth(life: list[tuple[float, float, int]]) -> float:
    start, end = life[0][0], life[-1][0]
    warm = [rss for t, rss, _ in life if t >= start + (end - start) / 5] or [life[-1][1]]
    return life[-1][1] - warm[0]


def run(spec: BenchSpec, soak: Soak, model: Path, workdir: Path, vocab: int) -> SoakOutcome:
    system = systems.build("ours", spec.shape, model, workdir, tier_capacity_mb=soak.tier_capacity_mb)
    outcome = SoakOutcome()
    load = soak.load

    def drop() -> None:
        if spec.drop_page_cache:
            pagecache.drop([system.tier_dir] if system.tier_dir else [])

    def cycle(server: ServerProcess, salt: int) -> drive.Driven:
        driven = asyncio.run(drive.multiturn(server.base_url, load, vocab, salt, drop, tqdm(disable=True)))
        outcome.requests += len(driven.results)
        outcome.errors += sum(r.error is not None for r in driven.results)
        return driven

    server = system.server(model, workdir / "soak.log").start()
    try:
        with (
            Sampler(server.proc.pid if server.proc else 0, system.tier_dir, soak.sample_s) as sampler,
            tqdm(total=round(soak.minutes * 60), desc="soak", file=sys.stderr, unit="s") as bar,
        ):
            start = time.monotonic()
            deadline, halfway = start + soak.minutes * 60, start + soak.minutes * 30
            salt = SALT_BASE
            while time.monotonic() < deadline:
                t = time.monotonic()
                cycle(server, salt)
                if outcome.restarted_at_s is None and time.monotonic() >= halfway:
                    server = _crash_and_restart(server, system, model, workdir, sampler, outcome)
                    replayed = cycle(server, salt)  # the prompts before the crash, from the tier
                    outcome.restored_after_restart = sum(
                        (r.cached or {}).get("storage", 0) for r in replayed.results
                    )
                salt += 1
                bar.update(round(time.monotonic() - t))
        outcome.samples = sampler.samples
    finally:
        server.stop()
    return outcome


def _crash_and_restart(server: ServerProcess, system: systems.System, model: Path, workdir: Path,
                       sampler: Sampler, outcome: SoakOutcome) -> ServerProcess:  # fmt: skip
    server.kill()
    outcome.restarted_at_s = sampler.samples[-1][0] if sampler.samples else 0.0
    again = system.server(model, workdir / "soak-restarted.log").start()
    sampler.follow(again.proc.pid if again.proc else 0)
    return again
