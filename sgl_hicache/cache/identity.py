"""The KV namespace of a scheduler: every input that changes the KV bytes of a token path.

Two servers read each other's extents exactly when their `namespace_for(...).id` are equal, so the
namespace holds the weights (path, revision and a content fingerprint), the flags that change how
they run (dtype, quantization, KV-cache dtype, config overrides, implementation, load format), the
pool layout and the tensor-parallel rank/size. It holds nothing machine-local (no mtimes, inodes or
cache paths): the same checkpoint under the same `--model-path` on another machine gets the same
namespace, so machines may share a tier.

Parallelisms whose KV it cannot tell apart yet (pipeline stages, data-parallel replicas, attention
data parallelism) are refused with a `ConfigError` naming the flag (`UNISOLATED`).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import xxhash

from sgl_hicache.config import ConfigError, KiB, MiB

if TYPE_CHECKING:
    import torch
    from sgl_hicache_kernels import KVPoolView
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

    from sgl_hicache.tier import KVDtype, Namespace

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
SAMPLE_BYTES = 64 * KiB
_MAX_SAFETENSORS_HEADER = 100 * MiB

KV_FLAGS = (
    "dtype", "quantization", "kv_cache_dtype", "json_model_override_args", "model_impl", "load_format",
    "quantization_param_path", "modelopt_quant", "attention_backend", "prefill_attention_backend",
    "decode_attention_backend", "device", "lora_paths",
)  # fmt: skip
"""ServerArgs fields that change the KV of the same weights: each goes into the identity as resolved.
The attention kernels count (a layer's attention output feeds the next layer's K and V); LoRA
adapters loaded at start are named by path here and fingerprinted by content (`adapters_fingerprint`)."""


@dataclass(frozen=True)
class Unisolated:
    """A parallelism whose KV the namespace does not isolate yet: refused with the spill backend.
    `UNISOLATED` checks DP attention before `--dp-size`, which is its width when it is on."""

    field: str  # the ServerArgs field
    flags: tuple[str, ...]  # its command-line spellings; errors name the first
    why: str
    boolean: bool = False  # a switch, not a width

    def active(self, value: Any) -> bool:
        return bool(value) if self.boolean else int(value) > 1

    def message(self) -> str:
        return f"{self.flags[0]}: not supported with the hicache_spill backend yet ({self.why})"


UNISOLATED = (
    Unisolated("pp_size", ("--pp-size", "--pipeline-parallel-size"),
               "pipeline stages of equal size would share spill keys"),
    Unisolated("enable_dp_attention", ("--enable-dp-attention",),
               "DP attention shards heads by attention-TP rank, which spill keys do not name", boolean=True),
    Unisolated("attn_dp_size", ("--attn-dp-size", "--attention-data-parallel-size"),
               "attention data parallelism shards heads by attention-TP rank, which spill keys do not name"),
    Unisolated("dwdp_size", ("--dwdp-size",), "DWDP runs attention data parallelism"),
    Unisolated("dp_size", ("--dp-size", "--data-parallel-size"), "data-parallel replicas would share spill keys"),
)  # fmt: skip


def check_isolated(args: Any) -> None:
    """Raise ConfigError (one line, naming the flag) if `args` (a ServerArgs) runs a parallelism in
    `UNISOLATED`, as given on the command line or as sglang's resolution decided it."""
    for entry in UNISOLATED:
        if entry.active(getattr(args, entry.field)) or entry.active(_resolved(args, entry.field)):
            raise ConfigError(entry.message())


def namespace_for(ctx: TreeCacheBuildContext, view: KVPoolView) -> Namespace:
    """The namespace of this scheduler's KV pool `view`. Raises ConfigError for a configuration whose
    KV it cannot isolate (`check_isolated`) and OSError if the local weights cannot be read."""
    from sgl_hicache.tier import KVLayout, Namespace

    check_isolated(ctx.server_args)
    layout = KVLayout(num_layers=len(view.layers), num_heads=view.heads, head_dim=view.head_dim,
                      dtype=tier_dtype(view.dtype), page_size=view.page_size)  # fmt: skip
    model = model_identity(ctx.server_args, view)
    return Namespace(model=model, layout=layout, tp_rank=ctx.tp_rank, tp_size=ctx.tp_size)


