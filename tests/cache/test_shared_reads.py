"""A read of an extent is shared by every restore that needs bytes of it (the halves of a split node,
a prefetch and its restore): it is given up only by the last restore in progress that needs it,
never by the first to finish or give up (issue 37 review, F2).

A restore "in progress" is one whose slots are taken and whose unpack is not done: open in the
controller's table (deferred, unpacking early) or handed to the tree layer-wise while its later
groups land. A request that never took slots needs no read kept for it: its next attempt starts one.
"""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace
from typing import Any

from tests.cache.conftest import LAYERS, expected_kv, read_kv
from tests.cache.test_layerwise_review import admit, forward

CHUNK = 4096
B = list(range(300, 500))  # one node, one extent of 200 tokens (two layer groups)
F = list(range(3000, 3064))  # a child of B: its own extent


def slow(s: Any, latency_s: float) -> Any:
    from sgl_hicache.tier.testing.injector import FaultSpec, FaultyTier

    tier = FaultyTier(s.cache.controller.tier, FaultSpec(latency_s=latency_s))
    s.cache.controller.tier = tier
    return tier


def attempt(s: Any, tokens: list[int], rid: str) -> Any:
    """One request's admission parameters, from its match now (as the scheduler builds them)."""
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    m = s.match(tokens)
    req = SimpleNamespace(last_node=m.last_device_node, rid=rid)
    return InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req)


def test_a_request_that_gives_up_its_restore_does_not_fail_a_layerwise_restore_of_the_same_read(
    make_stack: Any,
) -> None:
    """b is admitted layer-wise for B's first half (the node split at 100); c, wanting the second
    half from the same read, gives up waiting (its prefetch policy's limit: under best_effort at
    once, under timeout after `prefetch_timeout_s`), so its admission finishes its reads. That read
    is b's too, still landing its group 1: b must not fail with "read of extent failed"."""
    from sgl_hicache.config import PrefetchPolicy

    s = make_stack(size=1024, chunk_bytes=CHUNK, layerwise_restore=True)
    s.insert(B)
    s.evict_all()
    slow(s, 3.0)
    assert s.cache.prefetch(B, rid="c") == len(B)  # one read of the whole extent
    (loaded_b, node_b), req_b = admit(s, B[:100] + [7, 8], "b")
    assert loaded_b == 100
    (rb,) = s.cache.layerwise.active
    assert not rb.complete, "b's restore landed whole before c gave up: nothing to show"
    s.cache.spill_config = dataclasses.replace(
        s.cache.spill_config, prefetch_policy=PrefetchPolicy.BEST_EFFORT
    )
    loaded_c, _ = s.cache.init_load_back(attempt(s, B, "c"))
    assert loaded_c == 0, "c recomputes (its read had not landed)"
    seen = forward(s, s.cache.path_device_indices(node_b))
    assert s.cache.after_forward([req_b]) == [], f"b's restore failed: {rb.failed}"
    assert seen == [expected_kv(B[:100])] * LAYERS
    s.cache.dec_lock_ref(req_b.last_node)
    ctl, deadline = s.cache.controller, time.monotonic() + 30
    while ctl.reads.in_flight:  # b settled before the read's last bytes (c's half) landed
        s.cache.poll()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    s.cache.poll()
    assert ctl.staging.used_bytes == 0, "the read was kept after its last user"
    s.cache.check_integrity()


def test_a_layerwise_restore_in_progress_keeps_its_read_past_the_reads_ttl(make_stack: Any) -> None:
    """An unused read is released after `prefetch_ttl_s` (counted from its start); one a layer-wise
    restore is still landing from is in use, whatever its age: its restore ends within its forward."""
    s = make_stack(size=512, chunk_bytes=CHUNK, layerwise_restore=True)
    s.insert(B)
    s.evict_all()
    slow(s, 3.0)
    (loaded, node), req = admit(s, B, "r")
    (restore,) = s.cache.layerwise.active
    assert loaded == len(B) and not restore.done(1), "the restore landed whole: nothing to show"
    s.cache.controller.reads.ttl_s = 1e-3  # the read is older than its TTL now
    s.cache.poll()
    seen = forward(s, s.cache.path_device_indices(node))
    assert s.cache.after_forward([req]) == [], f"the restore failed: {restore.failed}"
    assert seen == [expected_kv(B)] * LAYERS
    assert s.metrics.totals["prefetch_abandoned"] == 0
    s.cache.dec_lock_ref(req.last_node)
    s.cache.check_integrity()


def test_a_completed_restore_leaves_the_read_another_open_restore_still_needs(make_stack: Any) -> None:
    """Without layer-wise restore. r3 (B then F) is deferred with its slots taken: F, read at once,
    is unpacked; B's extent is still being read. r2 wants B's first half only; when that read
    completes r2 completes, and the read must stay for r3 (it needs the second half of it): r3's
    next attempt then finds it, instead of reading the extent a second time."""
    s = make_stack(size=1024, chunk_bytes=CHUNK)
    s.insert(B)
    s.insert(B + F)
    s.evict_all()
    tier = slow(s, 1.5)
    assert s.cache.prefetch(B) == len(B)  # B's extent: one slow read
    p2 = attempt(s, B[:100] + [7, 8], "r2")  # splits B's node at 100 (both halves in one extent)
    p3 = attempt(s, B + F, "r3")
    assert (p2.host_hit_length, p3.host_hit_length) == (100, len(B + F))
    tier._spec = dataclasses.replace(tier._spec, latency_s=0.0)  # F's read, started by r3, is fast
    ctl = s.cache.controller
    deadline = time.monotonic() + 30
    while (progress := ctl.restores.get("r3")) is None or not progress.ref_done(2):
        assert s.cache.init_load_back(p3) is None, "r3 was admitted before B's read landed"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert not progress.ref_done(1), "B's extent landed whole in r3's slots: nothing to show"
    loaded2, last2 = s.load_back(s.match(B[:100] + [7, 8]), rid="r2")  # once B's read completed
    assert loaded2 == 100 and read_kv(s.pool, last2.value) == expected_kv(B[:100])
    loaded3, last3 = s.load_back(s.match(B + F), rid="r3")
    assert loaded3 == len(B[100:] + F)
    assert read_kv(s.pool, s.cache.path_device_indices(last3)) == expected_kv(B + F)
    totals = s.metrics.totals
    assert (totals["prefetch_issued"], totals["reads_on_demand"]) == (1, 1), "B's extent was read twice"
    assert totals["restore_failures"] == 0
    s.cache.check_integrity()
