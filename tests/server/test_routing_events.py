"""Tier-aware routing (issue 27): servers in sglang's gRPC mode behind smg's event-driven `cache_aware`.

Servers A and B (our launcher with `--grpc-mode`, small device pools, each its own tier, its KV events
on a loopback ZMQ port) announce spilled pages as CPU_PINNED (`--hicache-spill-kv-events-medium
cpu_pinned`), which smg 1.13 indexes as host blocks. A conversation's first turn goes through the
router and lands on a server X; X is made to spill it (unrelated prompts sent to X directly, over
gRPC: a gRPC-mode server has no HTTP API); its next turn, through the router, is an event hit on X,
which restores it and answers as it did while the history was resident. The control: server D with
the default `disk` medium, behind a router of its own, whose index never holds more blocks than
D's device pool, however much D spilled: smg leaves DISK blocks out, so the routing above is the
knob's doing. The servers boot side by side (one module-scoped fleet), each stopped by its
process group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from benchmarks.bench.grpc_server import GrpcServer
from benchmarks.bench.router_process import RouterProcess
from benchmarks.bench.server_process import ServerProcess
from tests.server.conftest import SPILL_FLAGS, eventually, post_json
from tests.server.test_spill_resume import POOL, PROMPT, tokens

pytestmark = pytest.mark.server

PAGE = 16  # the servers' page size, smg's --block-size
DEVICE_PAGES = POOL // PAGE  # the most blocks a server's device pool holds


@dataclasses.dataclass
class Fleet:
    model: str  # the model's name at the router
    a: GrpcServer
    b: GrpcServer
    router: RouterProcess  # cache_aware over A and B
    d: GrpcServer  # the control: the default disk medium
    d_router: RouterProcess


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("routing")

    def server(name: str, medium: str) -> GrpcServer:
        args = (*SPILL_FLAGS, "--page-size", str(PAGE), "--enable-hicache-spill",
                "--hicache-spill-dir", str(tmp / name / "tier"), "--hicache-spill-min-free", "0",
                "--hicache-spill-kv-events-medium", medium)  # fmt: skip
        return GrpcServer(tiny_model, POOL, args, log_path=tmp / f"{name}.log", wait_on_start=False)

    def router(name: str, *workers: GrpcServer) -> RouterProcess:
        # overload protection off: a pool full of cached prefixes must not veto the cache hit
        flags = ("--block-size", str(PAGE), "--model-path", str(tiny_model),
                 "--disable-worker-overload-protection")  # fmt: skip
        urls = [w.grpc_url for w in workers]
        return RouterProcess(urls, "cache_aware", log_path=tmp / f"{name}.log", extra_args=flags)

    servers = [server("a", "cpu_pinned"), server("b", "cpu_pinned"), server("d", "disk")]
    with contextlib.ExitStack() as stack:
        for s in servers:
            stack.enter_context(s)  # spawned now, its process group stopped at exit whatever happens
        a, b, d = (s.ready() for s in servers)
        routers = [stack.enter_context(router("router", a, b)), stack.enter_context(router("d-router", d))]
        stack.callback(stop_together, [*routers, *servers])  # first, then the (idempotent) stops above
        yield Fleet(str(tiny_model), a, b, routers[0], d, routers[1])


def stop_together(procs: Sequence[ServerProcess | RouterProcess]) -> None:
    """Stop every process group at once: a gRPC-mode server takes about 10 s to end after SIGTERM
    (sglang's own `--grpc-mode` alike)."""
    with ThreadPoolExecutor(len(procs)) as pool:
        list(pool.map(lambda p: p.stop(), procs))


def generate_direct(server: GrpcServer, ids: list[int], n: int = 8) -> tuple[list[int], int]:
    """A greedy generation sent to `server` itself, over gRPC: (output ids, cached tokens)."""
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
    from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

    request = pb.GenerateRequest(
        request_id=uuid.uuid4().hex, tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=n), stream=False,
    )  # fmt: skip
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        *_, last = pb_grpc.SglangSchedulerStub(channel).Generate(request, timeout=120)
    return list(last.complete.output_ids), last.complete.cached_tokens


