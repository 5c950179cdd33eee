"""A store job's file-system half: is the extent there already, else write and publish it, counted.

`present` answers a store whose file is at its path, whoever wrote it: its mtime is refreshed
(others' LRU sees the use) and a file this process does not index (another process published it) is
adopted, indexed from the request; an indexed key whose file another process removed is forgotten,
so the store writes it again. `write` reserves room (budget/process.py), writes the file (store.py) and
ends the reservation according to what is left on disk: nothing (released), the published extent
(committed), or debris of a failure (retracted or orphaned: see budget/process.py).
"""

from __future__ import annotations

import contextlib
import os
from functools import partial

from sgl_hicache.config import TierConfig
from sgl_hicache.tier.codec import Prepared, StoreRequest
from sgl_hicache.tier.file.budget.index import Entry
from sgl_hicache.tier.file.budget.process import ProcessBudget
from sgl_hicache.tier.file.paths import ExtentPaths
from sgl_hicache.tier.file.store import Debris, write_extent
from sgl_hicache.tier.format import DirectoryMac
from sgl_hicache.tier.keys import ExtentKey, Namespace


class Publisher:
    def __init__(
        self,
        cfg: TierConfig,
        ns: Namespace,
        paths: ExtentPaths,
        budget: ProcessBudget,
        seal: DirectoryMac,
        direct: bool,
    ) -> None:
        self._cfg, self._ns, self._paths, self._budget, self._seal = cfg, ns, paths, budget, seal
        self.direct = direct

    def present(self, req: StoreRequest) -> bool:
        """Whether `req.key`'s file is at its path (touched, and indexed, then). Blocks (a stat)."""
        with self._budget.lock:
            if req.key in self._budget.index.dying_keys:  # our eviction is unlinking it: write anew
                return False
        try:
            size = os.stat(self._paths.extent(req.key)).st_size
        except OSError:  # gone (or unreadable: the write will tell)
            with self._budget.lock:
                forgotten = self._budget.index.remove(req.key)
            if forgotten is not None:  # we did not unlink it: someone else did
                self._budget.shared.saw_others()
            return False
        self.touch_file(req.key)
        with self._budget.lock:
            ours = req.key in self._budget.index
        if not ours:  # published after our scan, not by us
            self._budget.shared.saw_others()
        self._budget.adopt(req.key, Entry(req.parent, req.token_count, req.payload.nbytes, size))
        return True

    def touch_file(self, key: ExtentKey) -> None:
        """Refresh the file's mtime: other processes sharing the root evict by it (shared.py)."""
        with contextlib.suppress(OSError):  # only an eviction-order hint; a vanished file is fine
            os.utime(self._paths.extent(key))

    def write(self, prep: Prepared) -> None:
        """Reserve, write and publish `prep`, and account for the outcome. Raises OverBudget,
        FileNotFoundError (the root is gone), OSError."""
        req = prep.req
        res = self._budget.make_room(prep.file_bytes, req.key)
        entry = Entry(req.parent, req.token_count, req.payload.nbytes, prep.file_bytes)
        try:
            write_extent(prep, self._cfg, self._ns, self._paths, self.direct, self._seal,
                         partial(self._budget.check, res))  # fmt: skip
        except Debris as d:
            if d.published:
                self._budget.retract(res, entry)
            else:
                self._budget.orphaned(res)
            raise d.error from None
        except BaseException:
            self._budget.release(res)
            raise
        self._budget.commit(res, entry)
