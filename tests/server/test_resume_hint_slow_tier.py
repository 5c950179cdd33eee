"""On a slow tier: a conversation hinted ahead resumes faster than one that was not, with the same
output; and a resumed request whose reads are in flight holds back no request queued behind it.

The tier is wrapped in a FaultyTier adding LATENCY_S to every operation (SGL_HICACHE_TEST_FAULTS);
the comparisons are between requests of one run, and the injected gap dwarfs any noise. One server
serves both tests.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from benchmarks.bench.server_process import ServerProcess
from tests.server.conftest import SPILL_FLAGS, post_json
from tests.server.test_spill_resume import POOL, counter, generate, push_out, tokens, two_turns

pytestmark = pytest.mark.server
LATENCY_S = 2.5


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("slow_tier")
    args = (*SPILL_FLAGS, "--enable-hicache-spill", "--hicache-spill-dir", str(tmp / "tier"),
            "--hicache-spill-min-free", "0", "--hicache-spill-prefetch-policy", "wait")  # fmt: skip
    env = {"SGL_HICACHE_TEST_FAULTS": f'{{"latency_s": {LATENCY_S}}}'}
    with ServerProcess(tiny_model, POOL, args, log_path=tmp / "server.log", env=env) as s:
        yield s


def timed(base: str, ids: list[int]) -> tuple[float, list[int], int]:
    t0 = time.perf_counter()
    out, cached = generate(base, ids, n=8)
    return time.perf_counter() - t0, out, cached


def test_hinted_resume_beats_unhinted_on_a_slow_tier(server: ServerProcess) -> None:
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


def test_a_deferred_restore_holds_back_no_request_queued_behind_it(server: ServerProcess) -> None:
    base = server.base_url
    resumed, reference, history = two_turns(base, 401)
    push_out(base, 401)
    time.sleep(LATENCY_S + 1)  # the spill writes are published: the resume must read the slow tier
    finished: dict[str, tuple[float, tuple[list[int], int]]] = {}

    def run(name: str, ids: list[int]) -> None:
        out = generate(base, ids)
        finished[name] = (time.perf_counter(), out)

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(run, "resumed", resumed)
        time.sleep(0.5)  # the resumed request is queued first, its admission deferred on its reads
        second = pool.submit(run, "fresh", tokens(402, 40))
        first.result(), second.result()
    assert finished["fresh"][0] < finished["resumed"][0], "the fresh request waited for the deferred restore"
    out, cached = finished["resumed"][1]
    assert cached >= history and out == reference
