"""Bytes a system writes to disk during a workload, counted the same way for every system.

What is counted: `write_bytes` of `/proc/<pid>/io` (Linux's per-process I/O accounting), summed over
the server's process tree (launcher, tokenizer, scheduler, detokenizer and whatever they spawn) and
the trees of the processes beside it that hold its cache (an LMCache daemon), read when a workload
starts and when it ends (`WriteMeter`). The kernel counts a buffered write when it dirties the page
and an O_DIRECT write when it is submitted, for every thread of a process, so every tier is counted
where it writes: ours (O_DIRECT, in the scheduler), HiCache's `file` L3 (buffered, in the
scheduler), LMCache's `fs`/`fs_native` disk tiers (in its daemon); and nothing the benchmark's
driver writes (its page-cache drops, its results) is. A write whose file is removed before it
reaches the disk still counts (`cancelled_write_bytes` is not subtracted): the system asked for it.

Why not the bytes in each system's tier directory: what a directory holds at the end misses what
was written and then evicted or overwritten, so a tier that rewrites (evicts and spills again) would
look cheaper than it is, and a tier that writes elsewhere would look free. Why not the block
device's counters (`/proc/diskstats`): every process on the machine writes there.

Also counted, alike for every system: the server's log (its stdout and stderr go to a file), a few
hundred bytes per request. A child that exits and is reaped by its parent adds its counts to the
parent's (the kernel folds them in), so a tree's sum stays whole; sglang's processes live as long
as the server. Where `/proc/<pid>/io` cannot be read (not Linux, another user's process) the figure
is NaN, never a guess.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

NAN = float("nan")
PROC = Path("/proc")


def write_bytes(pid: int) -> int | None:
    """The `write_bytes` of one process (all its threads, and its reaped children), or None if it is
    gone or its counters cannot be read."""
    try:
        text = (PROC / str(pid) / "io").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "write_bytes":
            return int(value)
    return None


def tree(pid: int) -> list[int]:
    """`pid` and every process below it; [] if it is gone."""
    try:
        root = psutil.Process(pid)
        return [pid, *(p.pid for p in root.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


class WriteMeter:
    """Bytes written by the process trees of `roots()` (read at each reading, so a process started
    meanwhile counts from its start) between `start()` and `stop()`. `read` and `below` are
    `write_bytes` and `tree` unless a test gives others."""

    def __init__(
        self,
        roots: Callable[[], Sequence[int]],
        read: Callable[[int], int | None] = write_bytes,
        below: Callable[[int], list[int]] = tree,
    ) -> None:
        self.roots, self.read, self.below = roots, read, below
        self._start = NAN

    def total(self) -> float:
        """Bytes written so far by every process of the trees (each counted once); NaN if there is no
        root, or one is gone or cannot be read. A process below a root that is gone by the time it is
        read is left out: its counts are its parent's once reaped."""
        roots = list(self.roots())
        if not roots:
            return NAN
        pids = dict.fromkeys(p for root in roots for p in self.below(root))
        counts = {p: self.read(p) for p in pids}
        if any(counts.get(root) is None for root in roots):
            return NAN
        return float(sum(v for v in counts.values() if v is not None))

    def start(self) -> None:
        self._start = self.total()

    def stop(self) -> float:
        """Bytes written since `start()` (NaN if either reading was)."""
        return self.total() - self._start
