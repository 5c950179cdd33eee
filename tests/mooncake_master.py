"""A real Mooncake master on loopback for tests (`benchmarks.bench.mooncake_process`: free ports, its
own process group, stopped by it), and `skip_without_mooncake()`, which skips a test module where
the client cannot be imported (no libibverbs.so.1: scripts/setup_venv.sh says how)."""

from __future__ import annotations

import pytest

from benchmarks.bench.mooncake_process import MooncakeMaster
from benchmarks.bench.server_process import free_port


def skip_without_mooncake() -> None:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        pytest.skip(
            f"mooncake.store cannot be imported ({e}); run scripts/setup_venv.sh", allow_module_level=True
        )


__all__ = ["MooncakeMaster", "free_port", "skip_without_mooncake"]
