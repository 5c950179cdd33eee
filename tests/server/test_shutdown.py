"""A stopped server closes its tier first, and leaves no temp file (issue 12; see server/shutdown.py);
a server stopped while it starts leaves nothing of ours and no process behind (issue 38).

Two ways a server is stopped, each with its own server (each test stops it): a signal to the whole
process group (Ctrl-C, `kill -- -PGID`, systemd, `ServerProcess.stop`), which reaches the scheduler
itself; and SIGTERM to the main process only (`docker stop`, Kubernetes), which sglang turns into a
`ShutdownReq` to the scheduler. The in-process tests of `Tier.close` (tests/tier/test_close.py) show
that a write still in flight is abandoned without debris; these show that the close runs.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench.server_process import NO_CRASH_DIAGNOSTICS, ServerProcess, spawn_group, stop_group
from tests.server.conftest import SPILL_FLAGS
from tests.server.test_spill_resume import POOL, counter, push_out, two_turns

pytestmark = pytest.mark.server

# What a deployed server runs with (our test servers turn sglang's crash diagnostics off to stop
# fast, `NO_CRASH_DIAGNOSTICS`): a group signal then gives the scheduler's close sglang's ~5 s.
SGLANG_DEFAULTS = {name: "1" for name in NO_CRASH_DIAGNOSTICS}


def spilling_server(
    start_server: Any, tiny_model: Path, tier: Path, env: dict[str, str] | None = None
) -> Any:
    """A server whose device pool was pushed out once, so its tier holds spilled extents."""
    args = ("--enable-hicache-spill", "--hicache-spill-dir", str(tier), "--hicache-spill-min-free", "0")
    server = start_server(tiny_model, *args, max_total_tokens=POOL, env=env)
    two_turns(server.base_url, 301)
    spilled = counter(server.base_url, "spilled_tokens")
    push_out(server.base_url, 301)
    assert counter(server.base_url, "spilled_tokens") > spilled
    return server


def wait_group_gone(server: Any, timeout_s: float) -> None:
    """Until the server's main process has exited (reaped here) and every other one with it."""
    pgid = server.proc.pid
    server.proc.wait(timeout_s)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    pytest.fail(f"server process group {pgid} still alive after {timeout_s} s")


def assert_closed_clean(log: Path, tier: Path, why: str) -> None:
    text = log.read_text(errors="replace")
    assert f"spill tier closed ({why})" in text, "the scheduler did not close the tier"
    assert list(tier.rglob("*.tmp")) == []
    assert list(tier.rglob("*.ext")), "the spilled extents stay for a warm restart"


@pytest.mark.slow  # a repeat: every test server is stopped by its process group; the graceful path below
def test_a_signal_to_the_process_group_closes_the_tier(start_server: Any, tiny_model: Path,
                                                       tmp_path: Path) -> None:  # fmt: skip
    server = spilling_server(start_server, tiny_model, tmp_path / "tier", env=SGLANG_DEFAULTS)
    server.stop()  # SIGTERM to every process of the server at once
    assert_closed_clean(server.log_path, tmp_path / "tier", "SIGTERM")


def test_sigterm_to_the_main_process_closes_the_tier_on_the_graceful_path(
    start_server: Any, tiny_model: Path, tmp_path: Path
) -> None:
    server = spilling_server(start_server, tiny_model, tmp_path / "tier")
    os.kill(server.proc.pid, signal.SIGTERM)  # sglang drains, then sends its schedulers a ShutdownReq
    wait_group_gone(server, 60)
    assert_closed_clean(server.log_path, tmp_path / "tier", "shutdown request")


def spawned_children(pid: int) -> list[int]:
    """The children of `pid` that multiprocessing spawned (sglang's scheduler and detokenizer)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


def test_sigterm_during_start_up_leaves_nothing_behind(tiny_model: Path, tmp_path: Path) -> None:
    """SIGTERM to the launcher (`docker stop`, Kubernetes) as soon as sglang has spawned its
    scheduler, which sets itself to die with its parent only once its imports are done: before, the
    launcher died at once and left the scheduler and detokenizer running, orphaned, and the hint
    socket's runtime directory in the temp directory. Now: no process of the server, no directory
    of ours in TMPDIR, no temp file in the tier."""
    runtime, tier = tmp_path / "runtime", tmp_path / "tier"
    runtime.mkdir()
    args = (
        *SPILL_FLAGS,
        "--enable-hicache-spill",
        "--hicache-spill-dir",
        str(tier),
        "--hicache-spill-min-free",
        "0",
    )
    server = ServerProcess(tiny_model, POOL, args)
    env = {**NO_CRASH_DIAGNOSTICS, **os.environ, "SGLANG_USE_CPU_ENGINE": "1", "TMPDIR": str(runtime)}
    proc = spawn_group(server.command(), tmp_path / "server.log", env)
    try:
        deadline = time.monotonic() + 180
        while not spawned_children(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            time.sleep(0.05)
        assert [p.name for p in runtime.iterdir() if p.name.startswith("sgl_hicache_")], "no runtime dir yet"
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(60)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            pytest.fail("a process of the server outlived its launcher: orphaned")
    finally:
        stop_group(proc, 0.0, 10.0, signal.SIGKILL)
    assert [p.name for p in runtime.iterdir() if p.name.startswith("sgl_hicache_")] == []
    assert list(tier.rglob("*.tmp")) == []
