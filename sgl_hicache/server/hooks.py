"""The patches of sglang we make, all through sglang's own plugin hook registry (no file edited),
AFTER hooks (but 3b, 5, 6, 7, 8, 10 and 16) that call sglang's original first and change none of its
state (but 3a, which adds our hints to the list it returns, 6, and 16, which refuses a prompt sglang
would queue forever).

None is registered in a process whose server did not select our backend: there `plugin.py`
registers only its check hooks. In a scheduler that selected it, plugin.py's check hook on
`Scheduler.__init__` calls `register_scheduler_hooks` (1-3, 6-10) before the Scheduler is built; in
the HTTP process of such a server, its check hook on `set_global_state` calls `add_routes` (4); our
launcher, the process that makes the hint socket's runtime directory and runs sglang's HTTP server,
calls `register_exit_hook` (5 and 12).

1. `SchedulerInternalStateController.get_internal_state` (sglang 0.5.23,
   `sglang/srt/managers/scheduler_components/internal_state.py`): adds a `"hicache_spill"` entry
   (counters, staging, tier stats, an integrity verdict) to the scheduler's internal state. Why: it
   is the only read-back channel from the scheduler process to HTTP (`GET /server_info` →
   `internal_states`) that sglang offers without new request types.
2. `Scheduler._prefetch_kvcache` (`sglang/srt/managers/scheduler.py`), which sglang calls for every
   request as it enters the waiting queue (its own storage prefetch, a no-op unless HiCache storage
   is on): starts reading the request's spilled prefix from the tier, so the I/O overlaps the
   request's queueing and other requests' compute. Why: it is sglang's arrival point for exactly this.
3. Client resume hints (`hints.py`) reach every TP rank in the same iteration by riding sglang's
   own request broadcast, as sglang's timeout aborts do (`ingest_requests` passes them to
   `recv_requests(local_reqs=...)`, which appends them to what TP rank 0 broadcasts):
   a. `Scheduler._poll_timeout_aborts`, AFTER, which sglang calls once per iteration on the rank
      that receives requests (TP rank 0, where our hint inbox is): appends the waiting hints, checked
      and answered, to the aborts it returns.
   b. `Scheduler.process_input_requests`, BEFORE, on every rank: takes our hints out of the
      received list (in place, first, so sglang's dispatcher never sees one) and prefetches each.
   Why: hints must run on the scheduler thread of every rank, and sglang's broadcast is the one
   channel that keeps ranks in step at no extra collective; no public input-source API.
4. `http_server.set_global_state` (the HTTP process, once at start), through plugin.py's check
   hook: afterwards, adds `POST /hicache/prefetch` and the retention hints `/hicache/pin`, `/drop`,
   `/purge` to sglang's FastAPI app (`http_routes.py`), which travel as resume hints do (3).
5. `sglang.srt.utils.common.kill_process_tree`, BEFORE, in our launcher's process only: when sglang
   is about to kill its own main process (every shutdown path of 0.5.23 ends with SIGKILL to itself,
   so no `finally` of our launcher runs), first removes the hint socket's private runtime directory
   if this process made it (`hints.remove_runtime_dir`). Why: otherwise every server start leaves
   one in the temp directory.
6. `PrefillAdder.add_one_req` (`sglang/srt/managers/schedule_policy.py`), AROUND: when our
   `init_load_back` deferred the request (its reads are in flight) sglang answers `OTHER`, and its
   admission loop then stops, holding back every request queued behind the deferred one; we turn
   exactly that answer into `CONTINUE` (skip this request for this round, as sglang does for its
   own storage prefetches that are not done). Nothing was admitted or allocated for it. The cache
   says whether it deferred this very attempt as the return value of `end_admission`, around it.
7. `Scheduler.release_host_resources`, BEFORE: sglang calls it in the scheduler process when a
   `ShutdownReq` ended the loop (graceful shutdown: SIGTERM to the main process); first we close
   the tier, bounded (`shutdown.close_tier`), then freeze the garbage collector's heap
   (`gc.freeze`): the process is about to exit, and the interpreter's final collection over
   sglang's heap took seconds (4-8 s on a loaded 2-core machine), which the main process waits for
   before it exits (a SIGINT, which kills the scheduler, does not). Why: the one shutdown callback
   sglang gives a scheduler; without it the process ends with stores in flight and their temp
   files left.
8. `Scheduler.run_event_loop`, BEFORE: in the scheduler process's main thread, installs SIGTERM and
   SIGINT handlers that close the tier, then act as the handlers they replace
   (`shutdown.close_on_signals`). Why: a signal to the whole process group reaches the scheduler
   itself, which has no handler and dies at once (see shutdown.py). It also hands the cache the
   stream sglang's forward runs on (`Scheduler.forward_stream` with `Scheduler.enable_overlap`, else
   `Scheduler.schedule_stream`), which every pack and unpack of ours is ordered against
   (cache/device.py); both exist once the Scheduler is built, and the current stream is always
   fenced too.
9. `SchedulerWeightUpdaterManager.record_weight_version_after_update`, AFTER: sglang calls it on
   every rank after every successful weight update (disk, tensor, distributed, ...), flushed or
   not; we start a new key epoch (`SpillRadixCache.start_epoch`), so KV computed with the new
   weights is never named like KV of the weights on disk (a restart, or another server sharing the
   directory, would take one for the other). Why: a weight update without `flush_cache` (or whose
   flush sglang refused) does not reset the cache.
10. `PrefillAdder.add_one_req`, the same AROUND hook: a request whose cross-server lookup is still
   running (cache/lookups.py) is answered `CONTINUE` without calling sglang's admission (skipped for
   this round, like 6), within the cache's limit; its lookup then attaches before its next match.
11. `Scheduler.on_idle`, AFTER: sglang calls it when it has nothing to schedule; our cache is then
   called by nothing else, so it takes its finished I/O and copies here (`SpillRadixCache.poll`): on
   a GPU a write is submitted only once its pack's copy is done, which an idle server would
   otherwise leave waiting in staging; and, when no request runs or waits
   (`Scheduler.is_fully_idle`), it writes the next victims of eviction ahead there (`clean_ahead`),
   so that the eviction a later request needs copies nothing.
12. `TokenizerManager.sigterm_watchdog` (`sglang/srt/managers/tokenizer_manager.py`), AROUND, in
   our launcher's process only: sglang's SIGTERM handler sets `gracefully_exit`, which that watchdog
   coroutine polls every 5 s before it drains the requests and sends each scheduler a ShutdownReq;
   ours polls it every `SIGTERM_POLL_S` first, then runs sglang's, which finds it set and drains at
   once. Why: SIGTERM to an idle server took up to 5 s longer than SIGINT to begin; sglang offers
   no event to wait on.
13. `Scheduler.run_batch`, AFTER: the forward has run (been launched, on a GPU); the cache ends the
   layer-wise restores it read (`SpillRadixCache.after_forward`: waits for their last groups) and
   names the requests that read a failed one, which are retracted (`retract.py`: their KV released
   without caching it, `reset_for_retract`), and the failed nodes are dropped. Why: a late group
   that fails after the prefill started must not end in an answer from a mix of restored and
   missing KV; sglang's own retraction is for decode, and a forward cannot be stopped midway.
14. `Scheduler.get_next_batch_to_run`, BEFORE: a scheduling round starts, so the admission holds of
   the round share a whole budget again (`SpillRadixCache.new_round`, cache/admission_hold.py); the
   retracted requests leave the last batch before sglang merges it into the running batch
   (retract.py). sglang's pipeline-parallel loop (`event_loop_pp`) calls it too, though our backend
   refuses `--pp-size` > 1 (cache/identity.py, `UNISOLATED`).
15. `Scheduler.process_batch_result`, AFTER: once their batch's result was processed (committing
   nothing of them: `is_retracted`), the retracted requests go back to the waiting queue.
16. `BaseTokenToKVPoolAllocator.max_new_tokens_for_memory` (`sglang/srt/mem_cache/allocator/base.py`),
   AROUND: sglang clips a request's `max_new_tokens` there when it arrives; a prompt that its
   prefill admission could never admit, on any pool state, is answered None, so sglang answers it
   with its own error ("Request prompt exceeds the KV memory budget") at once. Why: the base clip
   answers 0 for it, and such a request then blocks sglang's admission loop, and every request
   queued behind it, forever (`prompt_fit.py`). The SWA allocators' own clip already answers None.
`tests/server/test_concurrent_clients.py`, `tests/server/test_spill_resume.py`,
`tests/server/test_hostile_hints.py` and `tests/server/test_shutdown.py` prove they still hold for
the pinned version.

No exception of ours reaches sglang's code: an exception leaving an AFTER hook on the scheduler
loop would end the scheduler process, and with it the server. Every hook body is `contained`: an
exception is counted (`HOOK_ERRORS`, in the spill state as `hook_errors`), logged with its traceback
the first time per hook, and sglang goes on as if the hook had done nothing.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state"
PREFETCH_TARGET = "sglang.srt.managers.scheduler.Scheduler._prefetch_kvcache"
HINTS_OUT_TARGET = "sglang.srt.managers.scheduler.Scheduler._poll_timeout_aborts"
HINTS_IN_TARGET = "sglang.srt.managers.scheduler.Scheduler.process_input_requests"
EXIT_TARGET = "sglang.srt.utils.common.kill_process_tree"
ADMIT_TARGET = "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req"
RELEASE_TARGET = "sglang.srt.managers.scheduler.Scheduler.release_host_resources"
LOOP_TARGET = "sglang.srt.managers.scheduler.Scheduler.run_event_loop"
SIGTERM_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager.sigterm_watchdog"
SIGTERM_POLL_S = 0.1
IDLE_TARGET = "sglang.srt.managers.scheduler.Scheduler.on_idle"
RUN_BATCH_TARGET = "sglang.srt.managers.scheduler.Scheduler.run_batch"
NEXT_BATCH_TARGET = "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run"
RESULT_TARGET = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"
FIT_TARGET = "sglang.srt.mem_cache.allocator.BaseTokenToKVPoolAllocator.max_new_tokens_for_memory"
WEIGHTS_TARGET = (
    "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
    ".record_weight_version_after_update"
)
# Every target `register_scheduler_hooks` patches, one entry per registration in its order
# (ADMIT_TARGET once: hooks 6 and 10 are one); `sglang_seam.SEAM` checks each, and EXIT_TARGET.
TARGETS = (TARGET, PREFETCH_TARGET, HINTS_OUT_TARGET, HINTS_IN_TARGET, ADMIT_TARGET, RELEASE_TARGET, LOOP_TARGET,
           WEIGHTS_TARGET, IDLE_TARGET, RUN_BATCH_TARGET, NEXT_BATCH_TARGET, RESULT_TARGET, FIT_TARGET)  # fmt: skip
STATE_KEY = "hicache_spill"

HOOK_ERRORS: Counter[str] = Counter()  # hook name -> exceptions it contained, in this process
_LOGGED: set[str] = set()  # hooks whose first exception was logged


def contained(hook: Callable[..., Any]) -> Callable[..., Any]:
    """`hook` that never raises an Exception: it counts and logs it (once per hook) and returns
    None, which tells sglang's hook wrapper to go on unchanged (AFTER: its result; BEFORE: its args)."""

    @functools.wraps(hook)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return hook(*args, **kwargs)
        except Exception:
            HOOK_ERRORS[hook.__name__] += 1
            if hook.__name__ not in _LOGGED:
                _LOGGED.add(hook.__name__)
                logger.exception(
                    "sgl_hicache: hook %s failed; sglang goes on (logged once, counted)", hook.__name__
                )
            return None

    return run


