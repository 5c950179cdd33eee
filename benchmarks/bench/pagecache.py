"""Keep the page cache from serving "disk" reads from memory between benchmark phases.

As root, `sync` and `echo 1 > /proc/sys/vm/drop_caches` empty the whole page cache ("drop_caches").
Otherwise every file under the tier directories is written back and evicted from the page cache
with `posix_fadvise(POSIX_FADV_DONTNEED)` ("fadvise"), which needs no privileges. Our tier reads
with O_DIRECT anyway; HiCache's `file` backend reads through the page cache, so without this its
L3 hits would be memory reads.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def drop(dirs: Iterable[Path], write_back: bool = True, whole_cache: bool = True) -> str:
    """Evict the files under `dirs` from the page cache; returns the method used. `whole_cache`
    False: only those files (fadvise), leaving the servers' own code and libraries cached, so a
    request timed next pays no page faults in torch or sglang. `write_back`
    first writes dirty pages back (at a barrier, clock stopped) so that they can be evicted too;
    without it (inside a timed window) only clean pages go, and nothing is written on any system's
    clock: a buffered writer (HiCache's `file` backend) would pay for a sync our O_DIRECT tier never
    needs."""
    if write_back:
        os.sync()
    if whole_cache:
        try:
            DROP_CACHES.write_text("1\n")
            return "drop_caches"
        except OSError:
            pass
    for d in dirs:
        _fadvise_tree(d, write_back)
    return "fadvise"


def _fadvise_tree(root: Path, write_back: bool) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue  # removed meanwhile (the tier evicts and replaces files)
            try:
                if write_back:
                    os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
