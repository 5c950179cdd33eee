"""What the benchmark reads from outside a server: `/metrics`, its processes' RSS, bytes on disk."""

from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? (\S+)$")


def scrape(base_url: str) -> dict[str, float]:
    """`/metrics` as {'name{labels}': value}; the `tp_rank`/`model_name` style labels are kept."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def spill_state(base_url: str) -> dict[str, Any]:
    """Our cache's state from `GET /server_info` (counters, staging, tier stats, integrity)."""
    with urllib.request.urlopen(base_url + "/server_info", timeout=60) as r:
        state: dict[str, Any] = json.loads(r.read())["internal_states"][0]["hicache_spill"]
    return state


def total(metrics: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(
        v for k, v in metrics.items()
        if k.split("{")[0] == name and all(w in k for w in want)
    )  # fmt: skip


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a server and all its processes (scheduler, detokenizer), MiB."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    rss = 0
    for p in procs:
        try:
            rss += p.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return rss / 2**20


def dir_bytes(root: Path | None) -> int:
    """Bytes of the regular files under `root` (0 if it does not exist)."""
    if root is None:
        return 0
    n = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                n += os.stat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue  # replaced or evicted meanwhile
    return n


class Sampler:
    """Samples a server's RSS (MiB) and the bytes under its tier directory every `every_s` seconds
    in a thread: `samples` is a list of (seconds since start, rss_mb, tier_bytes). `also`: more
    processes whose RSS (with their children's) counts as the server's (its LMCache daemon)."""

    def __init__(
        self, pid: int, tier: Path | None = None, every_s: float = 1.0, also: tuple[int, ...] = ()
    ) -> None:
        self.pid, self.tier, self.every_s, self.also = pid, tier, every_s, also
        self.samples: list[tuple[float, float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def follow(self, pid: int) -> None:
        """Sample the server `pid` from now on (a restarted one)."""
        self.pid = pid

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.is_set():
            rss = tree_rss_mb(self.pid) + sum(tree_rss_mb(p) for p in self.also)
            self.samples.append((time.monotonic() - t0, rss, dir_bytes(self.tier)))
            self._stop.wait(self.every_s)

    @property
    def peak_rss_mb(self) -> float:
        return max((s[1] for s in self.samples), default=0.0)
