"""Agreement across tensor-parallel ranks: every rank takes the same cache decision, or none does.

With `--tp-size N` each rank's scheduler has its own cache, pool shard and tier namespace, and sglang
keeps the ranks in lockstep by taking identical decisions from identical inputs. A spill, a restore
or a warm start also depends on each rank's own I/O (a write refused, a read not landed, a checksum
failing on one rank's file): such a local outcome changes the tree, the pool or admission only
through an agreement, the MIN of every rank's verdict, so one rank's fault makes all ranks take the
conservative path (drop, defer, recompute) and none waits for another.

Contract (`Agreement`): `min` is a collective. Every rank must call it the same number of times,
in the same order, with vectors of the same length: callers do so only at points every rank reaches
identically (the tree, pool and request sequence are identical across ranks, because every earlier
decision was agreed). It blocks until all ranks have called it; it is the only blocking call the
cache makes on the scheduler thread with TP > 1, one per decision point (an `evict`, a restore's
readiness, a restore's verdict), with a vector of a few integers.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence
from typing import Any


class Agreement(abc.ABC):
    """The MIN of integer vectors across the tensor-parallel group (see the module docstring)."""

    size: int = 1
    calls: int = 0
    seconds: float = 0.0

    @abc.abstractmethod
    def _reduce(self, values: list[int]) -> list[int]:
        """The element-wise MIN of `values` over all ranks (a collective)."""

    def min(self, values: Sequence[int]) -> list[int]:
        if not values:
            return []
        t0 = time.perf_counter()
        out = self._reduce([int(v) for v in values])
        self.calls += 1
        self.seconds += time.perf_counter() - t0
        return out

    def all_ok(self, ok: bool) -> bool:
        """Whether every rank says yes."""
        return bool(self.min([int(ok)])[0])


class SingleRank(Agreement):
    """TP = 1: every verdict is already agreed; no collective."""

    def _reduce(self, values: list[int]) -> list[int]:
        return values


class GroupAgreement(Agreement):
    """A gloo (CPU) process group of the TP ranks: sglang's `tp_cache_group`."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self._group = group
        self.size = dist.get_world_size(group)

    def _reduce(self, values: list[int]) -> list[int]:
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._group)
        return [int(v) for v in t.tolist()]


def for_group(group: Any, tp_size: int) -> Agreement:
    """`GroupAgreement` on `group` when there are several ranks, else `SingleRank`."""
    if tp_size <= 1 or group is None:
        return SingleRank()
    return GroupAgreement(group)
