"""Retracting the requests whose forward read a failed layer-wise restore (hooks 13-15).

A layer-wise restore (cache/layerwise.py) lets a prefill start before the restore's later layer
groups landed. When one of them cannot land (miss, corrupt, I/O error, timeout), the forward has
already run on KV that is restored in some layers only: its output for the requests reading those
slots must never be answered, and the KV it computed for their new tokens must never be cached.
sglang retracts decode requests when memory runs out (`release_req`: release the KV without caching
it, `Req.reset_for_retract`, back to the waiting queue); we do the same to a prefill, at three
points of the scheduler loop, so that both loops (normal and overlap) stay right:

- after `run_batch` (13): the cache ends the forward's layer-wise restores and names the requests
  that read a failed one (agreed across TP ranks); each is released without caching its KV, reset
  for retraction (`is_retracted`: sglang's result processing then commits nothing of it), and
  taken off the scheduler's chunked-prefill slot; the failed nodes are dropped once unlocked;
- before `get_next_batch_to_run` (14): those requests leave the last batch before sglang merges it
  into the running batch (under the overlap scheduler that merge comes before the batch's result is
  processed);
- after `process_batch_result` (15): once that batch's result was processed (without them), they
  go back to the waiting queue and recompute (not earlier: under the overlap scheduler a request
  re-admitted before then would have its old forward's output committed).

A request that cannot be retracted (an error of ours) is finished with an abort instead
(`discard_output_reason`, sglang's own "failed KV load"): an error to its client, never a wrong
answer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

ATTR = "_sgl_hicache_retractions"


@dataclass
class Retractions:
    """Per scheduler: requests retracted, still to leave the last batch, and still to re-queue."""

    unmerged: list[Any] = field(default_factory=list)
    unqueued: list[Any] = field(default_factory=list)
    count: int = 0


def of(scheduler: Any) -> Retractions:
    found = getattr(scheduler, ATTR, None)
    if found is None:
        found = Retractions()
        setattr(scheduler, ATTR, found)
    return found


def retract(scheduler: Any, reqs: list[Any]) -> None:
    """Release each request's KV without caching it and reset it for a recompute (13)."""
    from sglang.srt.mem_cache.common import release_kv_cache

    state = of(scheduler)
    for req in reqs:
        try:
            release_kv_cache(req, scheduler.tree_cache, checkpoint=False)
            req.reset_for_retract()
        except Exception:
            logger.exception("sgl_hicache: could not retract request %s after a failed layer-wise restore; "
                             "it is aborted instead", getattr(req, "rid", "?"))  # fmt: skip
            abort_instead(req)
            continue
        if getattr(scheduler, "chunked_req", None) is req:
            scheduler.chunked_req = None
        state.unmerged.append(req)
        state.unqueued.append(req)
        state.count += 1


def abort_instead(req: Any) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    req.discard_output_reason = FINISH_ABORT(
        "sgl_hicache: a layer-wise restore of this request's prefix failed; retry the request"
    )


def leave_last_batch(scheduler: Any) -> None:
    """The retracted requests leave the batch sglang is about to merge into the running one (14)."""
    state = of(scheduler)
    if not state.unmerged:
        return
    last = getattr(scheduler, "last_batch", None)
    if last is not None:
        gone = [req for req in state.unmerged if any(req is r for r in last.reqs)]
        if gone:
            last.filter_batch(reqs_to_exclude=gone)
    state.unmerged = []


def requeue(scheduler: Any, batch: Any) -> None:
    """The retracted requests of `batch`, whose result was just processed, go back to the queue (15)."""
    state = of(scheduler)
    if not state.unqueued or batch is None:
        return
    mine = [req for req in state.unqueued if any(req is r for r in batch.reqs)]
    state.unqueued = [req for req in state.unqueued if not any(req is m for m in mine)]
    for req in mine:
        scheduler._add_request_to_queue(req, is_retracted=True)