@contained
def add_spill_state(result: Any, controller: Any, *args: Any, **kwargs: Any) -> Any:
    from sgl_hicache.cache.spill_radix_cache import SpillRadixCache

    cache = controller.scheduler.tree_cache
    if isinstance(cache, SpillRadixCache) and isinstance(result.internal_state, dict):
        state = cache.report(idle=controller.scheduler.is_fully_idle())
        result.internal_state[STATE_KEY] = {**state, "hook_errors": dict(HOOK_ERRORS)}
    return result


@contained
def prefetch_at_arrival(result: Any, scheduler: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    if (cache := _our_cache(scheduler)) is not None:
        cache.prefetch(req.origin_input_ids, req.extra_key, req.cache_salt, rid=req.rid)
    return result


@contained
def send_hints(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    cache = _our_cache(scheduler)
    if cache is not None and isinstance(result, list) and cache.hints is not None:
        return [*result, *cache.take_hints()]
    return result


@contained
def apply_hints(scheduler: Any, recv_reqs: Any = None, *args: Any, **kwargs: Any) -> None:
    from sgl_hicache.cache.hint_source import ResumeHint, RetentionHint
    from sgl_hicache.cache.spill_radix_cache import SpillRadixCache

    ours = (ResumeHint, RetentionHint)
    if not isinstance(recv_reqs, list) or not any(isinstance(r, ours) for r in recv_reqs):
        return
    hints = [r for r in recv_reqs if isinstance(r, ours)]
    recv_reqs[:] = [r for r in recv_reqs if not isinstance(r, ours)]  # before anything can fail
    cache = scheduler.tree_cache
    if isinstance(cache, SpillRadixCache):
        for hint in hints:  # one at a time: a failed hint never skips the walks of those after it
            if isinstance(hint, RetentionHint):
                retention_hint(cache, hint)
            else:
                prefetch_hint(cache, hint)


@contained
def prefetch_hint(cache: Any, hint: Any) -> None:
    cache.prefetch(*hint, hinted=True)


@contained
def retention_hint(cache: Any, hint: Any) -> None:
    """A pin, drop or purge (cache/retention.py), on every rank in the same iteration."""
    cache.retention.apply(hint)


@contained
def add_routes(result: Any, *args: Any, **kwargs: Any) -> Any:
    from sglang.srt.entrypoints.http_server import app

    from sgl_hicache.server.http_routes import add_prefetch_route

    add_prefetch_route(app)
    return result


def admit(original: Any, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND `add_one_req` (6 and 10): a request whose cross-server lookup is still running is
    skipped for this round without calling sglang's admission; otherwise sglang admits it, and when
    our `init_load_back` deferred it (the cache says so at the attempt's end), sglang's `OTHER` (stop
    admitting) becomes `CONTINUE` (skip this one). sglang's own exceptions pass through unchanged."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    attempt = begin_admission(adder, req)  # contained: None (admit as sglang would) on an error of ours
    if attempt is WAIT_FOR_LOOKUP:
        return AddReqResult.CONTINUE
    try:
        result = original(adder, req, *args, **kwargs)
    finally:
        deferred = attempt is not None and end_admission(adder, attempt)
    return AddReqResult.CONTINUE if result is AddReqResult.OTHER and deferred else result


WAIT_FOR_LOOKUP = object()


@contained
def begin_admission(adder: Any, req: Any) -> Any:
    """WAIT_FOR_LOOKUP, our cache's record of this admission attempt, or None (not our cache)."""
    from sgl_hicache.cache.spill_radix_cache import SpillRadixCache

    cache = adder.tree_cache
    if not isinstance(cache, SpillRadixCache):
        return None
    if cache.lookup_waiting(req.rid):
        return WAIT_FOR_LOOKUP
    return cache.begin_admission(req.rid)


@contained
def end_admission(adder: Any, attempt: Any) -> bool:
    return bool(adder.tree_cache.end_admission(attempt))


@contained
def remove_runtime_dir_first(parent_pid: int | None = None, include_parent: bool = True, *args: Any,
                             **kwargs: Any) -> None:  # fmt: skip
    from sgl_hicache.server.hints import remove_runtime_dir

    if include_parent and parent_pid == os.getpid():
        remove_runtime_dir()


@contained
def close_tier_first(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    from sgl_hicache.server.shutdown import close_tier

    io = _spill_io(scheduler)
    if io is not None:
        close_tier(io, "shutdown request")
    gc.freeze()  # the process exits next: its final collection would walk the whole heap (seconds)


@contained
def at_loop_start(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """Hook 8: the tier closes on SIGTERM/SIGINT, and our copies are ordered against sglang's
    forward streams (the model runner's, under the overlap scheduler; the scheduler's own)."""
    from sgl_hicache.server.shutdown import close_on_signals

    if (cache := _our_cache(scheduler)) is None:
        return
    overlap = bool(getattr(scheduler, "enable_overlap", False))
    cache.set_forward_streams([getattr(scheduler, "forward_stream" if overlap else "schedule_stream", None)])
    if cache.io_to_close is not None:
        close_on_signals(cache.io_to_close)


@contained
def poll_when_idle(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """Hook 11: with nothing to schedule, sglang calls no cache method, so the finished writes,
    reads and copies are taken here (a write whose pack finished is submitted only by a poll); and
    only when no request runs or waits (sglang also calls it while a deferred restore waits for its
    reads), the next victims of eviction are written ahead."""
    cache = _our_cache(scheduler)
    if cache is not None:
        cache.poll()
        if scheduler.is_fully_idle():
            cache.clean_ahead()
    return result


def _spill_io(scheduler: Any) -> Any:
    cache = _our_cache(scheduler)
    return cache.io_to_close if cache is not None else None  # spill disabled too


@contained
def new_epoch_after_weight_update(result: Any, updater: Any, *args: Any, **kwargs: Any) -> Any:
    if (cache := _our_cache(updater.scheduler)) is not None:
        cache.start_epoch()
    return result


def _our_cache(scheduler: Any) -> Any:
    """The scheduler's cache if it is ours, else None."""
    from sgl_hicache.cache.spill_radix_cache import SpillRadixCache

    cache = getattr(scheduler, "tree_cache", None)
    return cache if isinstance(cache, SpillRadixCache) else None


def _layerwise_cache(scheduler: Any) -> Any:
    cache = _our_cache(scheduler)
    return cache if cache is not None and cache.layerwise is not None else None


@contained
def after_forward(result: Any, scheduler: Any, batch: Any = None, *args: Any, **kwargs: Any) -> Any:
    """Hook 13: end the forward's layer-wise restores; retract the requests that read a failed one."""
    from sgl_hicache.server import retract

    cache = _layerwise_cache(scheduler)
    if cache is None:
        return result
    affected = cache.after_forward(list(getattr(batch, "reqs", None) or []))
    if affected:
        retract.retract(scheduler, affected)
    cache.drop_failed_layerwise()
    return result


@contained
def before_next_batch(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """Hook 14: a scheduling round starts (admission holds' budget is whole again, cache/
    admission_hold.py); retracted requests are not merged into the running batch."""
    from sgl_hicache.server import retract

    if (cache := _our_cache(scheduler)) is not None:
        cache.new_round()
    if _layerwise_cache(scheduler) is not None:
        retract.leave_last_batch(scheduler)


@contained
def requeue_retracted(result: Any, scheduler: Any, batch: Any = None, *args: Any, **kwargs: Any) -> Any:
    """Hook 15: retracted requests go back to the waiting queue once their batch's result was processed."""
    from sgl_hicache.server import retract

    if _layerwise_cache(scheduler) is not None:
        retract.requeue(scheduler, batch)
    return result


def fit_prompt(original: Any, allocator: Any, input_tokens: int, max_new_tokens: int, *args: Any,
               **kwargs: Any) -> int | None:  # fmt: skip
    """Hook 16, AROUND sglang's clip of `max_new_tokens`: None (refused at arrival) for a prompt its
    prefill admission could never admit, else sglang's clip, never above what admission can admit
    (`prompt_fit.prefill_room`). sglang's own exceptions pass through unchanged."""
    clipped = original(allocator, input_tokens, max_new_tokens, *args, **kwargs)
    room = admission_room(allocator, input_tokens, kwargs.get("token_capacity"))
    if clipped is None or room is None:  # refused by sglang already; or an error of ours: sglang's answer
        return clipped
    return min(clipped, room) if room >= 0 else None


@contained
def admission_room(allocator: Any, input_tokens: int, token_capacity: Any) -> int:
    from sgl_hicache.server.prompt_fit import prefill_room

    return prefill_room(input_tokens, int(allocator.page_size), int(token_capacity))


def register_scheduler_hooks() -> None:
    """Hooks 1-3, 6-11 and 13-16, applied at once: in a scheduler process that selected our backend, before
    its Scheduler is built (plugin.py; sglang's `load_plugins` has applied hooks already)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, add_spill_state, HookType.AFTER)
    HookRegistry.register(PREFETCH_TARGET, prefetch_at_arrival, HookType.AFTER)
    HookRegistry.register(HINTS_OUT_TARGET, send_hints, HookType.AFTER)
    HookRegistry.register(HINTS_IN_TARGET, apply_hints, HookType.BEFORE)
    HookRegistry.register(ADMIT_TARGET, admit, HookType.AROUND)
    HookRegistry.register(RELEASE_TARGET, close_tier_first, HookType.BEFORE)
    HookRegistry.register(LOOP_TARGET, at_loop_start, HookType.BEFORE)
    HookRegistry.register(WEIGHTS_TARGET, new_epoch_after_weight_update, HookType.AFTER)
    HookRegistry.register(IDLE_TARGET, poll_when_idle, HookType.AFTER)
    HookRegistry.register(RUN_BATCH_TARGET, after_forward, HookType.AFTER)
    HookRegistry.register(NEXT_BATCH_TARGET, before_next_batch, HookType.BEFORE)
    HookRegistry.register(RESULT_TARGET, requeue_retracted, HookType.AFTER)
    HookRegistry.register(FIT_TARGET, fit_prompt, HookType.AROUND)
    HookRegistry.apply_hooks()  # patches only targets not patched yet


async def drain_at_sigterm(original: Callable[..., Any], manager: Any, *args: Any, **kwargs: Any) -> Any:
    """Hook 12: wait for sglang's SIGTERM flag in steps of `SIGTERM_POLL_S`, then run its watchdog."""
    while not manager.gracefully_exit:
        await asyncio.sleep(SIGTERM_POLL_S)
    return await original(manager, *args, **kwargs)


def register_exit_hook() -> None:
    """Hooks 5 and 12, applied at once: in our launcher's process, which made the runtime directory
    and runs sglang's tokenizer manager. `hints` is imported here, so hook 5's own import (in a
    signal handler, when a child failed) finds it whole: an import it began itself could be
    interrupted there by a second such signal, whose handler would then find the module
    half-imported (ImportError, issue 24)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sgl_hicache.server import hints  # noqa: F401

    HookRegistry.register(EXIT_TARGET, remove_runtime_dir_first, HookType.BEFORE)
    HookRegistry.register(SIGTERM_TARGET, drain_at_sigterm, HookType.AROUND)
    HookRegistry.apply_hooks()
