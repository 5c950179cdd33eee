"""A Llama-architecture model with random weights, deterministic from a seed.

Random weights give gibberish text but deterministic greedy outputs, which is what cache
correctness tests need (a restored KV must reproduce the recomputed output token for token).
The tokenizer is a byte-level BPE trained on `corpus.txt` shipped beside this module, wrapped as a
`PreTrainedTokenizerFast` with ChatML special tokens and chat template, so the directory is a normal
HF model directory that sglang loads like any other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MAX_POSITIONS = 32768
# Larger than HF's 0.02 so attention is far from uniform and greedy outputs depend on the whole
# context: a wrong KV entry then changes the output, which the cache-correctness tests rely on.
INIT_STD = 0.25


@dataclass(frozen=True)
class ModelSize:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_positions: int = MAX_POSITIONS
    head_dim: int | None = None  # None: hidden // heads

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, in bf16."""
        return self.layers * 2 * self.kv_heads * (self.head_dim or self.hidden // self.heads) * 2


SIZES: dict[str, ModelSize] = {
    # ~0.5M parameters: server tests and the demo.
    "tiny": ModelSize(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=1024),
    # ~95M parameters: benchmarks where prefill must cost real time on CPU.
    "small": ModelSize(hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048, vocab=8192),
    # ~50M parameters but the KV of an 8B model (32 layers x 8 KV heads x 128 head dim in bf16 =
    # 128 KiB per token, as Llama-3.1-8B): on a CPU a resumed turn's cost is then mostly moving KV,
    # as it is on a GPU, instead of the CPU's slow compute (issue 25). It stands for the tier's
    # work of an 8B model (bytes to spill, read, verify, unpack), not for its answers or its
    # prefill time: its hidden size is 256.
    "kvheavy": ModelSize(
        hidden=256, layers=32, heads=8, kv_heads=8, intermediate=512, vocab=8192, head_dim=128
    ),
}


def generate_model(out_dir: Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write an HF model directory to `out_dir` (created); returns it. Same inputs → same bytes."""
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {', '.join(SIZES)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = SIZES[size]
    tokenizer = _train_tokenizer(spec.vocab)
    tokenizer.save_pretrained(out_dir)
    _save_model(out_dir, spec, seed, tokenizer)
    (out_dir / "sgl_hicache_model.json").write_text(json.dumps({"size": size, "seed": seed}) + "\n")
    return out_dir


def _train_tokenizer(vocab: int):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = resources.files("benchmarks.modelgen").joinpath("corpus.txt").read_text().splitlines()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHATML_TEMPLATE,
        model_max_length=MAX_POSITIONS,
    )


def llama_config(spec: ModelSize, tokenizer=None):  # type: ignore[no-untyped-def]
    """The `LlamaConfig` of a size; token ids from `tokenizer` when given."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=max(spec.vocab, len(tokenizer) if tokenizer else 0),
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim or spec.hidden // spec.heads,
        max_position_embeddings=spec.max_positions,
        bos_token_id=tokenizer.bos_token_id if tokenizer else None,
        eos_token_id=tokenizer.eos_token_id if tokenizer else None,
        pad_token_id=tokenizer.pad_token_id if tokenizer else None,
        tie_word_embeddings=False,
        initializer_range=INIT_STD,
        dtype="bfloat16",
    )


def _save_model(out_dir: Path, spec: ModelSize, seed: int, tokenizer) -> None:  # type: ignore[no-untyped-def]
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(spec, tokenizer)).bfloat16()
    model.save_pretrained(out_dir, safe_serialization=True)