def generate_routed(fleet: Fleet, router: RouterProcess, ids: list[int], n: int = 8) -> tuple[list[int], int]:
    """A greedy generation through `router` (smg answers /generate with a list): (output ids, cached
    tokens)."""
    sampling = {"max_new_tokens": n, "temperature": 0}
    body = {"model": fleet.model, "input_ids": ids, "sampling_params": sampling}
    reply: Any = post_json(router.base_url + "/generate", body)
    out = reply[0] if isinstance(reply, list) else reply
    return out["output_ids"], out["meta_info"]["cached_tokens"]


def push_out(server: GrpcServer, seed: int) -> None:
    """Serve enough unrelated prompts on `server` to evict everything else from its device pool."""
    for k in range(POOL // PROMPT + 2):
        generate_direct(server, tokens(10_000 + seed * 10 + k), n=1)


def series(url: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples of metric `name` at `url`: (labels, value) each."""
    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    found = re.finditer(rf"^{re.escape(name)}(?:{{(.*)}})? (\S+)$", text, re.MULTILINE)
    return [(dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or "")), float(m.group(2))) for m in found]


def counter(server: GrpcServer, name: str) -> float:
    """Our counter `name` on `server`'s sidecar (which writes `sglang:` as `sglang_`)."""
    return sum(v for _, v in series(server.base_url + "/metrics", f"sglang_hicache_spill_{name}_total"))


def per_worker(router: RouterProcess, name: str, **labels: str) -> dict[str, float]:
    """smg's metric `name` by worker URL (the samples carrying `labels`)."""
    samples = series(router.metrics_url, name)
    return {s["worker"]: v for s, v in samples if labels.items() <= s.items()}


def index_blocks(router: RouterProcess, server: GrpcServer) -> float:
    """The blocks smg's KV index holds for `server`."""
    return per_worker(router, "smg_kv_index_blocks").get(server.grpc_url, 0.0)


def removed_blocks(router: RouterProcess, server: GrpcServer) -> float:
    """The blocks `server` announced removed that smg took (from GPU, after each spill)."""
    return per_worker(router, "smg_kv_event_blocks_total", op="removed").get(server.grpc_url, 0.0)


def event_hits(router: RouterProcess) -> float:
    """The requests smg routed by a match in its KV index."""
    branches = series(router.metrics_url, "smg_cache_aware_policy_branch_total")
    return sum(v for labels, v in branches if labels["branch"] == "event_hit")


def test_a_resumed_turn_goes_to_the_server_holding_it_spilled(fleet: Fleet) -> None:
    router = fleet.router
    turn1 = tokens(1)
    out1, _ = generate_routed(fleet, router, turn1)
    routed = per_worker(router, "smg_worker_requests_total")
    (x,) = [s for s in (fleet.a, fleet.b) if routed.get(s.grpc_url, 0) == 1]
    y = fleet.b if x is fleet.a else fleet.a
    turn2 = turn1 + out1 + tokens(2, 20)
    reference, cached = generate_direct(x, turn2)  # turn 1 resident on X: never evicted
    assert cached >= len(turn1) - PAGE
    push_out(x, 1)  # X's pool overflows: the conversation is spilled to X's tier
    assert counter(x, "spilled_tokens") >= len(turn2) - PAGE
    assert eventually(lambda: index_blocks(router, x) > DEVICE_PAGES), (
        f"smg indexes {index_blocks(router, x)} blocks of X: no more than its device holds"
    )
    hits, restored = event_hits(router), counter(x, "restored_tokens")
    out, cached = generate_routed(fleet, router, turn2)
    assert out == reference
    routed = per_worker(router, "smg_worker_requests_total")
    assert (routed.get(x.grpc_url, 0), routed.get(y.grpc_url, 0)) == (2, 0)
    assert event_hits(router) == hits + 1  # routed by the KV index, not by load
    assert cached >= len(turn1) - PAGE and counter(x, "restored_tokens") - restored >= len(turn1) - PAGE
    assert counter(y, "restored_tokens") == 0


def test_with_the_disk_medium_smg_indexes_resident_blocks_only(fleet: Fleet) -> None:
    d, router = fleet.d, fleet.d_router
    generate_direct(d, tokens(3))
    push_out(d, 3)
    spilled_pages = counter(d, "spilled_tokens") // PAGE
    assert spilled_pages * PAGE >= PROMPT
    assert eventually(lambda: removed_blocks(router, d) >= spilled_pages), "smg did not take D's spills"
    assert index_blocks(router, d) <= DEVICE_PAGES  # the spilled pages' DISK stores are not indexed
