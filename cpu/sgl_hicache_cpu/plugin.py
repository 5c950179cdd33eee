"""The CPU profile's sglang plugin (entry-point group `sglang.srt.plugins`).

sglang runs `register()` early in every process of every server started in this environment. It
applies, each only where its environment variable asks for it (inherited by every process of the
server), and otherwise imports nothing:

- `SGL_HICACHE_CPU_HICACHE_COMPAT=1` (or sglang's `SGLANG_` copy): the patches that let sglang's own
  HiCache run on CPU (`hicache_cpu_compat`, the benchmark's peer);
- `SGL_HICACHE_CPU_PREFIX_ATTENTION=1` (or its `SGLANG_` copy): the CPU benchmarks' extend attention
  over new rows only (`cpu_prefix_attention`), for every system alike.
"""

from __future__ import annotations

import os

COMPAT_ENV = ("SGL_HICACHE_CPU_HICACHE_COMPAT", "SGLANG_HICACHE_CPU_HICACHE_COMPAT")  # hicache_cpu_compat's
PREFIX_ATTENTION_ENV = (
    "SGL_HICACHE_CPU_PREFIX_ATTENTION",
    "SGLANG_HICACHE_CPU_PREFIX_ATTENTION",
)  # cpu_prefix_attention's


def register() -> None:
    _apply_cpu_hicache_compat()
    _apply_cpu_prefix_attention()


def _apply_cpu_hicache_compat() -> None:
    if not any(name in os.environ for name in COMPAT_ENV):
        return
    from sgl_hicache_cpu import hicache_cpu_compat

    if hicache_cpu_compat.enabled_by_env():
        hicache_cpu_compat.apply()


def _apply_cpu_prefix_attention() -> None:
    if not any(name in os.environ for name in PREFIX_ATTENTION_ENV):
        return
    from sgl_hicache_cpu import cpu_prefix_attention

    if cpu_prefix_attention.enabled_by_env():
        cpu_prefix_attention.apply()
