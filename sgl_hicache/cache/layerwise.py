"""Layer-wise restores: a resumed request's prefill starts before its restore has landed, and the
forward's layer l reads restored KV only once group(l)'s bytes were read, verified and unpacked.

Extents are layer-grouped (format v6): the tier verifies and lands layer group 0 of a load before
group 1 (`Tier.landed` is a prefix of the destination). A restore whose every read has landed group
0 may be admitted layer-wise (`SpillRadixCache`, `--hicache-spill-layerwise`): its slots are handed
to the tree nodes at once (they are locked by this table until it settles), and it enters this
table. From then on:

- **Every forward waits, layer by layer** (`wait_layer`, called through `LayerCounter`, which the KV
  pool consults in `get_key_buffer` / `get_value_buffer` before attention reads layer l): for every
  restore in progress (any forward may read its slots: conservative and simple), group(l) is
  unpacked before `wait_layer` returns, waiting on the calling thread for its bytes if they have
  not landed. The unpack is ordered by the copy engine (device.py): on the CPU it runs at once; on a
  GPU it is enqueued on our load stream after the fence recorded when the slots were handed over,
  and the forward stream waits for that group's copy only, never the host for the device. The host
  thread waits for I/O (the forward cannot start layer l without its bytes), never for a copy.
- **A group that cannot land** (a read completed MISS / CORRUPT / IO_ERROR / MISMATCH, or none came
  within the I/O timeout) fails the restore: nothing more of it is unpacked, the forward goes on
  reading whatever its slots hold, and the restore ends failed. Its nodes stay locked (never spilled,
  never matched: `poisoned`) until the post-forward step (`SpillRadixCache.after_forward`), where
  the failure is agreed across TP ranks, takes them out of the tree (never matched, inserted over or
  evicted again: an insert of the same tokens makes new nodes), has the requests that used them
  retracted and recomputed, and frees their slots once no request holds them. Never a mix of
  restored and missing KV in an answer: a request whose forward read a failed restore's slots is
  never answered from that forward.
- **Settled**: once every group is unpacked, the reads' staging goes back (after the copies; a read
  another restore in progress still needs stays for it), every later forward waits for the last
  copy, and the lock is released; the nodes are ordinary resident nodes (their clean reference on
  the tier kept). Its tokens and bytes count as restored once every TP rank settled it.

All on the scheduler thread (sglang's forward runs there); the tier's I/O threads only land bytes.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sgl_hicache.cache.metrics import SpillMetrics
from sgl_hicache.cache.restores import RestoreProgress

POLL_MIN_S = 50e-6
POLL_MAX_S = 2e-3


@dataclass(eq=False)
class LayerwiseRestore:
    """One restore handed to the tree before all its layer groups landed."""

    seq: int  # admission order: the same on every TP rank (admission is agreed)
    owner: object
    nodes: list[Any]  # the chain restored, top down, resident since admission
    progress: RestoreProgress
    fence: list[Any]  # forward streams when its slots were handed over: its unpacks wait for these
    deadline: float  # monotonic: a group not landed by then fails the restore
    landed_at_admission: int  # layer groups wholly landed when the request was admitted
    anchor: Any = None  # the parent of the chain's top at admission (a split above keeps it below it)
    failed: str | None = None
    waited: set[int] = field(default_factory=set)  # groups the forward streams were told to wait for
    unlocked: bool = False  # the table's lock on the chain was released
    detached: list[Any] | None = None  # failed: its resident nodes, taken out of the tree (None: not yet)

    @property
    def groups(self) -> int:
        return self.progress.groups

    @property
    def overlapped(self) -> bool:
        """Whether the prefill was admitted before the restore's last group landed."""
        return self.landed_at_admission < self.groups

    def done(self, group: int) -> bool:
        return self.progress.group_done(group)

    @property
    def complete(self) -> bool:
        return all(self.done(g) for g in range(self.groups))


