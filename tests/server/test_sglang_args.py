"""sglang's own flags, read by sglang's own parser before sglang starts: unknown flags (with the closest
of ours or sglang's), invalid values, what our backend refuses, and the model's config.json. Each
refusal is one line and exit code 2, with sglang never started and nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import sgl_hicache.launch_server as launch_server
from sgl_hicache.server import sglang_args
from sgl_hicache.server.model_check import HYBRID_SWA_ARCHS, SSM_MODEL_TYPES
from sgl_hicache.server.sglang_seam import SeamError
from tests.server.launcher import PREFIX, refusal, run_main

DENSE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2}
MODELS: dict[str, dict[str, Any]] = {
    "dense": DENSE,
    "swa": {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss"},
    "swa_opt_in": {**DENSE, "is_hybrid_swa": True},
    "ssm": {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"},
    "ssm_layers": {"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
                   "layer_types": ["mamba", "attention"]},
    "multimodal": {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
                   "vision_config": {"model_type": "clip_vision_model"}, "text_config": {"model_type": "llama"}},
    "mm_off_by_default": {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                          "text_config": {"model_type": "gemma3_text"}, "vision_config": {}},
}  # fmt: skip


@pytest.fixture
def tier(tmp_path: Path) -> Path:
    return tmp_path / "tier"


def spill(tier: Path, *args: str) -> list[str]:
    return [
        "--model-path",
        "/nonexistent-model",
        "--enable-hicache-spill",
        "--hicache-spill-dir",
        str(tier),
        *args,
    ]


def model_dir(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(MODELS[name]))
    return path


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-total-tokns", "1024"], "unknown flag --max-total-tokns (did you mean --max-total-tokens?)"),
        (["--enable-hicache-spil"], "unknown flag --enable-hicache-spil (did you mean --enable-hicache-spill?)"),
        (["stray"], "unexpected argument 'stray'"),
        (["--schedule-policy", "bogus"], "argument --schedule-policy: invalid choice: 'bogus'"),
        (["--enable-hierarchical-cache"],
         "--enable-hierarchical-cache: not supported with the hicache_spill backend (it replaces sglang's HiCache"),
        (["--enable-hierarchical"], "--enable-hierarchical-cache: not supported with the hicache_spill backend"),
        (["--speculative-algorithm", "EAGLE"],
         "--speculative-algorithm EAGLE: not supported with the hicache_spill backend yet"),
        (["--speculative-algorithm", "NGRAM"], "--speculative-algorithm NGRAM: not supported"),
    ],
)  # fmt: skip
def test_sglang_flags_are_refused_by_sglangs_parser(tier: Path, args: list[str], message: str) -> None:
    line = refusal(run_main(spill(tier, *args)))
    assert line.startswith(message), line
    assert not tier.exists()


def test_what_only_our_backend_refuses_passes_without_it() -> None:
    run = run_main(["--model-path", "/m", "--enable-hierarchical-cache", "--speculative-algorithm", "EAGLE"])
    assert run.code == 0 and run.stderr == "" and len(run.started) == 1


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("swa", "a hybrid sliding-window (SWA) model (GptOssForCausalLM)"),
        ("swa_opt_in", "a hybrid sliding-window (SWA) model (LlamaForCausalLM)"),
        ("ssm", "a hybrid SSM / linear-attention model (Qwen3NextForCausalLM)"),
        ("ssm_layers", "a hybrid SSM / linear-attention model (GraniteMoeHybridForCausalLM)"),
        ("multimodal", "a multimodal model (LlavaForConditionalGeneration)"),
    ],
)
def test_models_our_backend_cannot_serve_are_refused_from_their_config_json(
    tmp_path: Path, tier: Path, name: str, message: str
) -> None:
    path = model_dir(tmp_path, name)
    line = refusal(run_main([*spill(tier)[2:], "--model-path", str(path)]))
    assert line == (f"--model-path {path}: {message} per its config.json; the hicache_spill backend "
                    "serves dense full-attention text models only"), line  # fmt: skip
    assert not tier.exists() and sorted(p.name for p in path.iterdir()) == ["config.json"]


@pytest.mark.parametrize(
    ("name", "args"),
    [("dense", []), ("swa", ["--disable-hybrid-swa-memory"]), ("multimodal", ["--language-model-only"]),
     ("mm_off_by_default", [])],
)  # fmt: skip
def test_models_sglang_serves_as_dense_text_pass(
    tmp_path: Path, tier: Path, name: str, args: list[str]
) -> None:
    run = run_main([*spill(tier)[2:], "--model-path", str(model_dir(tmp_path, name)), *args])
    assert run.code == 0 and run.stderr == "" and len(run.started) == 1


def test_an_unreadable_config_json_is_left_to_sglang(tmp_path: Path, tier: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{not json")
    assert run_main([*spill(tier)[2:], "--model-path", str(tmp_path / "m")]).code == 0


def test_our_model_rules_agree_with_sglangs() -> None:
    """Every architecture we call hybrid SWA is one for sglang 0.5.23, and every model type we call
    recurrent is one of the configs sglang's `hybrid_arch` tests for recurrent state."""
    from types import SimpleNamespace

    import sglang.srt.configs.hybrid_arch as hybrid_arch
    from sglang.srt.configs.model_config import is_hybrid_swa_model
    from transformers import PretrainedConfig

    text = SimpleNamespace(layer_types=["sliding_attention", "full_attention"], sliding_window=128)
    assert all(is_hybrid_swa_model([arch], text) for arch in HYBRID_SWA_ARCHS)
    theirs = {
        cls.model_type
        for cls in vars(hybrid_arch).values()
        if isinstance(cls, type) and issubclass(cls, PretrainedConfig)
    }
    conditional = {"granitemoehybrid", "minicpm_sala", "inkling_model", "inkling_mm_model", "bailing_hybrid"}
    assert theirs - conditional <= SSM_MODEL_TYPES, theirs - conditional - SSM_MODEL_TYPES


def test_another_sglang_version_is_left_to_the_seam_check(tier: Path) -> None:
    """sglang's parser is read only where it is the one we know; otherwise the seam check refuses."""

    def seam() -> None:
        raise SeamError("sgl_hicache supports sglang 0.5.23 only; the installed sglang differs: version 9")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sglang_args.metadata, "version", lambda name: "9")
        mp.setattr(launch_server, "check_seam", seam)
        line = refusal(run_main(spill(tier, "--max-total-tokns", "1"), seam=False))
    assert line.startswith("sgl_hicache supports sglang 0.5.23 only")


def test_an_sglang_refusal_from_the_real_command(tier: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "sgl_hicache.launch_server", *spill(tier, "--enable-hierarchical-cache")],
                            capture_output=True, text=True, timeout=240)  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(PREFIX), result.stderr
    assert "--enable-hierarchical-cache: not supported" in lines[0] and not tier.exists()


def test_help_sglang_prints_sglangs_own_help() -> None:
    result = subprocess.run([sys.executable, "-m", "sgl_hicache.launch_server", "--help-sglang"],
                            capture_output=True, text=True, timeout=240)  # fmt: skip
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert "--model-path" in result.stdout and "--enable-hierarchical-cache" in result.stdout
    assert "--hicache-spill-capacity" not in result.stdout
