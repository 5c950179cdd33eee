"""Server fixtures: the real sglang 0.5.23 server in a subprocess, always stopped by PID."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench.server_process import CPU_FLAGS, ServerProcess

SPILL_FLAGS = (*CPU_FLAGS, "--enable-metrics", "--enable-cache-report")


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Any]:
    """`start_server(model, *args, module=..., env=...)` → a healthy ServerProcess, stopped at teardown."""
    started: list[ServerProcess] = []

    def start(model: Path, *args: str, module: str = "sgl_hicache.launch_server", env: dict[str, str] | None = None,
              max_total_tokens: int = 2048) -> ServerProcess:  # fmt: skip
        log = tmp_path / f"server{len(started)}.log"
        server = ServerProcess(
            model, max_total_tokens, (*SPILL_FLAGS, *args), module=module, log_path=log, env=env or {}
        )
        started.append(server)
        return server.start()

    yield start
    for server in started:
        pgid = server.proc.pid if server.proc else None
        server.stop()
        if pgid is not None:
            with pytest.raises(ProcessLookupError):
                os.killpg(pgid, 0)


@pytest.fixture
def small_volume(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs (skipped where mounting is not permitted)."""
    target = tmp_path / "small"
    target.mkdir(mode=0o700)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(target)],
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield target
    subprocess.run(["umount", "-l", str(target)], check=False)


def lines_of_ours(log: Path) -> list[str]:
    """The lines of a server's log that name our package (a traceback through our code, a contained
    hook's error, a log line of ours): none where our backend was not selected."""
    return [line for line in log.read_text(errors="replace").splitlines() if "sgl_hicache" in line]


def post_json(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def eventually(check: Any, timeout_s: float = 10.0) -> bool:
    """Whether `check()` holds within `timeout_s` (polled): for effects a reply does not wait for
    (a hint is answered when taken; the prefetch runs on every rank later in that scheduler iteration)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


OWN_LABELS = ("backend", "enabled", "reason", "tp_rank")  # the labels `metrics` keeps in its keys


def raw_metrics(base_url: str) -> dict[str, float]:
    """`/metrics` as {'name{labels}': value} for our `sglang:hicache_spill_*` series, as served."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(sglang:hicache_spill_\S+) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def metrics(base_url: str) -> dict[str, float]:
    """`raw_metrics` keyed by the labels that tell our series apart (`OWN_LABELS`, in name order;
    not sglang's `model_name` and `pp_rank` nor `--extra-metric-labels`), summed over the rest:
    'sglang:hicache_spill_restored_tokens_total{tp_rank="0"}'."""
    out: dict[str, float] = {}
    for key, value in raw_metrics(base_url).items():
        name, _, labels = key.partition("{")
        pairs = sorted(p for p in re.findall(r'(\w+)="([^"]*)"', labels) if p[0] in OWN_LABELS)
        short = name + ("{" + ",".join(f'{k}="{v}"' for k, v in pairs) + "}" if pairs else "")
        out[short] = out.get(short, 0.0) + value
    return out


@pytest.fixture(scope="session")
def exactness_transcript(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """test_exactness_server.py's workload as a never-evicting plain server served it, once per
    session (the differential tests of both tier backends replay it)."""
    from tests.server.test_exactness_server import make_transcript

    return make_transcript(tiny_model, tmp_path_factory.mktemp("reference"))
