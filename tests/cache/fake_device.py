"""A recording stand-in for CUDA streams on CPU tensors: the device the ordering tests run on.

Work launched on a stream is queued, not run; it runs when a test steps that stream, in FIFO order
per stream, and a `wait` item lets nothing after it run until its event fired. So a test chooses
any order the events allow (an adversarial one: our copies as early as possible, the forward as
late, or the reverse) and every copy moves real bytes at the moment it runs. Whatever our code
forgot to order shows up as wrong bytes (a pack that gathered before the forward wrote its slots,
a forward that read before its unpack, a staging block reused under a copy). `log` names every
item run, in order.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from sgl_hicache.cache.device import Streams


@dataclass(eq=False)
class FakeEvent:
    fired: bool = False


@dataclass(eq=False)
class FakeStream:
    name: str
    queue: deque[tuple[str, Any]] = field(default_factory=deque)

    def runnable(self) -> bool:
        if not self.queue:
            return False
        kind, item = self.queue[0]
        return kind != "wait" or item.fired


class RecordingStreams(Streams):
    """Streams whose work runs only when stepped (see the module doc). `forward` stands for
    sglang's forward stream, which is also the current stream (the scheduler's, without overlap)."""

    asynchronous = True

    def __init__(self) -> None:
        self.streams: list[FakeStream] = []
        self.log: list[str] = []
        self.forward = self.new_stream("forward")

    def new_stream(self, name: str | None = None) -> FakeStream:
        stream = FakeStream(name or f"ours{len(self.streams)}")
        self.streams.append(stream)
        return stream

    def current(self) -> FakeStream:
        return self.forward

    def launch(self, stream: FakeStream, work: Callable[[], None]) -> None:
        stream.queue.append(("work", work))

    def record(self, stream: FakeStream) -> FakeEvent:
        event = FakeEvent(fired=not stream.queue)  # an idle stream's event completes at once
        if not event.fired:
            stream.queue.append(("record", event))
        return event

    def wait(self, stream: FakeStream, event: FakeEvent) -> None:
        if not event.fired:
            stream.queue.append(("wait", event))

    def done(self, event: FakeEvent) -> bool:
        return event.fired

    def synchronize(self, event: FakeEvent) -> None:
        while not event.fired:
            assert self.step_any(random.Random(0)), "an event can never fire: its streams wait in a cycle"

    def keep(self, tensor: torch.Tensor, stream: Any) -> None:
        return None  # the queued work holds its tensors itself

    # ---- the device's progress, chosen by the test ------------------------------------------

    def step(self, stream: FakeStream) -> bool:
        """Run `stream`'s next item if nothing it waits for is pending; whether one ran."""
        if not stream.runnable():
            return False
        kind, item = stream.queue.popleft()
        self.log.append(f"{stream.name}:{kind}")
        if kind == "work":
            item()
        elif kind == "record":
            item.fired = True
        return True

    def step_any(self, rng: random.Random, prefer: Callable[[FakeStream], bool] | None = None) -> bool:
        """Run one item of a runnable stream (among those `prefer` picks, if any is runnable)."""
        ready = [s for s in self.streams if s.runnable()]
        if prefer is not None and any(prefer(s) for s in ready):
            ready = [s for s in ready if prefer(s)]
        return bool(ready) and self.step(rng.choice(ready))

    def drain(self, rng: random.Random, prefer: Callable[[FakeStream], bool] | None = None) -> None:
        """Run everything, in an order drawn by `rng` among what the events allow."""
        while self.step_any(rng, prefer):
            pass
        assert all(not s.queue for s in self.streams), "work left that can never run: a wait cycle"

    @property
    def idle(self) -> bool:
        return all(not s.queue for s in self.streams)


def reuse_freed_slots_first(allocator: Any) -> None:
    """Make a token allocator hand out the slots freed last first, so a reuse hazard comes at once
    (sglang's appends freed slots behind all others)."""

    def free(slots: torch.Tensor) -> None:
        if slots.numel():
            allocator.free_pages = torch.cat((slots.to(torch.int64), allocator.free_pages))

    allocator.free = free
