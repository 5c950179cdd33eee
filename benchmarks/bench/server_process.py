"""Run a server in a subprocess: bind 127.0.0.1 on a free port, wait for health, stop by PID.

Used by the demo, the tests and the benchmarks. The server runs in its own process group (session),
so `stop()` ends it and every process it spawned (scheduler, detokenizer) even if it hangs; the
context manager stops it also when the body raises.

Being in its own session, a server does not get the driver's Ctrl-C, and nothing stops it when the
driver is killed (`timeout` sends SIGTERM). So every started server is registered (`_Reaper`), and
the first `start()` installs, in the main thread, SIGTERM and SIGINT handlers and an `atexit` hook
that stop every registered server; the handlers then do what the handler they replaced would have
done (SIGINT: KeyboardInterrupt), or exit with 128 + the signal number. A signal the driver ignores
stays ignored.

A server given `cpus` runs on those CPUs only, as a deployed server runs on its own GPUs: the
affinity is set in the child before `exec`, so sglang's processes and threads inherit it, and
`OMP_NUM_THREADS` defaults to their count. Without it a server's threads may use every CPU, and two
servers on one machine oversubscribe it (`--servers 2` gives each its share, `bench/cluster.py`).

Each start has its own TMPDIR (`scratch_env`; a caller's `env` may set another), removed by `stop()`
and `kill()`: sglang names its IPC sockets with `NamedTemporaryFile(delete=False)` and never removes
them, and a killed server leaves its runtime and Prometheus directories; a run of the test suite
left a few hundred such entries in /tmp.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import getpass
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from benchmarks.bench.model_modules import registry_env

CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--skip-server-warmup")
# `stop()` signals the whole group, so sglang's launcher sees its scheduler die and takes it for a
# crash: by default it then sleeps 5 s for py-spy and CUDA core dumps before it exits (and only
# then removes its runtime directory). A stop is no crash: these skip that (the environment or a
# caller's `env` wins). It also gives the scheduler's tier close (on SIGTERM) 0-1 s instead of ~5 s
# before the launcher SIGKILLs it: a test that restarts on the tier waits for its writes first.
NO_CRASH_DIAGNOSTICS = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}
CUDA_FLAGS = ("--device", "cuda")  # sglang's own defaults for everything else on a GPU


def device_flags(device: str) -> tuple[str, ...]:
    """The flags that put a server on `device` (cpu or cuda) with sglang's defaults there."""
    return CPU_FLAGS if device == "cpu" else CUDA_FLAGS


def scratch_env(path: str) -> dict[str, str]:
    """A server's environment for its scratch directory `path`: its `TMPDIR` (sglang names its IPC
    sockets there and never removes them; a killed server leaves its Prometheus and runtime
    directories there too), while torch inductor's compile cache stays where it was, shared and kept."""
    inductor = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")  # torch's default
    return {"TMPDIR": path, "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", inductor)}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


PORT_TRIES = 3


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time; the message ends with its log's tail."""


