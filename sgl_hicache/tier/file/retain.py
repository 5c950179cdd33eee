"""What `FileTier` keeps and removes for the retention hints (pin, drop, purge): `base.Tier.retain`,
`submit_remove`, `submit_purge`.

- **Retained** keys are pinned in the index (`Index.pin`, the pin a running load takes), so this
  process's eviction passes over them, until their deadline (`time.monotonic()`); deadlines are
  checked whenever a key is retained and before every store is queued (a store is what evicts).
  Another process sharing the root evicts by its own LRU and file ages: a pin is this process's.
- **Removal** takes a key out of the index and the retained set and marks it *dying*, as eviction
  does (budget/process.py), so that a store of the same key queued meanwhile waits for the unlink and
  then writes anew; the file is unlinked (accounted in the root's ledger, its aliases after it)
  even while a load reads it: on POSIX that load still reads the whole verified file, and every
  later one is a clean MISS. A key whose store is in flight is *doomed* instead: that store's job
  removes the file it has just published (and completes REJECTED).
- **Purge**: stores of the salt in flight when it is queued are doomed; then every file that
  belongs to the salt (purge.py) is removed from this tier's namespace and, on TP rank 0, from every
  namespace that is no rank's of this server (`purge.purged_namespaces`: the other ranks purge
  their own). Files of a newer format version are kept (their salt cannot be told here) and counted
  in `newer_extents`. A purge cut short by an I/O error (its completion says so) is *owed*: run
  again by `retry_purges` (the tier's periodic refresh, about every second) until it is done,
  each run counted in `purge_retries`.
- **Counting**: every file a removal or purge removed is counted in `purged_extents` and its
  completion's `nbytes`, also when the job was cut short (`Removed.error`: the completion then
  says IO_ERROR); a removal whose unlink of one key raised still unlinks the others.

Methods ending in `_locked` run under `budget.lock`; the others take it themselves.
"""

from __future__ import annotations

import time
from collections.abc import Container, Sequence
from pathlib import Path
from typing import NamedTuple

from sgl_hicache.tier.file.budget.process import ProcessBudget
from sgl_hicache.tier.file.purge import belongs, marked_extents, purged_namespaces
from sgl_hicache.tier.format import DirectoryMac
from sgl_hicache.tier.keys import ExtentKey, Namespace
from sgl_hicache.tier.results import Op


class Removed(NamedTuple):
    """What a removal or purge did: the `files` it removed, and what cut it short (None: done)."""

    files: int
    error: Exception | None = None


