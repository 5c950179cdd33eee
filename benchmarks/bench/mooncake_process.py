"""Run a Mooncake master (with its HTTP metadata server) on 127.0.0.1, in a subprocess.

For the examples, benchmarks and tests of the `mooncake` tier backend on one machine: the master's
RPC, metadata and metrics ports are free ones on loopback, it leads its own process group (stopped
like a server: `stop_group`, also by the signal-time reaper), and it can be restarted on the same
ports (a master restart mid-run). The binary is the venv's `mooncake_master` (pip package
mooncake-transfer-engine-non-cuda, in requirements/cpu-lock.txt).

`MooncakeRealClient` runs beside such a master the `mooncake_client` of Mooncake's standalone mode:
the one process of this host that holds its DRAM segment and talks to the master; servers join the
store through it (`MooncakeConfig.real_client`, `setup_dummy`), their staging shared memory it maps.
"""

from __future__ import annotations

import importlib.util
import os
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


def _spawn_answering(
    what: str, command: list[str], log: Path, ports: tuple[int, ...], timeout_s: float
) -> subprocess.Popen[bytes]:
    """`command` (`what`) started in a process group of its own (output to `log`), once every one
    of `ports` answers; ServerStartError (the group stopped) if it exits or `timeout_s` passes first."""
    proc = spawn_group(command, log)
    deadline = time.monotonic() + timeout_s
    while not all(_answers(port) for port in ports):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_group(proc, grace_s=2.0, kill_wait_s=10.0)
            raise ServerStartError(f"{what} did not start; see {log.parent}")
        time.sleep(0.05)
    return proc


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
        log = self.log_dir / f"mooncake_master.{self.starts}.log"
        self.proc = _spawn_answering(
            "mooncake_master", self.command(), log, (self.rpc_port, self.http_port), timeout_s
        )
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


REAL_CLIENT_THREADS = 4
"""`mooncake_client --threads`: the threads that serve its clients' calls, each call on one. At its
default (1) every call of both servers waits behind the one being served (a load behind a store);
4 lets a load and a store of each of the two servers run at once. A probe with 4 on a 2-CPU machine
read 40 objects of 5.6 MiB in one `batch_get_into` in about 15 ms."""


def real_client_binary() -> Path:
    """The `mooncake_client` binary of the installed `mooncake` package (the venv's
    `bin/mooncake_client` is a Python wrapper that execs it); found without importing the package."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise ServerStartError("the mooncake package is not installed (mooncake-transfer-engine-non-cuda)")
    return Path(next(iter(spec.submodule_search_locations))) / "mooncake_client"


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process `pid` used so far (Linux /proc), or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class MooncakeRealClient:
    """The `mooncake_client` of Mooncake's standalone mode on 127.0.0.1, a client of `master` that
    contributes `segment_bytes` of DRAM to its store and serves the servers that join it by
    `setup_dummy(..., address)`; it leads its own process group, stopped by `stop_group`."""

    master: MooncakeMaster
    log_dir: Path
    segment_bytes: int = 64 * MiB
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            str(real_client_binary()), "--host=127.0.0.1", f"--port={self.port}",
            f"--global_segment_size={self.segment_bytes // MiB}MB",
            f"--master_server_address={self.master.address}",
            f"--metadata_server=http://127.0.0.1:{self.master.http_port}/metadata",
            "--protocol=tcp", f"--threads={REAL_CLIENT_THREADS}",
        ]  # fmt: skip

    def start(self, timeout_s: float = 20.0) -> MooncakeRealClient:
        log = self.log_dir / "mooncake_client.log"
        self.proc = _spawn_answering("mooncake_client", self.command(), log, (self.port,), timeout_s)
        return self

    def stop(self) -> None:
        """Stopped; the CPU seconds it used are logged first (`cpu_seconds` in its log directory:
        on a shared 2-CPU machine the copies it makes for the servers are their time too)."""
        if self.proc is not None:
            if (used := cpu_seconds(self.proc.pid)) is not None:
                (self.log_dir / "cpu_seconds").write_text(f"{used:.2f}\n")
            stop_group(self.proc, grace_s=2.0, kill_wait_s=10.0)
            self.proc = None

    def __enter__(self) -> MooncakeRealClient:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