def model_identity(args: Any, view: KVPoolView) -> str:
    """Compact canonical JSON of the weights, the KV-changing flags (`KV_FLAGS`) and what the tier's
    KVLayout lacks (MHA/MLA kind, V head size, first layer). The model is named as given (`--model-path`):
    sglang may resolve a GGUF or ModelScope reference to a machine-local path, which is only fingerprinted."""
    revision = _resolved(args, "revision")
    weights = weights_fingerprint(_resolved(args, "model_path"), revision, cache_dir=args.download_dir)
    flags = {name: _resolved(args, name) for name in KV_FLAGS}
    flags["json_model_override_args"] = _canonical_json(flags["json_model_override_args"])
    identity = {
        "model_path": args.model_path,
        "revision": revision,
        "weights": weights,
        "lora_weights": adapters_fingerprint(_resolved(args, "lora_paths")),
        **flags,
        "kv": view.kind.value,
        "v_head_dim": view.value_dim,
        "start_layer": view.start_layer,
        "versions": _versions(),
    }
    return json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str)


def tier_dtype(dtype: torch.dtype) -> KVDtype:
    """The tier's code for a KV pool dtype; KeyError for one the tier cannot store."""
    import torch

    from sgl_hicache.tier import KVDtype

    names = {torch.float32: "FP32", torch.float16: "FP16", torch.bfloat16: "BF16",
             torch.float8_e4m3fn: "FP8_E4M3", torch.float8_e5m2: "FP8_E5M2", torch.int8: "INT8"}  # fmt: skip
    return KVDtype[names[dtype]]


def _resolved(args: Any, field: str) -> Any:
    """What sglang's resolution decided for ServerArgs `field` (the flag as given unless a resolution
    hook declared another value); AttributeError if ServerArgs has no such field."""
    from sglang.srt.arg_groups.overrides import resolution_result

    return resolution_result(args, field, getattr(args, field))


def _versions() -> dict[str, str]:
    """sglang's and torch's versions: their kernels make the KV bytes (an upgrade starts a new namespace)."""
    from importlib.metadata import version

    import torch

    return {"sglang": version("sglang"), "torch": str(torch.__version__)}


def _canonical_json(text: Any) -> Any:
    """`--json-model-override-args` as parsed JSON, so spacing and key order do not split namespaces."""
    try:
        return json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError:
        return text


def weights_fingerprint(model_path: str, revision: str | None, cache_dir: str | None = None) -> str:
    """A hex xxh3-128 over the weights `model_path` names; cheap (a few reads per file), never online.

    A local directory: `config.json` and, for every top-level weight file (`WEIGHT_SUFFIXES`, the files
    sglang loads, by name): its name, its size, its safetensors header, and `SAMPLE_BYTES` read at its
    start, middle and end. A checkpoint rewritten in place changes it unless every change falls outside
    the samples of a file of unchanged size and header; a copy elsewhere keeps it. A local file (GGUF):
    that file alone. A hub id: its snapshot in the local Hugging Face cache; if it has none, the id and
    revision (one warning: weights changed under them are not detected). `cache_dir` is the Hugging
    Face cache to look in (sglang's `--download-dir`; None: the default). Raises OSError if a local
    weight file cannot be read whole.
    """
    path = Path(model_path)
    if path.is_dir():
        return _fingerprint(path, [p for p in path.iterdir() if p.name.endswith(WEIGHT_SUFFIXES)])
    if path.is_file():
        return _fingerprint(None, [path])
    snapshot = _cached_snapshot(model_path, revision, cache_dir)
    if snapshot is not None:
        return weights_fingerprint(str(snapshot), None)
    logger.warning(
        "sgl_hicache: %s@%s is neither a local directory nor in the local Hugging Face cache; its spill "
        "namespace names only the id and revision, so weights changed under them will not be detected",
        model_path, revision or "default",
    )  # fmt: skip
    return f"id:{model_path}@{revision or ''}"


