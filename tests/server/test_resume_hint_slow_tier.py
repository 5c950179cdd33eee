"""With a slow tier, a conversation hinted ahead resumes faster than one that was not, with the same output.

The tier is wrapped in a FaultyTier adding 1.5 s to every operation (SGL_HICACHE_TEST_FAULTS); the
comparison is between two requests of one run, and the injected gap dwarfs any noise.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import post_json
from tests.server.test_spill_resume import POOL, counter, generate, push_out, two_turns

pytestmark = pytest.mark.server
LATENCY_S = 1.5


def timed(base: str, ids: list[int]) -> tuple[float, list[int], int]:
    t0 = time.perf_counter()
    out, cached = generate(base, ids, n=8)
    return time.perf_counter() - t0, out, cached


def test_hinted_resume_beats_unhinted_on_a_slow_tier(
    tiny_model: Path, tmp_path: Path, start_server: Any
) -> None:
    server = start_server(tiny_model, "--enable-hicache-spill", "--hicache-spill-dir", str(tmp_path / "tier"),
                          "--hicache-spill-min-free", "0", "--hicache-spill-prefetch-policy", "wait",
                          max_total_tokens=POOL, env={"SGL_HICACHE_TEST_FAULTS": f'{{"latency_s": {LATENCY_S}}}'})  # fmt: skip
    base = server.base_url
    hinted2, hinted_ref, history = two_turns(base, 201)
    plain2, plain_ref, _ = two_turns(base, 301)
    push_out(base, 201)
    time.sleep(LATENCY_S + 1)  # the (slow) spill writes are published
    # The whole next prompt: in this test the reference run already put the new turn's tokens in the
    # tree (and so on the tier); a real client hints the conversation so far.
    post_json(base + "/hicache/prefetch", {"input_ids": hinted2})
    time.sleep(LATENCY_S + 1)  # ... the user is typing ...
    t_hinted, out_hinted, cached_hinted = timed(base, hinted2)
    t_plain, out_plain, cached_plain = timed(base, plain2)
    assert cached_hinted >= history and cached_plain >= history, (cached_hinted, cached_plain)
    assert out_hinted == hinted_ref and out_plain == plain_ref
    assert t_plain - t_hinted > LATENCY_S / 2, f"hinted {t_hinted:.2f}s vs unhinted {t_plain:.2f}s"
    assert counter(base, "restore_deferrals") > 0  # the unhinted one waited, without blocking the loop
