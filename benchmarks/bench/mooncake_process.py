"""Run a Mooncake master (with its HTTP metadata server) on 127.0.0.1, in a subprocess.

For the examples, benchmarks and tests of the `mooncake` tier backend on one machine: the master's
RPC, metadata and metrics ports are free ones on loopback, it leads its own process group (stopped
like a server: `stop_group`, also by the signal-time reaper), and it can be restarted on the same
ports (a master restart mid-run). The binary is the venv's `mooncake_master` (pip package
mooncake-transfer-engine-non-cuda, in requirements/cpu-lock.txt).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from benchmarks.bench.server_process import ServerStartError, free_port, spawn_group, stop_group
from sgl_hicache.config import MiB, MooncakeConfig


def _answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class MooncakeMaster:
    log_dir: Path
    extra_args: tuple[str, ...] = ()
    rpc_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def config(self, segment_bytes: int = 64 * MiB, buffer_bytes: int = 16 * MiB) -> MooncakeConfig:
        """What a client on this machine joins it with (TCP on loopback)."""
        return MooncakeConfig(
            master=self.address, metadata_server=f"http://127.0.0.1:{self.http_port}/metadata", protocol="tcp",
            local_hostname="127.0.0.1", global_segment_size=segment_bytes, local_buffer_size=buffer_bytes,
        )  # fmt: skip

    def command(self) -> list[str]:
        return [
            str(Path(sys.executable).parent / "mooncake_master"), f"--rpc_port={self.rpc_port}",
            "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
            f"--http_metadata_server_port={self.http_port}", "--http_metadata_server_host=127.0.0.1",
            "--metrics_host=127.0.0.1", f"--metrics_port={free_port()}", *self.extra_args,
        ]  # fmt: skip

    def start(self, timeout_s: float = 20.0) -> MooncakeMaster:
        self.starts += 1
        self.proc = spawn_group(self.command(), self.log_dir / f"mooncake_master.{self.starts}.log")
        deadline = time.monotonic() + timeout_s
        while not (_answers(self.rpc_port) and _answers(self.http_port)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"mooncake_master did not start; see {self.log_dir}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, grace_s=2.0, kill_wait_s=10.0)
            self.proc = None

    def restart(self) -> None:
        """Killed (SIGKILL: everything it held is gone) and started again on the same ports."""
        if self.proc is not None:
            stop_group(self.proc, grace_s=0.0, kill_wait_s=10.0, first=signal.SIGKILL)
            self.proc = None
        self.start()

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
