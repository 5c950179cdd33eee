from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sgl_hicache.modelgen import SIZES, generate_model


def test_tiny_is_deterministic_and_loads_as_an_hf_model(tiny_model: Path, tmp_path: Path) -> None:
    again = generate_model(tmp_path / "again", "tiny", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_model / name).read_bytes(), name
    other = generate_model(tmp_path / "other", "tiny", seed=1)
    assert (other / "model.safetensors").read_bytes() != (tiny_model / "model.safetensors").read_bytes()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert model.config.model_type == "llama" and model.dtype == torch.bfloat16
    assert json.loads((tiny_model / "sgl_hicache_model.json").read_text()) == {"size": "tiny", "seed": 0}


def test_greedy_output_depends_on_the_context(tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    a = model.generate(torch.tensor([[5, 6, 7, 8, 9, 10]]), max_new_tokens=6, do_sample=False)[0, 6:]
    b = model.generate(torch.tensor([[11, 6, 7, 8, 9, 10]]), max_new_tokens=6, do_sample=False)[0, 6:]
    assert not torch.equal(a, b), "a changed first token must change the greedy continuation"


def test_small_has_about_100m_parameters() -> None:
    from transformers import LlamaForCausalLM

    from sgl_hicache.modelgen.generate import llama_config

    with torch.device("meta"):
        n = sum(p.numel() for p in LlamaForCausalLM(llama_config(SIZES["small"])).parameters())
    assert 80e6 <= n <= 120e6, n


def test_unknown_size_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model size 'huge'"):
        generate_model(tmp_path, "huge")
