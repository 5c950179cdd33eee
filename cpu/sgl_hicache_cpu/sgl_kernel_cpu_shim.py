"""A stand-in for the `sgl_kernel` module on CPU machines that have no sgl-kernel build.

sglang 0.5.23's CPU engine imports a few names from `sgl_kernel` at import time (for example
`assign_req_to_token_pool_cpu` in `sglang/srt/mem_cache/allocation.py` and
`copy_all_layer_kv_cache_cpu` in `sglang/srt/kernels/ops/kvcache/cache_move.py`), but no CPU build of
sgl-kernel is published, and the CUDA builds cannot be imported without libcuda. This shim lets those
imports succeed. It implements, in plain torch, exactly the functions a dense Llama served with
`--device cpu --attention-backend torch_native` calls; every other name resolves to a function that
raises NotImplementedError when called, naming itself, so a missing piece fails loudly, never silently.

It is only ever imported as `sgl_kernel` through `sgl_hicache_cpu.cpu_shim_hook`, which serves it
when no real `sgl_kernel` is installed and no GPU is present.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch

SHIM_NAME = "sgl_hicache_cpu.sgl_kernel_cpu_shim"
IMPLEMENTED = ("assign_req_to_token_pool_cpu",)


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    max_context_len: int,
) -> None:
    """`req_to_token[row, start:end] = out_cache_loc[...]`, requests laid end to end in `out_cache_loc`.

    sglang 0.5.23 passes `req_to_token.shape[1]` as the last argument (allocation.py:746), not the
    batch size; the batch is `req_pool_indices`.
    """
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    pos = 0
    for i in range(len(rows)):
        if ends[i] > max_context_len:
            raise ValueError(f"end offset {ends[i]} exceeds the request row length {max_context_len}")
        n = ends[i] - starts[i]
        req_to_token[rows[i], starts[i] : ends[i]] = out_cache_loc[pos : pos + n]
        pos += n


def _not_implemented(name: str) -> Callable[..., NoReturn]:
    def missing(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not implemented by the sgl_hicache CPU shim "
            f"(implemented: {', '.join(IMPLEMENTED)}); install a real sgl-kernel build for this feature"
        )

    missing.__name__ = name
    missing.__qualname__ = f"sgl_kernel_cpu_shim.{name}"
    return missing


def __getattr__(name: str) -> Callable[..., NoReturn]:
    if name.startswith("__"):
        raise AttributeError(name)
    return _not_implemented(name)