def adapters_fingerprint(lora_paths: Any) -> list[list[str]]:
    """[name, path, fingerprint] of every LoRA adapter loaded at start, sorted: an adapter retrained
    in place (same name, same path) starts a new namespace, as rewritten weights do. Why it matters:
    sglang names a `--lora-paths` adapter by a deterministic id of (name, path), which goes into every
    request's extra key, so without this a restart would attach KV of the old adapter to the new one.
    Adapters loaded at run time (`/load_lora_adapter`) get a random id, never found again after a
    restart. Entries as sglang accepts them: "name=path", a bare path, a dict, or its parsed LoRARef."""
    adapters = []
    for entry in lora_paths or []:
        name, path = _adapter(entry)
        adapters.append([name, path, weights_fingerprint(path, None)])
    return sorted(adapters)


def _adapter(entry: Any) -> tuple[str, str]:
    if isinstance(entry, str):
        name, _, path = entry.partition("=") if "=" in entry else (entry, "", entry)
        return name, path
    if isinstance(entry, dict):
        return str(entry["lora_name"]), str(entry["lora_path"])
    return str(entry.lora_name), str(entry.lora_path)  # sglang's LoRARef


def _cached_snapshot(repo_id: str, revision: str | None, cache_dir: str | None) -> Path | None:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True))
    except (OSError, ValueError) as e:  # not cached (LocalEntryNotFoundError), or not a repo id
        logger.debug("sgl_hicache: no local snapshot of %s@%s: %s", repo_id, revision, e)
        return None


def _fingerprint(root: Path | None, files: list[Path]) -> str:
    h = xxhash.xxh3_128()
    if root is not None:
        config = root / "config.json"
        _update(h, b"config.json", config.read_bytes() if config.is_file() else b"")
        adapter = root / "adapter_config.json"  # a LoRA adapter's (rank, alpha, target modules)
        if adapter.is_file():
            _update(h, b"adapter_config.json", adapter.read_bytes())
    for path in sorted((p for p in files if p.is_file()), key=lambda p: p.name):
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            _update(h, path.name.encode(), size.to_bytes(8, "little"))
            if path.name.endswith(".safetensors"):
                _update(h, _safetensors_header(f, size))
            for offset in sorted({0, max(0, (size - SAMPLE_BYTES) // 2), max(0, size - SAMPLE_BYTES)}):
                _update(h, _read_exact(f, offset, min(SAMPLE_BYTES, size - offset)))
    return h.hexdigest()


def _safetensors_header(f: BinaryIO, size: int) -> bytes:
    """The JSON header (names, dtypes, shapes, offsets); empty if the file is not valid safetensors."""
    n = int.from_bytes(_read_exact(f, 0, 8), "little") if size >= 8 else 0
    return _read_exact(f, 8, n) if 0 < n <= min(size - 8, _MAX_SAFETENSORS_HEADER) else b""


def _read_exact(f: BinaryIO, offset: int, n: int) -> bytes:
    """`n` bytes at `offset`; OSError on a short read (the file shrank while read)."""
    data = os.pread(f.fileno(), n, offset)
    while len(data) < n:
        more = os.pread(f.fileno(), n - len(data), offset + len(data))
        if not more:
            raise OSError(f"short read of {f.name}: {len(data)} of {n} bytes at {offset}")
        data += more
    return data


def _update(h: Any, *chunks: bytes) -> None:
    """Feed length-prefixed chunks, so no two different sequences of chunks hash alike."""
    for chunk in chunks:
        h.update(len(chunk).to_bytes(8, "little"))
        h.update(chunk)
