"""Opt-in patch for CPU benchmarks: sglang's torch-native extend attention, cost O(new x history).

sglang 0.5.23's `TorchNativeAttnBackend._run_sdpa_forward_extend` (the CPU attention backend) pads
each request's query to the *whole* sequence (`per_req_query_redudant`: zeros for the cached prefix)
and runs a causal SDPA over it, so a turn of 32 new tokens on a 16K-token cached history costs as
much attention as prefilling all 16K again. GPU backends (FlashInfer, FA3, Triton) compute only the
new rows. Measured on the `kvheavy` model on this 2-core CPU: 32 new tokens on 2,048 cached took
3 s; at 16K it would be minutes, and a cache hit would look like a miss.

`apply()` replaces the method with one that runs SDPA on the new rows only, each row masked to the
keys at or before its own position (the bottom-right causal mask); every other case (cross or
non-causal attention, sliding windows, encoder lengths) calls the original. Each row's result is the
same softmax over the same keys, so answers are those of the original up to float rounding (the
kernels see different shapes: not bit-identical, hence opt-in). It is for benchmarks, where every
system runs with it alike (`SGL_HICACHE_CPU_PREFIX_ATTENTION=1`, applied by our plugin in every
sglang process, ours or not); tests and the demo run sglang's own code. Does nothing where CUDA is
available; raises `PrefixAttentionTargetMissing` when the target is gone (an sglang upgrade).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention

ENV_VAR = "SGL_HICACHE_CPU_PREFIX_ATTENTION"
ENV_VAR_SGLANG_TWIN = "SGLANG_" + ENV_VAR.removeprefix("SGL_")  # sglang copies SGL_* to SGLANG_*
MODULE = "sglang.srt.layers.attention.torch_native_backend"
TARGET = "TorchNativeAttnBackend._run_sdpa_forward_extend"
_MARK = "_sgl_hicache_prefix_attention"


class PrefixAttentionTargetMissing(RuntimeError):
    """The method this module patches is not where sglang 0.5.23 has it."""


def enabled_by_env() -> bool:
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
               for name in (ENV_VAR, ENV_VAR_SGLANG_TWIN))  # fmt: skip


def apply() -> bool:
    """Patch sglang's extend attention (idempotent); False where CUDA is available (untouched)."""
    if torch.cuda.is_available():
        return False
    try:
        cls = importlib.import_module(MODULE).TorchNativeAttnBackend
        original = cls._run_sdpa_forward_extend
    except (ImportError, AttributeError) as e:
        raise PrefixAttentionTargetMissing(f"{MODULE}.{TARGET}: {e}") from None
    if not getattr(original, _MARK, False):
        cls._run_sdpa_forward_extend = _patched(original)
    return True


def _patched(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(original)
    def run(self: Any, query: torch.Tensor, output: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
            seq_lens: torch.Tensor, extend_prefix_lens: torch.Tensor, extend_seq_lens: torch.Tensor,
            encoder_lens: torch.Tensor | None = None, scaling: float | None = None,
            enable_gqa: bool = False, causal: bool = False, is_cross_attn: bool = False,
            sliding_window_size: int | None = None) -> torch.Tensor:  # fmt: skip
        plain = encoder_lens is None and not is_cross_attn and causal
        if not plain or (sliding_window_size is not None and sliding_window_size > -1):
            return original(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                            seq_lens, extend_prefix_lens, extend_seq_lens, encoder_lens, scaling,
                            enable_gqa, causal, is_cross_attn, sliding_window_size)  # fmt: skip
        return extend_new_rows(query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                               seq_lens, extend_seq_lens, scaling, enable_gqa)  # fmt: skip

    setattr(run, _MARK, True)
    return run


def extend_new_rows(
    query: torch.Tensor, output: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor, scaling: float | None, enable_gqa: bool,
) -> torch.Tensor:  # fmt: skip
    """Causal attention of each request's new rows (`query`, [tokens, heads, dim]) over its whole
    sequence in the cache; written into `output` ([tokens, heads, dim]) and returned."""
    q_all = query.movedim(0, 1)  # [heads, tokens, dim]
    start_q = 0
    for i in range(seq_lens.shape[0]):
        n, total = int(extend_seq_lens[i]), int(seq_lens[i])
        tokens = req_to_token[req_pool_indices[i], :total]
        q = q_all[:, start_q : start_q + n, :]
        k, v = k_cache[tokens].movedim(0, 1), v_cache[tokens].movedim(0, 1)
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        mask = None if n == total else _bottom_right_causal(n, total, q.device)
        out = scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                           is_causal=mask is None, scale=scaling, enable_gqa=enable_gqa)  # fmt: skip
        output[start_q : start_q + n] = out.squeeze(0).movedim(1, 0)
        start_q += n
    return output


def _bottom_right_causal(n: int, total: int, device: torch.device) -> torch.Tensor:
    """[n, total] bool: new row r (at position total - n + r) sees keys 0 .. total - n + r."""
    return torch.ones(n, total, dtype=torch.bool, device=device).tril(diagonal=total - n)
