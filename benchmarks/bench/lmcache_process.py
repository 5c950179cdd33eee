"""Run an LMCache daemon on 127.0.0.1, and an sglang server that keeps its KV in it.

LMCache (0.5.6, requirements/cpu-lock.txt) serves sglang 0.5.23 as a separate process, its
multiprocess server: `python -m lmcache.cli.main server ...` holds the L1 (host memory) and its L2
adapters (here a directory: `fs`, or `fs_native` with a capacity), and sglang's
`--enable-lmcache --lmcache-config-file F` (F: YAML with `mp_host` and `mp_port`) makes the server's
radix cache `LMCacheUnifiedRadixCache`, which stores each finished request's whole chunks there and
looks a new request's prefix up there (its cached tokens then show as `storage`, with
`storage_backend: LMCache`). It runs on CPU without patches. What it needs from us:

- `--supported-transfer-mode auto`: sglang's connector moves KV itself (engine-driven); the daemon's
  default (`lmcache_driven`) refuses that.
- `LMCACHE_TRACK_USAGE=false` in both processes (else LMCache reports usage to its servers).
- The chunk size is the daemon's (`--chunk-size`, default 256; the server asks for it): LMCache
  stores and finds whole chunks only, so its cached counts are chunk multiples, and the chunk must
  be a multiple of the server's page size.
- sglang's `/flush_cache` does not clear LMCache: a flushed prompt is then found there.
- `fs_native`'s `max_capacity_gb` bounds the disk only with an `eviction` block beside it.

Like `MooncakeMaster`, the daemon binds free loopback ports (its ZMQ request port and its HTTP
API, whose `/healthcheck` and `/status` say it is up and what it holds), leads its own process
group (stopped by `stop_group`, and by the signal-time reaper when the driver is killed), and is
started with (before, or beside) and stopped after the server that uses it (`LMCacheServer`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import TracebackType
from typing import Any

from benchmarks.bench.server_process import (
    ServerProcess,
    ServerStartError,
    free_port,
    spawn_group,
    stop_group,
)

ENV = {"LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1"}
"""Both processes: no usage reports to LMCache's servers (nothing outside this machine is reached)."""


class L2(Enum):
    """Where the daemon keeps what leaves its L1."""

    NONE = "none"  # nowhere: L1 only
    FS = "fs"  # files in a directory (Python, aiofiles), unbounded
    FS_NATIVE = "fs_native"  # files in a directory (LMCache's C++ connector), bounded by a capacity


@dataclass(frozen=True)
class DaemonSpec:
    """What one LMCache daemon is asked to be."""

    l1_mb: int  # --l1-size-gb, in MiB
    chunk_size: int = 256  # --chunk-size (LMCache's default)
    l2: L2 = L2.NONE
    l2_dir: Path | None = None  # the directory of an `fs`/`fs_native` L2
    l2_capacity_mb: int | None = None  # `fs_native`: max_capacity_gb, enforced by LRU eviction
    # --l2-store-policy: `default` keeps a chunk in L1 after its L2 copy is written; `skip_l1` drops it
    # from L1 then. A hit in L2 is loaded into L1 first, and the load is refused when L1 has no room
    # (LMCache 0.5.6: "L1 reservations failed with out-of-memory"): with `default` a full L1 (the
    # steady state of a busy server) serves nothing from disk; see docs/RESULTS.md.
    l2_store_policy: str = "default"
    extra_args: tuple[str, ...] = ()  # more of the daemon's flags (--l2-prefetch-policy, ...)

    def __post_init__(self) -> None:
        if self.l1_mb < 1 or self.chunk_size < 1:
            raise ValueError(
                f"LMCache L1 and chunk size must be >= 1, got {self.l1_mb} MiB, {self.chunk_size}"
            )
        if (self.l2 is not L2.NONE) != (self.l2_dir is not None):
            raise ValueError(f"an LMCache {self.l2.value} L2 takes a directory exactly when it is not none")
        if (self.l2 is L2.FS_NATIVE) != (self.l2_capacity_mb is not None):
            raise ValueError("an LMCache capacity is for the fs_native L2 only, and it needs one")
        if self.l2_store_policy not in ("default", "skip_l1") or (
            self.l2_store_policy == "skip_l1" and self.l2 is L2.NONE
        ):
            raise ValueError(f"LMCache L2 store policy {self.l2_store_policy!r} with L2 {self.l2.value}")

    def adapter(self) -> dict[str, Any] | None:
        """The `--l2-adapter` JSON object, or None."""
        if self.l2 is L2.NONE:
            return None
        spec: dict[str, Any] = {"type": self.l2.value, "base_path": str(self.l2_dir)}
        if self.l2 is L2.FS_NATIVE:
            assert self.l2_capacity_mb is not None
            spec |= {"max_capacity_gb": self.l2_capacity_mb / 1024, "eviction": {"eviction_policy": "LRU"}}
        return spec

    def args(self) -> list[str]:
        adapter = self.adapter()
        return [
            "--l1-size-gb", f"{self.l1_mb / 1024:.6f}", "--chunk-size", str(self.chunk_size),
            "--eviction-policy", "LRU", "--supported-transfer-mode", "auto", "--disable-observability",
            *(("--l2-adapter", json.dumps(adapter), "--l2-store-policy", self.l2_store_policy)
              if adapter is not None else ()), *self.extra_args,
        ]  # fmt: skip


