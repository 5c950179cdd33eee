"""Child processes of the sharing tests (started with multiprocessing's spawn context)."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import random
import time
from pathlib import Path
from typing import Any

from sgl_hicache.config import Fsync, TierConfig
from sgl_hicache.tier import ROOT_KEY, Namespace, Status, Tier, open_tier
from sgl_hicache.tier.file.budget.ledger import LEDGER_NAME, close_ledger, open_ledger
from sgl_hicache.tier.file.budget.ledger_state import State
from sgl_hicache.tier.file.sweep import walk_root
from tests.tier.common import CHUNK, NS, key_for, payload_for, tokens_for


def open_shared(directory: str, capacity: int, ns: Namespace = NS) -> Tier:
    cfg = TierConfig(
        directory=Path(directory), capacity_bytes=capacity, chunk_bytes=CHUNK, min_free_bytes=0,
        fsync=Fsync.NONE, io_threads=3,
    )  # fmt: skip
    return open_tier(cfg, ns)


def random_writer(directory: str, capacity: int, seed: int, ops: int, results: Any) -> None:
    """Stores (mostly), loads and discards random extents of a shared key space; reports its stats.
    Every OK load must hold the right bytes; a load may MISS (another process evicted the extent)."""
    rng = random.Random(seed)
    tier = open_shared(directory, capacity)
    bad: list[tuple[int, str]] = []
    over: list[int] = []
    for _ in range(ops):
        i, op = rng.randrange(60), rng.random()
        size = 3000 + (i * 7919) % (2 * CHUNK)  # one size per key: every process writes the same bytes
        if op < 0.7:
            tier.submit_store(key_for(i), payload_for(i, size), tokens_for(i), ROOT_KEY)
        elif op < 0.95:
            buf = bytearray(size)
            done = tier.wait(tier.submit_load(key_for(i), buf), 30)
            if done.status not in (Status.OK, Status.MISS) or (
                done.ok and buf != payload_for(i, size).tobytes()
            ):
                bad.append((i, done.status.value))
        else:
            tier.discard(key_for(i))
        tier.get_finished()
        over.extend(usage_over(directory, capacity))
    while tier.get_finished():
        time.sleep(0.01)
    stats = tier.stats()
    tier.close()
    results.put((seed, bad, stats.evictions, stats.no_space, stats.io_errors, stats.checksum_failures, over))


def usage_over(directory: str, capacity: int) -> list[int]:
    """The bytes of extent and temp files under the root, taken with the ledger locked (through this
    process's own Ledger: a second descriptor's close would drop the process's POSIX lock), if over
    `capacity`."""
    ledger = open_ledger(Path(directory))
    try:
        with ledger.locked():
            on_disk = sum(f.size for f in walk_root(Path(directory)))
    finally:
        close_ledger(ledger)
    return [on_disk] if on_disk > capacity else []


def discard(directory: str, capacity: int, index: int, results: Any) -> None:
    tier = open_shared(directory, capacity)
    results.put(tier.discard(key_for(index)))
    tier.close()


def stuck_writer(directory: str, capacity: int, index: int, started: Any) -> None:
    """A store whose header write never returns: its temp file exists and its bytes are leased
    when the parent SIGKILLs this process."""
    import sgl_hicache.tier.file.store as store

    real = store.pwritev_exact

    def hang_on_header(fd: int, views: Any, offset: int) -> None:
        if offset == 0:
            started.set()
            time.sleep(3600)
        real(fd, views, offset)

    store.pwritev_exact = hang_on_header  # type: ignore[assignment]
    tier = open_shared(directory, capacity)
    tier.submit_store(key_for(index), payload_for(index, 100_000), tokens_for(index), ROOT_KEY)
    time.sleep(3600)


def idle(directory: str, capacity: int, opened: Any) -> None:
    """Open a tier on the root and do nothing with it (a server that has had no request yet)."""
    open_shared(directory, capacity)
    opened.set()
    time.sleep(3600)


def open_and_close(directory: str, capacity: int, done: Any) -> None:
    """Open a tier on the root and close it at once: the ledger is rewritten with what it held."""
    open_shared(directory, capacity).close()
    done.put(True)


def spill_prompt(directory: str, capacity: int, extents: list[int], done: Any) -> None:
    """Store extents of `test_aliases.PROMPT` with their aliases (16-token blocks, as those tests)."""
    from sgl_hicache.tier import path_lookup as lookup
    from tests.tier import test_aliases

    lookup.BLOCK_TOKENS = 16
    tier = open_shared(directory, capacity)
    for i in extents:
        test_aliases.spill(tier, i)
    tier.close()
    done.put(True)


def store_then_load(
    directory: str, capacity: int, indices: list[int], results: Any, ns: Namespace = NS
) -> None:
    """Store `indices` one after another (oldest first, in namespace `ns`); report each status."""
    tier = open_shared(directory, capacity, ns)
    out = []
    for i in indices:
        size = 60_000
        done = tier.wait(tier.submit_store(key_for(i, ns), payload_for(i, size), tokens_for(i), ROOT_KEY), 30)
        out.append(done.status.value)
        time.sleep(0.02)  # distinct mtimes
    tier.close()
    results.put(out)


def hold_ledger(directory: str, seconds: float, locked: Any) -> None:
    fd = os.open(Path(directory) / LEDGER_NAME, os.O_RDWR)
    fcntl.lockf(fd, fcntl.LOCK_EX)
    locked.set()
    time.sleep(seconds)
    os.close(fd)


def load_status(directory: str, capacity: int, index: int, size: int, results: Any) -> None:
    """Load one extent; report its status and the misses, io errors and checksum failures counted."""
    tier = open_shared(directory, capacity)
    done = tier.wait(tier.submit_load(key_for(index), bytearray(size)), 30)
    s = tier.stats()
    tier.close()
    results.put((done.status.value, s.misses, s.io_errors, s.checksum_failures))


SPAWN = multiprocessing.get_context("spawn")


def start(children: list, target: Any, *args: Any) -> multiprocessing.process.BaseProcess:
    """Start `target(*args)` in a spawned child, recorded in `children` (the fixture kills leftovers)."""
    proc = SPAWN.Process(target=target, args=args, daemon=True)
    proc.start()
    children.append(proc)
    return proc


def locked_usage(root: Path) -> tuple[int, State | None]:
    """Bytes of extent and temp files under `root` and the ledger's state, read with the ledger locked."""
    fd = os.open(root / LEDGER_NAME, os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        on_disk = sum(f.size for f in walk_root(root))
        state = State.decode(os.pread(fd, 1 << 20, 0))
        fcntl.lockf(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    return on_disk, state