@dataclass
class ServerProcess:
    """`python -m <module> --model-path MODEL ... --host 127.0.0.1 --port PORT` as a managed process;
    its whole process group on `cpus` if given (None: wherever this process may run). Raises
    ValueError at construction for an empty `cpus` or one naming a CPU this process may not use."""

    model_path: Path
    max_total_tokens: int
    extra_args: Sequence[str] = ()
    module: str = "sgl_hicache.launch_server"
    log_path: Path | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    cpus: tuple[int, ...] | None = None
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    scratch: tempfile.TemporaryDirectory[str] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.cpus is not None:
            check_cpus(self.cpus)

    @property
    def on_cpu(self) -> bool:
        """Whether the server runs on the CPU (`--device cpu`, or no `--device`: sglang picks cuda)."""
        args = list(self.extra_args)
        return "--device" in args and args[args.index("--device") + 1 : args.index("--device") + 2] == ["cpu"]

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
        """Start it and wait until healthy; on another free port, up to `PORT_TRIES` times in all,
        while it exits because its port was taken since it was picked (a process started beside it,
        a Mooncake client's transfer port, may bind it first)."""
        for attempt in range(1, PORT_TRIES + 1):
            try:
                return self._start(timeout_s)
            except ServerStartError as e:
                if attempt == PORT_TRIES or "address already in use" not in str(e).lower():
                    raise
                self.port = free_port()
        raise AssertionError("unreachable")

    def _start(self, timeout_s: float) -> ServerProcess:
        # a process stop_group gave up on may still write there: its removal then never raises out of stop()
        self.scratch = tempfile.TemporaryDirectory(prefix="sgl_hicache_server_", ignore_cleanup_errors=True)
        env = {**NO_CRASH_DIAGNOSTICS, **registry_env(self.model_path), **os.environ, **scratch_env(self.scratch.name),
               **({"SGLANG_USE_CPU_ENGINE": "1"} if self.on_cpu else {}), **self.env}  # fmt: skip
        if self.on_cpu:  # --device cpu --tp-size N: the CPU profile's platform and thread binding
            from sgl_hicache_cpu.cpu_tp_env import cpu_tp_env

            env.update(cpu_tp_env(self.command(), env, self.cpus))
        self.proc = spawn_group(self.command(), self.log_path, env, self.cpus)
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
        group is gone (or after a further 10 s; about 2 s with `NO_CRASH_DIAGNOSTICS`) and its
        TMPDIR is removed. Idempotent."""
        if self.proc is not None:
            stop_group(self.proc, grace_s, 10.0)
            self.proc = None
        self._remove_scratch()

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a crash: nothing of the server runs after it);
        returns once the group is gone (or after 10 s) and its TMPDIR is removed."""
        if self.proc is not None:
            stop_group(self.proc, 0.0, 10.0, signal.SIGKILL)
            self.proc = None
        self._remove_scratch()

    def _remove_scratch(self) -> None:
        if self.scratch is not None:
            self.scratch.cleanup()
            self.scratch = None

    def __enter__(self) -> ServerProcess:
        return self.start() if self.proc is None else self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class _Reaper:
    """The process groups of this process's started, not yet stopped servers; stops them all on
    SIGTERM, SIGINT and exit (`install`: by the first `add` from the main thread, or by a caller
    that starts servers from other threads, before it does)."""

    def __init__(self) -> None:
        self.live: dict[int, subprocess.Popen[bytes]] = {}  # pgid (the leader's pid) -> leader
        self.previous: dict[int, Any] = {}  # signal -> the handler ours replaced
        self.at_exit = False
        self.handlers = False

    def add(self, proc: subprocess.Popen[bytes]) -> None:
        self.live[proc.pid] = proc
        self.install()

    def install(self) -> None:
        """The exit hook, once; the signal handlers once, from the main thread (only it may set them:
        from another thread this sets none, and a later call from the main thread does)."""
        if not self.at_exit:
            self.at_exit = True
            atexit.register(self.stop_all)
        if not self.handlers and threading.current_thread() is threading.main_thread():
            self.handlers = True
            self._install_handlers()

    def discard(self, pgid: int) -> None:
        self.live.pop(pgid, None)

    def stop_all(self, grace_s: float = 10.0) -> None:
        """SIGTERM every group at once, SIGKILL what is left after `grace_s` (as `stop`: sglang takes
        about 2 s to end, with `NO_CRASH_DIAGNOSTICS`), then wait up to 5 s more."""
        procs = list(self.live.items())
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            for pgid, _ in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, sig)
            deadline = time.monotonic() + wait_s
            procs = [(g, p) for g, p in procs if not _wait_group_gone(p, g, deadline - time.monotonic())]
        self.live.clear()

    def _install_handlers(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            current = signal.getsignal(signum)
            if current is not signal.SIG_IGN:
                self.previous[signum] = current
                signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop_all()
        previous = self.previous.get(signum)
        if callable(previous):
            previous(signum, frame)  # e.g. Python's SIGINT handler: KeyboardInterrupt
        else:
            sys.exit(128 + signum)


_REAPER = _Reaper()


def install_reaper() -> None:
    """Stop every started server on SIGTERM, SIGINT and exit from now on; call it from the main
    thread before starting servers from other threads (there no signal handler can be set)."""
    _REAPER.install()


def spawn_group(
    command: list[str],
    log_path: str | Path | None,
    env: Mapping[str, str] | None = None,
    cpus: Collection[int] | None = None,
) -> subprocess.Popen[bytes]:
    """`command` as the leader of a new process group, its output in `log_path` (None: discarded),
    known to the signal-time reaper until `stop_group`. With `cpus` (checked by `check_cpus`), the
    group runs on those CPUs only: set in the child before `exec`, so every process and thread it
    starts inherits them; and `OMP_NUM_THREADS` is their count unless `env` (None: this process's
    environment) sets it."""
    pin: Callable[[], None] | None = None
    if cpus is not None:
        pinned = check_cpus(cpus)
        env = {"OMP_NUM_THREADS": str(len(pinned)), **(os.environ if env is None else env)}
        pin = functools.partial(os.sched_setaffinity, 0, pinned)  # in the child, before exec
    with open(log_path or os.devnull, "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=pin
        )
    _REAPER.add(proc)
    return proc


def check_cpus(cpus: Collection[int]) -> tuple[int, ...]:
    """`cpus`, sorted, if a process may be pinned to them; ValueError if empty or naming a CPU this
    process may not use (`os.sched_getaffinity`)."""
    if not cpus:
        raise ValueError("cannot pin a process to no CPUs")
    allowed = os.sched_getaffinity(0)
    if unusable := sorted(set(cpus) - allowed):
        raise ValueError(f"CPUs {unusable} are not among those this process may use, {sorted(allowed)}")
    return tuple(sorted(set(cpus)))


def stop_group(proc: subprocess.Popen[bytes], grace_s: float, kill_wait_s: float,
               first: signal.Signals = signal.SIGTERM) -> None:  # fmt: skip
    """Send `first` (SIGTERM) to `proc`'s process group (it leads one), SIGKILL what is left after
    `grace_s`, wait up to `kill_wait_s` more for the group to be gone, and forget it in the
    signal-time reaper."""
    pgid = proc.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, first)
    if not _wait_group_gone(proc, pgid, grace_s):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        _wait_group_gone(proc, pgid, kill_wait_s)
    _REAPER.discard(pgid)


def _wait_group_gone(proc: subprocess.Popen[bytes], pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        proc.poll()  # reap our direct child; its orphans are reaped by init
        if not group_alive(pgid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def group_alive(pgid: int) -> bool:
    """Whether process group `pgid` still has a process (a zombie counts until it is reaped)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
