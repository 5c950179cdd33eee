"""Closing the spill tier when a scheduler process ends, so that a stopped server leaves no temp files.

How sglang 0.5.23 ends a scheduler process (`managers/scheduler.py` run_scheduler_process,
`managers/tokenizer_manager.py` sigterm_watchdog, `utils/watchdog.py` SubprocessWatchdog,
`utils/common.py` kill_process_tree), and where we close the tier:
- SIGTERM to the server's main process only (`kill PID`, `docker stop`, Kubernetes): the main
  process drains requests, sends each scheduler a `ShutdownReq` and waits up to 15 s before SIGKILL.
  The scheduler leaves its loop and, on this graceful path only, calls
  `Scheduler.release_host_resources`: a hook closes the tier first (`close_tier`).
- A signal to the whole process group (Ctrl-C in a terminal, `kill -- -PGID`, systemd's default
  KillMode=control-group, `ServerProcess.stop`): the scheduler receives it itself and installs no
  handler, so SIGTERM kills it at once and SIGINT raises KeyboardInterrupt, which skips
  `release_host_resources`; and the main process, seeing the detokenizer die, SIGKILLs the scheduler
  (SubprocessWatchdog, polling every second → SIGQUIT → kill_process_tree): about 6 s later by
  default, as it first sleeps 5 s for crash diagnostics, within a second where those are off
  (`SGLANG_PYSPY_DUMP_BEFORE_CRASH=0` and `SGLANG_CUDA_COREDUMP_BEFORE_CRASH=0`, as our test and
  benchmark servers run: `ServerProcess`). So, as the scheduler's
  loop starts, `close_on_signals` installs SIGTERM and SIGINT handlers in its main thread that close
  the tier and then do what the handler they replaced would have done (die by the signal, or raise
  KeyboardInterrupt). A handler runs between two bytecodes of the interrupted thread, which may hold
  a lock the close needs: the close runs on its own thread, waited for `CLOSE_S` at most, so the
  handler can never hang the process. Best effort: the handler runs only once the main thread is
  back in Python bytecode, and the main process's SIGKILL may come first.
- SIGKILL (the main process's last resort, a crash, the OOM killer): nothing of ours runs; the temp
  files of stores in flight stay until the next open's scan removes them (their writer pid is gone).

Closing is bounded: queued and running stores get `CLOSE_S`, then are abandoned and their temp
files removed (`Tier.close`). Stores finished meanwhile are complete extents a restart finds.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sgl_hicache.cache.controller import SpillController

logger = logging.getLogger(__name__)

CLOSE_S = 2.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)


def close_tier(io: SpillController, why: str) -> bool:
    """Close `io`'s tier within about `CLOSE_S` (on a helper thread, waited for at most that long
    plus a margin); whether it closed cleanly. Logs the outcome; never raises."""
    start = time.monotonic()
    failed: list[BaseException] = []

    def close() -> None:
        try:
            io.close(CLOSE_S)
        except BaseException as e:  # a device error, a bug: said below, never raised into sglang
            failed.append(e)

    closer = threading.Thread(target=close, name="sgl-hicache-shutdown", daemon=True)
    closer.start()
    closer.join(CLOSE_S + 1.0)
    took = time.monotonic() - start
    if closer.is_alive():
        logger.warning("sgl_hicache: spill tier not closed after %.1f s (%s); giving up", took, why)
        return False
    if failed:
        logger.warning("sgl_hicache: closing the spill tier (%s) failed after %.2f s: %r; spills not yet "
                       "submitted are lost (recomputed)", why, took, failed[0])  # fmt: skip
        return False
    logger.info("sgl_hicache: spill tier closed (%s) in %.2f s", why, took)
    return True


def close_on_signals(io: SpillController) -> None:
    """In the scheduler process's main thread: on SIGTERM or SIGINT, close the tier, then act as the
    handler replaced (none is installed over SIG_IGN, or off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in SIGNALS:
        previous = signal.getsignal(signum)
        if previous is not signal.SIG_IGN and previous is not None:
            signal.signal(signum, functools.partial(_on_signal, io, previous))


def _on_signal(io: SpillController, previous: Any, signum: int, frame: FrameType | None) -> None:
    signal.signal(signum, previous)  # a second signal meanwhile acts at once, as it would have
    close_tier(io, signal.Signals(signum).name)
    if callable(previous):
        previous(signum, frame)  # e.g. Python's SIGINT handler: KeyboardInterrupt
    else:  # SIG_DFL: die by the signal, as without us
        os.kill(os.getpid(), signum)
