"""Is another process on this root now? Every process with a tier open on a root holds a shared
POSIX lock on `<root>/.present` (its mark); one asks whether another holds one by trying to turn
its own exclusive, without waiting (`others`). Part of `Tier.shared` (ledger.py, shared.py).

Why a lock: it lives exactly as long as its process (the kernel drops it at exit, SIGKILL
included; an NFS server when the client's lease expires), so it needs no heartbeat and leaves
nothing to clean up, and it works wherever the ledger's lock works (the same probe decides both,
filelock.py). Why not the ledger's file: its transactions lock and unlock the whole of `.budget`
(which would drop a mark held there, and wait on another process's), and closing any descriptor
of a file drops the process's locks on it, so `.present` too is opened once per process and root,
by that root's `Ledger`, whose mutex guards every call here.

Asking turns our mark exclusive for an instant; a process taking its mark at that instant fails
and counts that as a sign of another process (it is one), and marks again at its next refresh.
A root removed and re-created is marked again by our next ledger transaction there, which reopens
both files (a refresh never creates one: it would race with whoever is removing the root).
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from sgl_hicache.tier.file.budget.filelock import open_private

PRESENCE_NAME = ".present"
_HELD = (errno.EAGAIN, errno.EACCES)  # what `lockf(..., LOCK_NB)` raises for a lock another process holds


class ProcessMark:
    """This process's mark on one root (not thread-safe: the ledger's mutex guards it)."""

    def __init__(self, root: Path) -> None:
        self.path = Path(root) / PRESENCE_NAME
        self._fd = -1
        self.marked = False

    @property
    def opened(self) -> bool:
        return self._fd >= 0

    def mark(self) -> bool:
        """Open the file if needed and take our mark, without waiting; whether another process's
        lock was in the way (a sign of it; we then mark again at the next call). Raises OSError."""
        if self._fd < 0:
            self._fd = open_private(self.path)
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in _HELD:
                raise
            return True
        self.marked = True
        return False

    def others(self) -> bool:
        """Whether another process holds a mark (or is asking too), without waiting; call once
        marked. Raises OSError."""
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in _HELD:
                raise
            return True
        fcntl.lockf(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # ours alone: turning it back never waits
        return False

    def forget(self) -> None:
        """Drop the mark (the root was replaced, or this process is done with it); `mark` takes it
        again, in the file at the path then."""
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self.marked = -1, False
