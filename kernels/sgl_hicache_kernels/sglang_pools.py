"""Adapters from sglang 0.5.23 KV pools to `KVPoolView`.

Supported: `MHATokenToKVPool` with the default NHD layout and unquantized KV, and `MLATokenToKVPool`,
exactly these classes: subclasses (FP4 / MXFP8 / page-major / DSA pools) hold scale or indexer
buffers or other layouts that a byte copy of `k_buffer`/`v_buffer`/`kv_buffer` would silently miss.
fp8 pools store bytes (store_dtype uint8); the view keeps the logical dtype, the bytes move as-is.
sglang is imported on first use only (it takes seconds to import).
"""

from __future__ import annotations

from typing import Any

from .layout import KVKind, KVPoolView


def from_sglang_pool(pool: Any) -> KVPoolView:
    """Build the view of an sglang KV pool; TypeError for other pool classes, ValueError for
    unsupported layouts (HND, AITER vectorized_5d, quantized KV)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    if type(pool) is MHATokenToKVPool:
        return _from_mha(pool)
    if type(pool) is MLATokenToKVPool:
        return _from_mla(pool)
    raise TypeError(f"no KV pool view for {type(pool).__name__}: MHATokenToKVPool or MLATokenToKVPool only")


def _from_mha(pool: Any) -> KVPoolView:
    if pool.kv_cache_layout != "nhd":
        raise ValueError(f"MHA KV layout {pool.kv_cache_layout!r} is not supported (NHD only)")
    if pool.is_quantized_kv_cache:
        raise ValueError("quantized MHA KV (separate scale buffers) is not supported")
    return KVPoolView(
        kind=KVKind.MHA,
        layers=tuple(zip(pool.k_buffer, pool.v_buffer, strict=True)),
        page_size=pool.page_size,
        dtype=pool.dtype,
        heads=pool.head_num,
        head_dim=pool.head_dim,
        v_head_dim=pool.v_head_dim,
        start_layer=pool.start_layer,
    )


def _from_mla(pool: Any) -> KVPoolView:
    if getattr(pool, "kv_scale_buffer", None) is not None:
        raise ValueError("MLA KV with scale buffers is not supported")
    return KVPoolView(
        kind=KVKind.MLA,
        layers=tuple((buf,) for buf in pool.kv_buffer),
        page_size=pool.page_size,
        dtype=pool.dtype,
        heads=1,
        head_dim=pool.kv_cache_dim,
        start_layer=pool.start_layer,
    )
