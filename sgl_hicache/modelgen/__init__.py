"""Generate random-weight Llama models with a locally trained tokenizer (no model hub needed)."""

from sgl_hicache.modelgen.generate import SIZES, ModelSize, generate_model

__all__ = ["SIZES", "ModelSize", "generate_model"]
