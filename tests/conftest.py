"""Fixtures shared by all test directories."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The generated `tiny` model (seed 0), made once per test session."""
    from sgl_hicache.modelgen import generate_model

    return generate_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)
