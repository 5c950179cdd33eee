"""The prefetch policy becomes time limits in one place (cache/restore_policy.py): one rule per
policy, and no other module of the cache reads the policy. How admission then defers, recomputes or
waits for a lookup under each limit: tests/cache/test_prefetch.py and test_cross_server.py."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest

from sgl_hicache.cache.restore_policy import RestorePolicy
from sgl_hicache.config import PrefetchPolicy, SpillConfig

CACHE = Path(__file__).resolve().parents[2] / "sgl_hicache" / "cache"


@pytest.mark.parametrize("prefetch_timeout_s", [0.05, 2.5, 30.0])
@pytest.mark.parametrize("policy", list(PrefetchPolicy))
def test_each_policy_is_one_set_of_limits(policy: PrefetchPolicy, prefetch_timeout_s: float) -> None:
    config = replace(SpillConfig(), prefetch_policy=policy, prefetch_timeout_s=prefetch_timeout_s,
                     admission_hold=0.3)  # fmt: skip
    io_timeout_s = max(prefetch_timeout_s, 10.0)  # the tier's I/O timeout (SpillConfig.io_timeout_s)
    want = {
        PrefetchPolicy.WAIT_COMPLETE: RestorePolicy(
            lookup_wait_s=prefetch_timeout_s, restore_wait_s=io_timeout_s, hold_share=0.3
        ),
        PrefetchPolicy.TIMEOUT: RestorePolicy(
            lookup_wait_s=prefetch_timeout_s, restore_wait_s=prefetch_timeout_s, hold_share=0.3
        ),
        PrefetchPolicy.BEST_EFFORT: RestorePolicy(lookup_wait_s=0.0, restore_wait_s=0.0, hold_share=0.0),
    }[policy]
    assert RestorePolicy.of(config) == want


def test_only_the_restore_policy_reads_the_prefetch_policy() -> None:
    readers = {
        path.name
        for path in CACHE.glob("*.py")
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Attribute) and node.attr in ("prefetch_policy", "prefetch_timeout_s")
    }
    assert readers == {"restore_policy.py"}, readers
