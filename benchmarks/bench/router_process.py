"""Run sglang's router (smg, the Shepherd Model Gateway) in front of servers, in a subprocess.

Which router: `smg` 1.13, the maintained successor of `sglang-router` (whose 0.3.2 already runs the
same gateway code under its old name). Both serve sglang 0.5.23 workers here (`/generate`,
`/v1/chat/completions`, with `usage.prompt_tokens_details.cached_tokens` passed through), but smg is
the one sglang 0.5.23 is released with (it depends on smg's gRPC servicer, and names SMG as its
router), and it routes OpenAI requests by the `model` they name (a wrong name is a 404, never
another model's answer), which the old package does not check. Locked in requirements/cpu-lock.txt.

`round_robin` makes a conversation's consecutive turns land on different servers, which is what a
shared tier must survive. `cache_aware` over `grpc://` workers (servers in sglang's `--grpc-mode`)
routes by the KV events each worker streams (`extra_args`: `--block-size`, `--model-path`; see
docs/OPERATIONS.md, "Tier-aware routing"). The router binds 127.0.0.1 on a free port (its
Prometheus listener too, `metrics_url`: by default it would take 0.0.0.0:29000) and is stopped,
with its process group, like a server.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from benchmarks.bench.server_process import ServerStartError, free_port, spawn_group, stop_group


@dataclass
class RouterProcess:
    worker_urls: Sequence[str]
    policy: str = "round_robin"
    log_path: Path | None = None
    extra_args: Sequence[str] = ()  # more of smg's flags
    port: int = field(default_factory=free_port)
    prometheus_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        """smg's Prometheus metrics (`smg_worker_requests_total`, `smg_kv_index_blocks`, ...)."""
        return f"http://127.0.0.1:{self.prometheus_port}/metrics"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "smg.launch_router", "--worker-urls", *self.worker_urls,
            "--policy", self.policy, "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.prometheus_port),
            *self.extra_args,
        ]  # fmt: skip

    def start(self, timeout_s: float = 60.0) -> RouterProcess:
        self.proc = spawn_group(self.command(), self.log_path)
        try:
            self._wait_workers(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_workers(self, timeout_s: float) -> None:
        """Until the router lists every worker as healthy."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(f"router exited with code {self.proc.returncode}")
            if self.healthy_workers() >= len(self.worker_urls):
                return
            time.sleep(0.5)
        raise ServerStartError(
            f"router: not all of {len(self.worker_urls)} workers healthy after {timeout_s:.0f}s"
        )

    def healthy_workers(self) -> int:
        with (
            contextlib.suppress(OSError, ValueError),
            urllib.request.urlopen(self.base_url + "/workers", timeout=2) as r,
        ):
            workers = json.loads(r.read()).get("workers", [])
            return sum(1 for w in workers if w.get("is_healthy", True))
        return 0

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the router's process group, SIGKILL after `grace_s`. Idempotent."""
        if self.proc is not None:
            stop_group(self.proc, grace_s, 5.0)
            self.proc = None

    def __enter__(self) -> RouterProcess:
        return self.start() if self.proc is None else self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
