"""Fixtures shared by the benchmark tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A model directory holding only a config.json (SmolLM2-135M's KV shape: 23,040 B a token)."""
    m = tmp_path / "m"
    m.mkdir()
    m.joinpath("config.json").write_text(json.dumps(
        {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
         "hidden_size": 576, "vocab_size": 1000}))  # fmt: skip
    return m
