"""Re-creating a tier directory removed while the tier serves (`rm -rf`), so that spilling resumes.

A store that finds its directory gone (FileNotFoundError) calls `Recreator.recreate` and retries
once. The missing levels are made again with the checks of open (`trust.reopen_trusted`: root and
namespace directory 0700, on the volume the tier was opened on), the 256 fan-out directories
(0700), and the tier's secret is written back (0600), so extents stored afterwards are still
trusted after a restart. The index forgets the extents whose files went with the directory: a load
of one would be a clean MISS anyway, but until then they would hold budget and fail
`check_integrity`.

If another process re-created the root first with a new secret (it was started on the empty
directory), that secret is kept: this tier goes on sealing with its own, so what it stores from
now on is dropped as untrusted by the next open. That is counted (`secret_conflicts`) and logged
once.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from sgl_hicache.tier.faults import Counters, logger
from sgl_hicache.tier.file.budget.process import ProcessBudget
from sgl_hicache.tier.file.paths import ExtentPaths


class Recreator:
    def __init__(self, paths: ExtentPaths, secret: bytes, budget: ProcessBudget, counters: Counters) -> None:
        self._paths, self._secret, self._budget, self._counters = paths, secret, budget, counters
        self._lock = threading.Lock()  # one I/O thread re-creates; the others then find it all there
        self._identity = _identity(paths.ns_dir)
        self._conflict_logged = False

    def recreate(self) -> None:
        """Re-create what is missing and forget vanished extents. Raises UntrustedDirectory, OSError."""
        with self._lock:
            reopened = self._paths.recreate(self._secret)
            identity = _identity(self._paths.ns_dir)
            renewed = bool({"root", "namespace"} & set(reopened.created)) or identity != self._identity
            self._identity = identity
            forgotten = self._forget_vanished() if renewed else 0
        if renewed:
            self._counters.add("recreations")
            made = ", ".join(reopened.created) or "nothing (another process did)"
            logger.warning(
                "spill tier directory %s was removed while serving: re-created %s; forgot %d extents "
                "whose files went with it", self._paths.root, made, forgotten,
            )  # fmt: skip
        if not reopened.secret_is_ours:
            self._secret_conflict()

    def _forget_vanished(self) -> int:
        with self._budget.lock:
            indexed = self._budget.index.items()
        gone = [(key, entry) for key, entry in indexed if not self._paths.extent(key).exists()]
        with self._budget.lock:
            for key, entry in gone:
                if self._budget.index.get(key) is entry:  # not stored again meanwhile
                    self._budget.index.remove(key)
        return len(gone)

    def _secret_conflict(self) -> None:
        self._counters.add("secret_conflicts")
        if not self._conflict_logged:
            self._conflict_logged = True
            logger.error(
                "spill tier directory %s was re-created by another process with a new secret: this "
                "server keeps its own, so the extents it stores from now on will not be trusted after "
                "a restart (logged once; counted in secret_conflicts)", self._paths.root,
            )  # fmt: skip


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino
