"""Run a server in a subprocess: bind 127.0.0.1 on a free port, wait for health, stop by PID.

Used by the demo, the tests and the benchmarks. The server runs in its own process group (session),
so `stop()` ends it and every process it spawned (scheduler, detokenizer) even if it hangs; the
context manager stops it also when the body raises.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--skip-server-warmup")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time; the message ends with its log's tail."""


@dataclass
class ServerProcess:
    """`python -m <module> --model-path MODEL ... --host 127.0.0.1 --port PORT` as a managed process."""

    model_path: Path
    max_total_tokens: int
    extra_args: Sequence[str] = ()
    module: str = "sgl_hicache.launch_server"
    log_path: Path | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", self.module, "--model-path", str(self.model_path),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--max-total-tokens", str(self.max_total_tokens), *self.extra_args,
        ]  # fmt: skip

    def start(self, timeout_s: float = 180.0) -> ServerProcess:
        env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", **self.env}
        with open(self.log_path or os.devnull, "wb") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        try:
            self._wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self, timeout_s: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(f"server exited with code {self.proc.returncode}{self._log_tail()}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(self.base_url + "/health", timeout=2) as r,
            ):
                if r.status == 200:
                    return
            time.sleep(0.5)
        raise ServerStartError(f"server not healthy after {timeout_s:.0f}s{self._log_tail()}")

    def _log_tail(self, n: int = 4000) -> str:
        if not self.log_path or not Path(self.log_path).exists():
            return ""
        return "\n--- server log tail ---\n" + Path(self.log_path).read_text(errors="replace")[-n:]

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after `grace_s`; returns once the whole
        group is gone (or after a further 10 s). Idempotent."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        if not _wait_group_gone(self.proc, pgid, grace_s):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            _wait_group_gone(self.proc, pgid, 10.0)
        self.proc = None

    def __enter__(self) -> ServerProcess:
        return self.start() if self.proc is None else self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _wait_group_gone(proc: subprocess.Popen[bytes], pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        proc.poll()  # reap our direct child; its orphans are reaped by init
        if not _group_alive(pgid):
            return True
        time.sleep(0.1)
    return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
