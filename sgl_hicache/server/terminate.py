"""SIGTERM to our launcher's process while the server starts: it stops as on Ctrl-C.

Until sglang's HTTP server runs, nothing in the launcher's process handles SIGTERM (sglang's
tokenizer manager installs its handler with its event loop), so SIGTERM (`docker stop`, Kubernetes,
`kill PID`) ended the launcher at once: no `finally` ran, the hint socket's runtime directory stayed
in the temp directory, and a scheduler or detokenizer that sglang had spawned but that had not yet
asked to die with its parent (sglang's `kill_itself_when_parent_died`, after its imports: seconds)
ran on, orphaned, holding memory (on a GPU, what a restart needs). `exit_on_sigterm` makes SIGTERM
raise `Terminated` in the main thread instead, so the launcher unwinds as from KeyboardInterrupt:
`run_sglang` kills every process sglang started and `private_runtime_dir` removes its directory.
Once sglang's server runs, sglang's own handler has replaced ours (drain, then a ShutdownReq to
each scheduler: `hooks.py` 7 and 12).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import NoReturn


class Terminated(SystemExit):
    """SIGTERM while the server started; its code is the shell's for it, 128 + SIGTERM."""


def exit_on_sigterm() -> None:
    """In the launcher's main thread, where SIGTERM has its default action: raise `Terminated` on it."""
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, _terminate)


def _terminate(signum: int, frame: FrameType | None) -> NoReturn:
    signal.signal(signum, signal.SIG_IGN)  # a second one must not cut the clean-up short
    raise Terminated(128 + signum)
