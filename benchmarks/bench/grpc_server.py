"""A server in sglang's gRPC mode (`--grpc-mode`, the worker smg's event-driven `cache_aware` routes to).

`port` serves gRPC (the router's worker URL, direct requests), `sidecar_port` sglang's HTTP sidecar
(`/metrics` only: no HTTP API, so none of our `/hicache/*` routes either), `events_port` the ZMQ
publisher of KV events that smg's servicer relays to the router. The sidecar's Prometheus names
carry `sglang_` where an HTTP server's carry `sglang:` (`metrics`). See docs/OPERATIONS.md,
"Tier-aware routing".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time

from benchmarks.bench.probe import scrape
from benchmarks.bench.server_process import ServerProcess, ServerStartError, free_port


@dataclasses.dataclass
class GrpcServer(ServerProcess):
    """`start()` waits for gRPC health (`ready`) unless `wait_on_start` is False: then it returns
    once spawned, so that several servers boot side by side, and the caller calls `ready()`."""

    sidecar_port: int = dataclasses.field(default_factory=free_port)
    events_port: int = dataclasses.field(default_factory=free_port)
    wait_on_start: bool = True

    @property
    def grpc_url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """The HTTP sidecar (`/metrics` only)."""
        return f"http://127.0.0.1:{self.sidecar_port}"

    def command(self) -> list[str]:
        """`--grpc-port`: unused in this mode, but derived as `--port` + 10000 if not given, and
        refused above 65535 (a free port may be above 55535)."""
        events = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{self.events_port}", "bind": True}
        return [*super().command(), "--grpc-mode", "--grpc-port", str(self.port), "--smg-http-sidecar-port",
                str(self.sidecar_port), "--kv-events-config", json.dumps(events)]  # fmt: skip

    def _wait_healthy(self, timeout_s: float) -> None:
        if self.wait_on_start:
            self.ready(timeout_s)

    def ready(self, timeout_s: float = 300.0) -> GrpcServer:
        """Once the server answers gRPC health checks as SERVING; ServerStartError if it exits or
        does not within `timeout_s`."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise ServerStartError(
                        f"server exited with code {self.proc.returncode}{self._log_tail()}"
                    )
                with contextlib.suppress(grpc.RpcError):
                    reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return self
                time.sleep(0.5)
        raise ServerStartError(f"server not healthy after {timeout_s:.0f}s{self._log_tail()}")

    def metrics(self) -> dict[str, float]:
        """The sidecar's `/metrics` under an HTTP server's names (`sglang_x` read as `sglang:x`)."""
        return {_colon(k): v for k, v in scrape(self.base_url).items()}


def _colon(name: str) -> str:
    return "sglang:" + name.removeprefix("sglang_") if name.startswith("sglang_") else name