class TierRetention:
    def __init__(
        self, budget: ProcessBudget, seal: DirectoryMac, storing: Container[ExtentKey], ns: Namespace
    ) -> None:
        """`storing`: the keys of the stores in flight (FileTier's, under `budget.lock`); `ns`: the tier's."""
        self._budget, self._seal, self._storing, self._ns = budget, seal, storing, ns
        self._until: dict[ExtentKey, float] = {}  # retained key -> deadline (monotonic)
        self._tags: dict[ExtentKey, bytes] = {}  # salt tag of each store in flight that has one
        self._doomed: set[ExtentKey] = set()  # stores in flight whose file must go once written
        self._owed: set[bytes] = set()  # salt tags of purges cut short by an I/O error (under budget.lock)

    @property
    def retained(self) -> int:
        return len(self._until)

    def retain_locked(self, keys: Sequence[ExtentKey], until: float) -> None:
        self.expire_locked()
        for key in keys:
            if key not in self._until:
                self._budget.index.pin(key)
            self._until[key] = until

    def expire_locked(self) -> None:
        now = time.monotonic()
        for key in [k for k, until in self._until.items() if until <= now]:
            self._release_locked(key)

    def _release_locked(self, key: ExtentKey) -> None:
        if self._until.pop(key, None) is not None:
            self._budget.index.unpin(key)

    def storing_locked(self, key: ExtentKey, tag: bytes | None) -> None:
        """A store of `key` (with salt tag `tag`) is queued."""
        if tag is not None:
            self._tags[key] = tag

    def stored_locked(self, key: ExtentKey) -> list[tuple[ExtentKey, int]]:
        """The store of `key` ended (no longer in `storing`): what to `unlink` if it was doomed."""
        self._tags.pop(key, None)
        if key not in self._doomed:
            return []
        self._doomed.discard(key)
        return self.mark_locked([key])

    def doom_locked(self, tag: bytes) -> None:
        """A purge of the salt of `tag` is queued: its stores in flight are doomed."""
        self._doomed.update(k for k, t in self._tags.items() if t == tag)

    def mark_locked(self, keys: Sequence[ExtentKey]) -> list[tuple[ExtentKey, int]]:
        """Take `keys` out of the index and the retained set: those being stored are doomed, the
        others marked dying and returned with their indexed bytes, to `unlink`."""
        index, marked = self._budget.index, []
        for key in keys:
            self._release_locked(key)
            if key in self._storing:
                self._doomed.add(key)
            elif key not in index.dying_keys:  # else being unlinked already (an eviction)
                entry = index.get(key)
                if entry is not None:
                    index.kill([(key, entry)])
                else:
                    index.dying_keys.add(key)
                marked.append((key, 0 if entry is None else entry.file_bytes))
        return marked

    def unlink(self, marked: list[tuple[ExtentKey, int]]) -> Removed:
        """Unlink what `mark_locked` returned, each key even if another's unlink raised (a bug:
        `remove_file` counts an OSError itself); `error`: the first raise. Blocks."""
        removed, error = 0, None
        for key, nbytes in marked:
            try:
                removed += self._budget.remove_file(key)
            except Exception as e:  # ended by the job's completion (IO_ERROR), logged there
                error = error or e
            finally:
                self._budget.unlinked(key, nbytes)
        self._budget.counters.add("purged_extents", removed)
        return Removed(removed, error)

    def remove(self, keys: Sequence[ExtentKey]) -> Removed:
        with self._budget.lock:
            marked = self.mark_locked(keys)
        return self.unlink(marked)

    def purge(self, tag: bytes) -> Removed:
        """Remove every file of the namespaces this tier purges that belongs to the salt of `tag`.
        Blocks. Cut short by an OSError: owed (`retry_purges`)."""
        done = self._purge(tag)
        with self._budget.lock:
            if isinstance(done.error, OSError):
                self._owed.add(tag)
            elif done.error is None:
                self._owed.discard(tag)
        return done

    def retry_purges(self) -> None:
        """Run each owed purge again. Blocks."""
        with self._budget.lock:
            owed = list(self._owed)
        for tag in owed:
            self._budget.counters.add("purge_retries")
            error = self.purge(tag).error
            if error is None:
                continue
            self._budget.counters.add("io_errors")
            log = self._budget.faults.report if isinstance(error, OSError) else self._budget.faults.unexpected
            log(Op.PURGE, error, str(self._budget.paths.ns_dir))

    def _purge(self, tag: bytes) -> Removed:
        """The walk of `purge`, stopped by the first error (an OSError of the walk, a raise)."""
        ns_dir, root = self._budget.paths.ns_dir, self._budget.paths.root
        removed = 0
        try:
            for path, mark in marked_extents(purged_namespaces(root, self._ns), self._seal):
                if mark is not None and mark.newer:
                    self._budget.counters.add("newer_extents")
                if not belongs(mark, tag):
                    continue
                if Path(path).parent.parent != ns_dir:
                    removed += self._remove_foreign(path)
                    continue
                files, error = self.remove([ExtentKey(bytes.fromhex(Path(path).name.split(".")[0]))])
                removed += files
                if error is not None:
                    return Removed(removed, error)
        except Exception as e:  # counted and logged by the purge's completion (or `retry_purges`)
            return Removed(removed, e)
        return Removed(removed)

    def _remove_foreign(self, path: str) -> int:
        """Another namespace's file (another model, older weights, TP size): accounted, aliases too."""
        try:
            removed = self._budget.shared.unlink(path)
        except OSError as e:
            self._budget.shared.unlink_failed(e)
            return 0
        self._budget.counters.add("purged_extents", int(removed))
        return int(removed)
