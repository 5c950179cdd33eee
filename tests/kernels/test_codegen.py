"""The Triton kernels compile ahead of time for sm_90 (H100/H200) and gfx942 (MI300X/MI308X) on a
machine without a GPU, and every bulk load/store of the 16-byte-aligned case is a 16-byte vector
(what the offset scheme in pack_triton.py exists for). Catches compiled-mode errors that the
interpreter tolerates, and regressions to word-by-word copies."""

from __future__ import annotations

import os
import re
from collections import Counter

import pytest
import torch

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("kernels are interpreted in this process", allow_module_level=True)

from sgl_hicache_kernels import KVKind, pack_triton, packed_nbytes  # noqa: E402
from sgl_hicache_kernels.plan import CopyPlan  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from .kv_factory import FP8, make_view  # noqa: E402

TYPES = {"table_ptr": "*i64", "slots_ptr": "*i64", "page_bytes": "i64", "n_buffers": "i32", "n_tokens": "i32"}
TARGETS = {
    "sm90": (GPUTarget("cuda", 90, 32), "ptx", r"(ld|st)\.global(\.v\d)?\.b\d+"),
    "gfx942": (GPUTarget("hip", "gfx942", 64), "amdgcn", r"(global|buffer)_(load|store)_dword\w*"),
}


def compile_kernel(kernel: object, target: GPUTarget, consts: dict[str, int], num_warps: int) -> object:
    names = kernel.arg_names  # type: ignore[attr-defined]
    sig = {n: "constexpr" if n in consts else TYPES.get(n, "*i32") for n in names}
    aligned = [["tt.divisibility", 16]]
    attrs = {(names.index(n),): aligned for n in names if n.endswith("_ptr") or n == "page_bytes"}
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=target, options={"num_warps": num_warps})


# Realistic views with the default launch config of the wrapper: (kind, dtype, heads, head_dim,
# page_size, page-granular). Llama-8B-like rows are 2 KiB; MLA fp32 64-token blocks (144 KiB) take
# the looped path; token-granular paged copies too.
CASES = {
    "llama-bf16-p1": (KVKind.MHA, torch.bfloat16, 8, 128, 1, True),
    "llama-bf16-p64": (KVKind.MHA, torch.bfloat16, 8, 128, 64, True),
    "llama-bf16-p16-tokens": (KVKind.MHA, torch.bfloat16, 8, 128, 16, False),
    "mla-fp8-p1": (KVKind.MLA, FP8, 1, 576, 1, True),
    "mla-fp32-p64": (KVKind.MLA, torch.float32, 1, 576, 64, True),
}


def launch_meta(case: str, warp_size: int) -> tuple[dict[str, int], int]:
    kind, dtype, heads, head_dim, page_size, granular = CASES[case]
    view = make_view(kind, dtype, heads, head_dim, page_size=page_size, num_slots=page_size + 1, layers=2)
    packed = torch.empty(packed_nbytes(view, page_size), dtype=torch.uint8)
    plan = CopyPlan(page_size, granular)
    cfg = pack_triton.launch_config(view, granular, warp_size)
    meta = pack_triton._launch_args(view, packed, plan, cfg)[-1]
    return meta, meta.pop("num_warps")


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kernel", ["_pack_kv_kernel", "_unpack_kv_kernel"])
@pytest.mark.parametrize("target_name", sorted(TARGETS))
def test_bulk_copies_are_16_byte_vectors(kernel: str, target_name: str, case: str) -> None:
    target, asm_kind, pattern = TARGETS[target_name]
    if {"cuda": "nvidia", "hip": "amd"}[target.backend] not in triton.backends.backends:
        pytest.skip(f"this triton build has no {target.backend} backend")
    consts, num_warps = launch_meta(case, target.warp_size)
    assert consts["UNIT"] == 16
    asm = compile_kernel(getattr(pack_triton, kernel), target, consts, num_warps).asm[asm_kind]  # type: ignore[attr-defined]
    ops = Counter(m.group(0) for m in re.finditer(pattern, asm))
    bulk = {op: c for op, c in ops.items() if "store" in op or "st." in op or "x4" in op or "v4" in op}
    assert bulk and all(("v4" in op or "x4" in op) for op in bulk), (consts, ops)
