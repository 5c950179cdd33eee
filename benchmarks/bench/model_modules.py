"""Start a server without importing sglang's ~250 model modules it does not need.

sglang's model registry imports every module of `sglang.srt.models` at start (each scheduler
process), about 4-5 s on this 2-core machine, to find the one class a model's `architectures`
names. Its own setting `SGLANG_DISABLED_MODEL_ARCHS` (module names to skip) limits that. For a
model whose architectures all live in modules we know, `registry_env` skips every other module;
for any other model it changes nothing, so sglang resolves the model as it always does.
"""

from __future__ import annotations

import importlib.util
import json
import pkgutil
from pathlib import Path

ENV = "SGLANG_DISABLED_MODEL_ARCHS"
MODULE_OF = {"LlamaForCausalLM": "llama"}  # the architectures of every model the tests and benchmarks build
_KEPT = frozenset({"registry"})  # never a model module, but importable


def model_modules() -> list[str]:
    """The module names of `sglang.srt.models`, found without importing sglang."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return []
    folder = Path(next(iter(spec.submodule_search_locations))) / "srt" / "models"
    return sorted(m.name for m in pkgutil.iter_modules([str(folder)]) if not m.ispkg)


def registry_env(model_path: Path) -> dict[str, str]:
    """`{ENV: the modules to skip}` when every architecture of the model at `model_path` is in
    `MODULE_OF`; `{}` otherwise (an unknown architecture, or no readable config)."""
    try:
        archs = json.loads((model_path / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return {}
    if not archs or not all(isinstance(a, str) and a in MODULE_OF for a in archs):
        return {}
    needed = {MODULE_OF[a] for a in archs} | _KEPT
    skipped = [m for m in model_modules() if m not in needed]
    return {ENV: ",".join(skipped)} if skipped else {}
