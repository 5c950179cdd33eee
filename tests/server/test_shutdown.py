"""A stopped server closes its tier first, and leaves no temp file (issue 12; see server/shutdown.py).

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

from benchmarks.bench.server_process import NO_CRASH_DIAGNOSTICS
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