class Layerwise:
    """The layer-wise restores in progress (see the module doc). `unpack(progress, fence)` unpacks
    what landed of a restore (`SpillController.unpack_landed`), `failed(progress)` says why its
    reads can never land (None while they may), `poll()` takes the tier's completions, `settle(r)`
    and `fail(r)` end a restore (the cache's: reads, locks, metrics)."""

    def __init__(self, group_of: Callable[[int], int], timeout_s: float, metrics: SpillMetrics, *,
                 unpack: Callable[[RestoreProgress, list[Any]], int],
                 failed: Callable[[RestoreProgress], str | None],
                 poll: Callable[[], None],
                 forward_waits: Callable[[Any], None],
                 settle: Callable[[LayerwiseRestore], None],
                 fail: Callable[[LayerwiseRestore], None],
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:  # fmt: skip
        self.group_of = group_of
        self.timeout_s = timeout_s
        self.metrics = metrics
        self._unpack, self._failed, self._poll = unpack, failed, poll
        self._forward_waits, self._settle, self._fail = forward_waits, settle, fail
        self.clock, self.sleep = clock, sleep
        self.active: list[LayerwiseRestore] = []
        self.ended: list[LayerwiseRestore] = []  # settled or failed since `take_ended`
        self._seq = itertools.count()

    def start(self, owner: object, nodes: list[Any], progress: RestoreProgress, fence: list[Any],
              landed_groups: int) -> LayerwiseRestore:  # fmt: skip
        restore = LayerwiseRestore(next(self._seq), owner, list(nodes), progress, fence,
                                   self.clock() + self.timeout_s, landed_groups, nodes[0].parent)  # fmt: skip
        self.active.append(restore)
        self.metrics.inc("layerwise_restores")
        self.metrics.inc("layerwise_overlapped_restores", int(restore.overlapped))
        return restore

    # ---- the forward's wait ------------------------------------------------------------------

    def wait_layer(self, layer: int) -> None:
        """Before the forward reads local layer `layer`: every restore in progress has that layer's
        group unpacked, and the forward streams wait for its copy; or has failed. Blocks the calling
        thread for I/O only."""
        if not self.active:
            return
        group = self.group_of(layer)
        for restore in list(self.active):
            if restore.failed is None and group not in restore.waited:
                self._wait_group(restore, group)
        self._end_finished()

    def settle_all(self) -> None:
        """After a forward: every restore in progress ends, settled or failed (blocks for I/O). A
        forward that did not read every layer (none today) leaves nothing behind."""
        for restore in list(self.active):
            for group in range(restore.groups):
                if restore.failed is None and group not in restore.waited:
                    self._wait_group(restore, group)
        self._end_finished()

    def advance(self) -> None:
        """Never blocks (the scheduler's poll): unpack what landed of every restore in progress,
        end those complete or failed."""
        for restore in self.active:
            if restore.failed is None:
                self._step(restore)
        self._end_finished()

    def _wait_group(self, restore: LayerwiseRestore, group: int) -> None:
        pause, start = POLL_MIN_S, self.clock()
        while self._step(restore) and not restore.done(group):
            self.sleep(pause)
            pause = min(POLL_MAX_S, pause * 2)
            self._poll()
        if restore.failed is None:
            restore.waited.add(group)
            self._forward_waits(restore.progress.group_copies[group])
        self.metrics.inc("layerwise_wait_seconds", self.clock() - start)

    def _step(self, restore: LayerwiseRestore) -> bool:
        """Unpack what landed; False once the restore cannot go on (complete, or failed now)."""
        self._unpack(restore.progress, restore.fence)
        if restore.complete:
            return False
        why = self._failed(restore.progress)
        if why is None and self.clock() > restore.deadline:
            why = "late"
            self.metrics.inc("restores_too_late")
        if why is not None:
            restore.failed = why
            return False
        return True

    def _end_finished(self) -> None:
        keep = []
        for restore in self.active:
            if restore.failed is not None:
                self._fail(restore)
            elif restore.complete:
                self._settle(restore)
            else:
                keep.append(restore)
                continue
            self.ended.append(restore)
        self.active = keep

    def fail_all(self, why: str) -> None:
        """Every restore in progress fails (an error of ours in the wait: nothing more is trusted)."""
        for restore in self.active:
            restore.failed = restore.failed or why
        self._end_finished()

    def take_ended(self) -> list[LayerwiseRestore]:
        """The restores ended since the last call, in admission order."""
        ended, self.ended = sorted(self.ended, key=lambda r: r.seq), []
        return ended


class LayerCounter:
    """What sglang's KV pool calls before attention reads a layer (`register_layer_transfer_counter`:
    `get_key_buffer` / `get_value_buffer` call `wait_until(layer_id - start_layer)`), as its own
    `LayerDoneCounter` for HiCache. Ours needs no producer or consumer index: every forward waits for
    every layer-wise restore in progress (`Layerwise.wait_layer`, through `wait`, which never raises)."""

    def __init__(self, num_layers: int, wait: Callable[[int], None]) -> None:
        self.num_layers = num_layers
        self.consumer_index = 0  # read by some sglang pools: a load may be pending for any forward
        self.producer_index = 0
        self._wait = wait

    def wait_until(self, threshold: int) -> None:
        self._wait(threshold)

    def set_consumer(self, index: int) -> None:
        return None

    def update_producer(self) -> int:
        return 0

    def reset(self) -> None:
        return None
