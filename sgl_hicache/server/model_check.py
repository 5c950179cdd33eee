"""Models the hicache_spill backend cannot serve, told from a local model's `config.json` alone.

The backend serves dense full-attention text models: a hybrid sliding-window (SWA) model keeps a
second KV pool, a hybrid SSM / linear-attention model a recurrent state, and a multimodal model puts
image placeholders in the token ids; none of them is spilled. The cache factory refuses these in the
scheduler from sglang's resolved ModelConfig, after the weights load; the launcher refuses them
before sglang starts when `--model-path` is a local directory, from its `config.json` (no weights
read, sglang not imported). The rules follow sglang 0.5.23's (`configs/model_config.py`
`is_hybrid_swa_model`, `is_multimodal`; `configs/hybrid_arch.py`) and, where a rule would need more
than the file, let the model pass: the factory's check remains for every other case (a hub id, a
config that only the loaded model reveals). tests/server/test_sglang_args.py checks the tables
against sglang's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sgl_hicache.config import ConfigError

HYBRID_SWA_ARCHS = frozenset({
    "Llama4ForConditionalGeneration", "DeepseekV4ForCausalLM", "DeepseekV4ForCausalLMNextN",
    "DeepseekV4ForCausalLMDSpark", "GptOssForCausalLM", "GraniteSWAForCausalLM", "GraniteMoeSWAForCausalLM",
    "IQuestQ1ForCausalLM", "IQuestQ1MTP", "MiMoV2ForCausalLM", "MiMoV2FlashForCausalLM", "MiMoV2MTP",
    "Step3p5ForCausalLM", "Step3p5MTP", "Step3p7ForConditionalGeneration", "Gemma4ForCausalLM",
    "Gemma4ForConditionalGeneration", "EmbeddingGemma2Model", "Gemma4UnifiedForConditionalGeneration",
    "DiffusionGemmaForBlockDiffusion", "MellumForCausalLM", "MuseGlimmerForCausalLM",
    "MuseGlimmerForConditionalGeneration", "InklingForConditionalGeneration",
    "InklingForConditionalGenerationMTP", "UnlimitedOCRForCausalLM",
})  # fmt: skip
"""Architectures sglang always runs on a hybrid SWA pool (unless `--disable-hybrid-swa-memory`)."""

SSM_MODEL_TYPES = frozenset({
    "mamba", "mamba2", "falcon_mamba", "falcon_h1", "nemotron_h", "NemotronH_Nano_VL_V2", "zaya", "lfm2",
    "lfm2_moe", "lfm2_vl", "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text",
    "intern_s2_preview", "jet_nemotron", "jet_vlm", "kimi_linear", "glm5_next",
})  # fmt: skip
"""`model_type`s of the configs sglang gives a recurrent state (top level or text config)."""

SSM_LAYER_TYPES = frozenset({"mamba", "linear_attention"})  # in `layer_types`: a recurrent layer
MULTIMODAL_KEYS = ("vision_config", "audio_config", "text_config", "llm_config", "language_config",
                   "thinker_config", "mm_vision_tower")  # fmt: skip
MULTIMODAL_OFF_BY_DEFAULT = frozenset({
    "Gemma3ForConditionalGeneration", "Llama4ForConditionalGeneration", "Step3VLForConditionalGeneration",
    "InklingForConditionalGeneration",
})  # fmt: skip
"""Architectures sglang serves text-only unless `--enable-multimodal` (ModelConfig's `mm_disabled_models`)."""

WHY = "the hicache_spill backend serves dense full-attention text models only"


def check_model(args: Any) -> None:
    """ConfigError if `args` (sglang's parsed flags) name a local model our backend cannot serve."""
    config = read_config(args.model_path)
    what = refused_kind(config, args) if config is not None else None
    if config is not None and what is not None:
        archs = ", ".join(a for a in config.get("architectures") or [] if isinstance(a, str))
        raise ConfigError(f"--model-path {args.model_path}: {what} ({archs or 'no architectures'}) "
                          f"per its config.json; {WHY}")  # fmt: skip


def refused_kind(config: Mapping[str, Any], args: Any) -> str | None:
    """What of `config` (a config.json) our backend cannot serve under sglang flags `args`; None if
    nothing the file tells."""
    archs = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    text = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    types = {config.get("model_type"), text.get("model_type")}
    layers = {str(t) for c in (config, text) for t in c.get("layer_types") or [] if isinstance(t, str)}
    if types & SSM_MODEL_TYPES or layers & SSM_LAYER_TYPES:
        return "a hybrid SSM / linear-attention model"
    swa = set(archs) & HYBRID_SWA_ARCHS or text.get("is_hybrid_swa") is True
    if swa and not args.disable_hybrid_swa_memory:
        return "a hybrid sliding-window (SWA) model"
    if _multimodal(config, archs, args):
        return "a multimodal model"
    return None


def _multimodal(config: Mapping[str, Any], archs: list[str], args: Any) -> bool:
    if (
        args.language_model_only
        or config.get("language_model_only") is True
        or args.enable_multimodal is False
    ):
        return False
    off_by_default = bool(archs) and archs[0] in MULTIMODAL_OFF_BY_DEFAULT
    if off_by_default and not args.enable_multimodal:
        return False
    return any(key in config for key in MULTIMODAL_KEYS)


def read_config(model_path: str | None) -> dict[str, Any] | None:
    """The JSON object in the `config.json` of local model `model_path`; None if there is none to
    read (a hub id, no file, not JSON)."""
    if not model_path:
        return None
    path = Path(model_path) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None
