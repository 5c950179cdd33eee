"""Ordering every copy of KV against sglang's forward, without a host sync (the project's second law).

sglang's forward writes and reads the KV pool on its own stream (the model runner's forward stream
with the overlap scheduler, the scheduler's stream without it). Our copies run on two streams of
our own and are ordered by events, as sglang's `HiCacheController` orders its own (its
`write_fence_stream` / `load_fence_stream`):

    pack (an eviction's spill, a write-through)        unpack (a restore, an early unpack)
    ───────────────────────────────────────────        ───────────────────────────────────────
    write ⟵ fence(forward)   the forward that          load ⟵ fence(forward)   an in-flight forward
                              wrote the slots is done                          may still write a slot
    gather slots → device temp                [G]      load ⟵ P of the source, if still packing
    forward ⟵ G              the slots may be freed    staging → device temp → scatter   [U]
    temp → pinned staging                     [P]      forward ⟵ U  when the slots are handed to
    (the tier write is submitted once P is done)                    the tree, or freed

`fence(forward)` is an event recorded on each forward stream at the call (everything sglang has
enqueued so far); `x ⟵ e` makes stream x wait for event e on the device; the scheduler thread only
enqueues and, later, asks `done()`. Staging is released only once the copy reading or writing it is
done. A device temp is allocated and used on one of our streams only, so the caching allocator's
reuse of it is stream-ordered.

`Streams` is the small device-agnostic interface: CUDA streams and events (`CudaStreams`), nothing
at all on the CPU where every copy is synchronous (`SyncStreams`), or a stand-in that runs the work
later in any order the events allow (the tests' recording fake), so the ordering above is tested on
the CPU by the same code that runs on a GPU.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from sgl_hicache_kernels import KVPoolView, LayerGroups, pack_kv, packed_nbytes, unpack_kv

TEMP_BYTES = 256 << 20
"""Device temp per copy: a node up to this size is gathered whole, so the forward waits for the
gather only; a larger one is copied in chunks of this size, and the forward waits for the last
chunk's gather, which comes after the earlier chunks' host copies."""


class Streams(abc.ABC):
    """The primitives the ordering needs. `asynchronous`: work runs later than `launch` returns."""

    asynchronous: bool = True

    @abc.abstractmethod
    def new_stream(self) -> Any:
        """A stream of our own."""

    @abc.abstractmethod
    def current(self) -> Any:
        """The calling thread's current stream (the scheduler's, on the scheduler thread)."""

    @abc.abstractmethod
    def launch(self, stream: Any, work: Callable[[], None]) -> None:
        """Enqueue the device work that `work` issues on `stream`, after everything enqueued before."""

    @abc.abstractmethod
    def record(self, stream: Any) -> Any:
        """An event that completes when everything enqueued on `stream` so far has run."""

    @abc.abstractmethod
    def wait(self, stream: Any, event: Any) -> None:
        """Work enqueued on `stream` from now on starts only after `event` (on the device; no host wait)."""

    @abc.abstractmethod
    def done(self, event: Any) -> bool:
        """Whether `event` completed. Never blocks."""

    @abc.abstractmethod
    def synchronize(self, event: Any) -> None:
        """Block until `event` completed (shutdown and tests only, never the scheduler's loop)."""

    def keep(self, tensor: torch.Tensor, stream: Any) -> None:  # noqa: B027 (a no-op but on CUDA)
        """Keep `tensor`'s device memory from reuse until the work enqueued on `stream` so far ran
        (a tensor allocated on another stream that our work reads: the slot indices)."""


class SyncStreams(Streams):
    """The CPU: every copy runs when it is launched, so every event is complete at once."""

    asynchronous = False

    def new_stream(self) -> Any:
        return None

    def current(self) -> Any:
        return None

    def launch(self, stream: Any, work: Callable[[], None]) -> None:
        work()

    def record(self, stream: Any) -> Any:
        return None

    def wait(self, stream: Any, event: Any) -> None:
        return None

    def done(self, event: Any) -> bool:
        return True

    def synchronize(self, event: Any) -> None:
        return None


class CudaStreams(Streams):
    """CUDA (and ROCm) streams and events of `device`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self) -> Any:
        return torch.cuda.Stream(self.device)

    def current(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def launch(self, stream: Any, work: Callable[[], None]) -> None:
        with torch.cuda.stream(stream):
            work()

    def record(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def keep(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


@dataclass(eq=False)
class Copy:
    """One pack or unpack enqueued on our streams; `event`: its completion."""

    event: Any
    streams: Streams = field(repr=False)

    @property
    def done(self) -> bool:
        return self.streams.done(self.event)


class CopyEngine:
    """Packs and unpacks of one pool's KV, ordered against sglang's forward (see the module doc).
    Scheduler thread only; never blocks. Packed bytes are in `layout`'s layer groups (one section
    per group, sgl_hicache_kernels/layout.py); an unpack moves one group's layers."""

    def __init__(self, view: KVPoolView, streams: Streams, layout: LayerGroups | None = None) -> None:
        self.view = view
        self.layout = layout or view.groups(0)
        self.streams = streams
        self._write = streams.new_stream()
        self._load = streams.new_stream()
        self._forward: list[Any] = []  # sglang's forward streams besides the current one

    def set_forward_streams(self, streams: Sequence[Any]) -> None:
        """The stream(s) sglang's forward runs on (the scheduler hands them over once, at its loop's
        start): the model runner's under the overlap scheduler, the scheduler's own without it."""
        self._forward = [s for s in streams if s is not None]

    def _forwards(self) -> list[Any]:
        """Where forwards run: the streams handed over, else the calling thread's current stream."""
        return self._forward or [self.streams.current()]

    def fence(self) -> list[Any]:
        """Events of what the forward streams and the current stream have enqueued so far."""
        current = self.streams.current()
        return [
            self.streams.record(s)
            for s in [*self._forwards(), *([current] if current not in self._forward else [])]
        ]

    def _fence(self, ours: Any, fence: list[Any] | None = None) -> None:
        """`ours` waits for what the forward streams and the current stream have enqueued so far
        (or for `fence`, recorded earlier by `fence()`)."""
        for event in self.fence() if fence is None else fence:
            self.streams.wait(ours, event)

    def forward_waits(self, copy: Copy | None) -> None:
        """Every forward enqueued from now on runs after `copy` (slots it writes are handed over or
        freed, or slots it reads may be reused). Only the forward streams wait: the scheduler's
        own stream, which does not touch the pool under the overlap scheduler, goes on."""
        if copy is not None:
            for stream in self._forwards():
                self.streams.wait(stream, copy.event)

    def pack(self, slots: torch.Tensor, dest: torch.Tensor) -> Copy:
        """Gather the KV at `slots` into host `dest` (packed layout). The slots may be freed as soon
        as this returns (later forwards wait for the gather); `dest` holds the bytes once the copy
        is done."""
        self._fence(self._write)
        groups = self.layout.group_layers
        if not self.streams.asynchronous:
            self.streams.launch(
                self._write, lambda: pack_kv(self.view, slots, dest, trusted=True, group_layers=groups)
            )
            return Copy(self.streams.record(self._write), self.streams)
        self.streams.keep(slots, self._write)
        pieces = [(g, *chunk) for g in range(self.layout.count) for chunk in self._chunks(len(slots), g)]
        for i, (g, start, end, lo, hi) in enumerate(pieces):
            box: list[torch.Tensor] = []  # the chunk's device temp, allocated on our stream
            sub = self.layout.subviews[g]
            self.streams.launch(self._write, _gather(sub, slots[start:end], hi - lo, box))
            if i == len(pieces) - 1:
                self.forward_waits(Copy(self.streams.record(self._write), self.streams))
            base = self.layout.section(g, len(slots))[0]
            self.streams.launch(self._write, _to_host(dest[base + lo : base + hi], box))
        return Copy(self.streams.record(self._write), self.streams)

    def write_barrier(self) -> Copy:
        """A copy that completes after everything enqueued on the write stream so far (what a pack
        that raised midway may have left there)."""
        return Copy(self.streams.record(self._write), self.streams)

    def load_barrier(self) -> Copy:
        """A copy that completes after everything enqueued on the load stream so far (what an
        unpack that raised midway may have left there)."""
        return Copy(self.streams.record(self._load), self.streams)

    def unpack(self, slots: torch.Tensor, src: torch.Tensor, after: Copy | None = None, group: int = 0,
               fence: list[Any] | None = None) -> Copy:  # fmt: skip
        """Scatter the packed KV of layer group `group` (`layout.span`: a packed buffer of that
        group's layers alone) from host `src` into `slots` (token i of `slots` takes token i of
        `src`), after `after` (the pack that fills `src`, if it may still run) and after the
        forwards enqueued so far (or `fence`, from `fence()` when the slots were allocated: a
        layer-wise restore's unpacks run beside the forward that reads them). Nothing reads the
        slots until `forward_waits` is called with the returned copy."""
        self._fence(self._load, fence)
        if after is not None:
            self.streams.wait(self._load, after.event)
        sub = self.layout.subviews[group]
        if not self.streams.asynchronous:
            self.streams.launch(self._load, lambda: unpack_kv(sub, slots, src, trusted=True))
            return Copy(self.streams.record(self._load), self.streams)
        self.streams.keep(slots, self._load)
        for start, end, lo, hi in self._chunks(len(slots), group):
            self.streams.launch(self._load, _scatter(sub, slots[start:end], src[lo:hi]))
        return Copy(self.streams.record(self._load), self.streams)

    def _chunks(self, n: int, group: int = 0) -> list[tuple[int, int, int, int]]:
        """(first token, end token, first byte, end byte in the group's own packed bytes) of
        page-aligned pieces of at most TEMP_BYTES (at least one page) covering n tokens of layer
        group `group`."""
        sub, page = self.layout.subviews[group], self.view.page_size
        per = max(1, TEMP_BYTES // packed_nbytes(sub, page)) * page
        out = []
        for start in range(0, n, per):
            end = min(n, start + per)
            out.append((start, end, packed_nbytes(sub, start), packed_nbytes(sub, end)))
        return out


def _gather(
    view: KVPoolView, slots: torch.Tensor, nbytes: int, box: list[torch.Tensor]
) -> Callable[[], None]:
    def work() -> None:
        temp = torch.empty(nbytes, dtype=torch.uint8, device=view.device)
        pack_kv(view, slots, temp, trusted=True)
        box.append(temp)

    return work


def _to_host(dest: torch.Tensor, box: list[torch.Tensor]) -> Callable[[], None]:
    def work() -> None:
        dest.copy_(box.pop(), non_blocking=True)

    return work


def _scatter(view: KVPoolView, slots: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
    def work() -> None:
        temp = torch.empty(src.numel(), dtype=torch.uint8, device=view.device)
        temp.copy_(src, non_blocking=True)
        unpack_kv(view, slots, temp, trusted=True)

    return work


def streams_for(device: torch.device) -> Streams:
    """The streams a pool on `device` needs: CUDA's on a GPU, none on the CPU."""
    return CudaStreams(device) if device.type == "cuda" else SyncStreams()
