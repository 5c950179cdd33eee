"""The Triton kernels compile ahead of time for sm_90 (H100/H200) and gfx942 (MI300X/MI308X) on a
machine without a GPU, and every bulk load/store of the 16-byte-aligned case is a 16-byte vector
(what the offset scheme in pack_triton.py exists for). Catches compiled-mode errors that the
interpreter tolerates, and regressions to word-by-word copies."""

from __future__ import annotations

import os
import re
from collections import Counter

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("kernels are interpreted in this process", allow_module_level=True)

from sgl_hicache.kernels import pack_triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

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


# (tokens per span, group, BLOCK words, steps): token rows of 2 KiB grouped by 8; 64-token pages of
# 2 KiB rows in 8 unrolled steps; a span long enough for the looped path.
SHAPES = [(1, 8, 512, 1), (64, 1, 4096, 8), (64, 1, 4096, 40)]


@pytest.mark.parametrize("kernel", ["_pack_kv_kernel", "_unpack_kv_kernel"])
@pytest.mark.parametrize("target_name", sorted(TARGETS))
def test_bulk_copies_are_16_byte_vectors(kernel: str, target_name: str) -> None:
    target, asm_kind, pattern = TARGETS[target_name]
    if {"cuda": "nvidia", "hip": "amd"}[target.backend] not in triton.backends.backends:
        pytest.skip(f"this triton build has no {target.backend} backend")
    warp = target.warp_size
    for tokens, group, block, steps in SHAPES:
        consts = dict(
            PAGE_SIZE=64 if tokens > 1 else 1,
            TOKENS=tokens,
            GROUP=group,
            UNIT=16,
            VEC=4,
            BLOCK=block,
            STEPS=steps,
        )
        num_warps = max(1, min(8, block * 4 // (16 * warp)))
        asm = compile_kernel(getattr(pack_triton, kernel), target, consts, num_warps).asm[asm_kind]  # type: ignore[attr-defined]
        ops = Counter(m.group(0) for m in re.finditer(pattern, asm))
        bulk = {op: c for op, c in ops.items() if "store" in op or "st." in op or "x4" in op or "v4" in op}
        assert bulk and all(("v4" in op or "x4" in op) for op in bulk), (consts, ops)
