"""Servers of the tests and benchmarks skip sglang's model modules their model does not need."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.bench.model_modules import ENV, model_modules, registry_env


def _model(tmp_path: Path, config: object) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_llama_model_skips_every_module_but_llama(tmp_path: Path) -> None:
    skipped = registry_env(_model(tmp_path, {"architectures": ["LlamaForCausalLM"]}))[ENV].split(",")
    assert "llama" not in skipped and "registry" not in skipped
    assert {"qwen2", "deepseek_v2", "mixtral"} <= set(skipped)
    assert set(skipped) == set(model_modules()) - {"llama", "registry"}


def test_any_other_model_changes_nothing(tmp_path: Path) -> None:
    assert registry_env(_model(tmp_path, {"architectures": ["LlamaForCausalLM", "Qwen2ForCausalLM"]})) == {}
    assert registry_env(_model(tmp_path, {"model_type": "llama"})) == {}
    assert registry_env(_model(tmp_path, ["not", "a", "dict"])) == {}
    assert registry_env(tmp_path / "missing") == {}


def test_sglangs_registry_honours_the_setting(tmp_path: Path) -> None:
    env = {**os.environ, **registry_env(_model(tmp_path, {"architectures": ["LlamaForCausalLM"]})),
           "SGLANG_USE_CPU_ENGINE": "1"}  # fmt: skip
    code = "from sglang.srt.models.registry import ModelRegistry as R; print(sorted(R.models))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    models = p.stdout.strip().splitlines()[-1]
    assert "'LlamaForCausalLM'" in models and "Qwen2ForCausalLM" not in models, models