def not_installed() -> str | None:
    """Why no LMCache daemon can start in this environment, in one line, or None."""
    if importlib.util.find_spec("lmcache") is None:
        return "LMCache is not installed here (requirements/cpu-lock.txt: lmcache==0.5.6, installed with --no-deps)"
    return None


def _answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class LMCacheDaemon:
    spec: DaemonSpec
    log_path: Path | None = None
    cpus: tuple[int, ...] | None = None  # as a server's (`spawn_group`)
    port: int = field(default_factory=free_port)  # ZMQ requests (what sglang dials)
    http_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "lmcache.cli.main", "server", "--host", "127.0.0.1", "--port", str(self.port),
            "--http-host", "127.0.0.1", "--http-port", str(self.http_port), *self.spec.args(),
        ]  # fmt: skip

    def write_config(self, path: Path) -> Path:
        """The YAML file sglang's `--lmcache-config-file` reads: where this daemon listens."""
        path.write_text(f"mp_host: 127.0.0.1\nmp_port: {self.port}\n")
        return path

    def start(self, timeout_s: float = 120.0) -> LMCacheDaemon:
        """Once its request port answers and `/healthcheck` says healthy; ServerStartError (with its
        log's tail) if it exits or is not up within `timeout_s`."""
        self.spawn()
        self.wait_up(timeout_s)
        return self

    def spawn(self) -> None:
        """Start it without waiting (`wait_up`), so that a server can boot beside it."""
        self.proc = spawn_group(self.command(), self.log_path, {**os.environ, **ENV}, self.cpus)

    def wait_up(self, timeout_s: float) -> None:
        """As `start` waits; the daemon is stopped if it does not come up."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while not (_answers(self.port) and self.healthy()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                code = self.proc.poll()
                self.stop()
                why = f"exited with code {code}" if code is not None else f"not up after {timeout_s:.0f}s"
                raise ServerStartError(f"LMCache daemon {why}{self._log_tail()}")
            time.sleep(0.2)

    def healthy(self) -> bool:
        with (
            contextlib.suppress(OSError, ValueError),
            urllib.request.urlopen(self.http_url + "/healthcheck", timeout=2) as r,
        ):
            return r.status == 200 and json.loads(r.read()).get("status") == "healthy"  # type: ignore[no-any-return]
        return False

    def status(self) -> dict[str, Any]:
        """Its `/status`: chunk size, each L1's object count and bytes, the L2 adapters."""
        with urllib.request.urlopen(self.http_url + "/status", timeout=10) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    def l1_objects(self) -> int:
        """Chunks in its L1 (all L1 managers)."""
        managers = self.status()["storage_manager"]["l1_managers"]
        return sum(int(m["total_object_count"]) for m in managers.values())

    def _log_tail(self, n: int = 3000) -> str:
        if not self.log_path or not Path(self.log_path).exists():
            return ""
        return "\n--- LMCache daemon log tail ---\n" + Path(self.log_path).read_text(errors="replace")[-n:]

    def stop(self) -> None:
        """SIGTERM its group (it closes in about a second), SIGKILL after 10 s. Idempotent."""
        if self.proc is not None:
            stop_group(self.proc, 10.0, 10.0)
            self.proc = None

    def kill(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, 0.0, 10.0, signal.SIGKILL)
            self.proc = None

    def __enter__(self) -> LMCacheDaemon:
        return self.start() if self.proc is None else self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def lmcache_flags(config_file: Path) -> tuple[str, ...]:
    """A server's flags that put its cache on the daemon `config_file` names."""
    return ("--enable-lmcache", "--lmcache-config-file", str(config_file))


@dataclasses.dataclass
class LMCacheServer(ServerProcess):
    """An sglang server (`sglang.launch_server`) with its own LMCache daemon: `start()` starts the
    daemon (on the server's CPUs, its log beside the server's) and the server; `stop()` and
    `kill()` end both, the server first. The daemon's YAML config lies beside the server's log (or in
    a temporary file)."""

    daemon_spec: DaemonSpec | None = None
    daemon: LMCacheDaemon | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.daemon_spec is None:
            raise ValueError("an LMCacheServer needs its daemon's DaemonSpec")
        self.env = {**ENV, **self.env}
        log = None if self.log_path is None else Path(f"{self.log_path}.lmcache.log")
        self.daemon = LMCacheDaemon(self.daemon_spec, log, self.cpus)

    def _config_path(self) -> Path:
        if self.log_path is not None:
            return Path(f"{self.log_path}.lmcache.yaml")
        return Path(tempfile.gettempdir()) / f"lmcache-{self.port}.yaml"

    def command(self) -> list[str]:
        return [*super().command(), *lmcache_flags(self._config_path())]

    def start(self, timeout_s: float = 180.0) -> LMCacheServer:
        """The daemon and the server boot side by side (the server's connector waits up to 300 s
        for the daemon: LMCache's `lmcache.mp.mq_timeout`); healthy once both are."""
        assert self.daemon is not None
        self.daemon.write_config(self._config_path())
        self.daemon.spawn()
        try:
            super().start(timeout_s)
        except BaseException:
            self.daemon.stop()
            raise
        return self

    def _wait_healthy(self, timeout_s: float) -> None:
        assert self.daemon is not None
        deadline = time.monotonic() + timeout_s
        self.daemon.wait_up(timeout_s)
        super()._wait_healthy(max(deadline - time.monotonic(), 1.0))

    def stop(self, grace_s: float = 10.0) -> None:
        super().stop(grace_s)
        if self.daemon is not None:
            self.daemon.stop()

    def kill(self) -> None:
        super().kill()
        if self.daemon is not None:
            self.daemon.kill()
