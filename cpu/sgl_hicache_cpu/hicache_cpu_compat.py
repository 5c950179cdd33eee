"""Runtime patches that let sglang 0.5.23's own HiCache (`--enable-hierarchical-cache`) run on CPU.

Only the benchmark's peer needs this: sglang's host-memory L2 plus a storage L3 (`file`), served on a
CPU-only machine with `--hicache-io-backend direct --hicache-mem-layout layer_first`. Nothing of ours
depends on it. Every patch lives here; each names what it replaces and why:

1. `sglang.srt.mem_cache.pool_host.base.HostKVCache.__init__` is wrapped to force
   `pin_memory=False`. With the default `True`, the host pool is allocated by
   `pool_host.common.alloc_with_host_register`, which calls `cudaHostRegister` through
   `torch.cuda.cudart()` and dies without a driver. `pin_memory=False` also makes `destroy()` skip
   `cudaHostUnregister` and the pointer tables record unregistered host memory, so one flag skips
   every CUDA host-registration step.
2. `sglang.srt.mem_cache.pool_host.mha.transfer_kv_direct` is provided. The module imports it from
   `sgl_kernel.kvcacheio` only on CUDA/ROCm/XPU, so on CPU the name is missing and
   `MHATokenToKVPoolHost.load_to_device_per_layer` / `backup_from_device_all_layer` (the direct,
   layer_first path) raise NameError. `transfer_kv_direct` below is the same copy in plain torch,
   planned in whole pages (slice copies of consecutive runs; a page gather when they are many).
   `transfer_kv_per_layer_direct_pf_lf` and `transfer_kv_all_layer_direct_lf_pf` are provided the
   same way, for the `page_first_direct` host layout sglang picks for a `mooncake` L3 with the
   direct I/O backend (`page_first_direct`, plain torch too): `load_to_device_per_layer` and
   `backup_from_device_all_layer` call them there. Each of the three is checked to be called by its
   methods as a module global, with exactly our function's parameters as keywords.
   Other host pools (MLA, DSA, Mamba, unified) are not covered: on CPU they still fail loudly.
3. `torch.cpu.Stream.synchronize` and `torch.cpu.Stream.query` are added as "already complete".
   sglang's `L2TransferEngine` runs transfers on `device_module.Stream()` (= `torch.cpu.Stream` on
   CPU), a stub without these two methods; `_submission` calls `stream.synchronize()` when a transfer
   raises, which would otherwise replace the real error with an AttributeError. CPU work is done in
   program order, so "synchronize = nothing to wait for" and "query = True" are the truth, as for
   `torch.cpu.Event`, which already has both. Methods torch itself defines are never replaced.

`apply()` is idempotent, does nothing where CUDA is available, and raises `CompatTargetMissing`
naming the symbol when a target is gone, so an sglang upgrade fails at startup, not mid-request.
In sglang's processes it runs from our plugin when `SGL_HICACHE_CPU_HICACHE_COMPAT=1` (see
`enabled_by_env` for why the `SGLANG_` twin of the name is accepted too).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import CodeType, ModuleType
from typing import Any

import torch

from sgl_hicache_cpu.page_first_direct import (
    transfer_kv_all_layer_direct_lf_pf,
    transfer_kv_per_layer_direct_pf_lf,
)

ENV_VAR = "SGL_HICACHE_CPU_HICACHE_COMPAT"
# sglang copies every `SGL_*` variable to `SGLANG_*` at import (sglang/srt/environ.py); accepting the
# copy keeps activation working should it ever move the variable instead of copying it.
ENV_VAR_SGLANG_TWIN = "SGLANG_" + ENV_VAR.removeprefix("SGL_")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})

BASE_MODULE = "sglang.srt.mem_cache.pool_host.base"
MHA_MODULE = "sglang.srt.mem_cache.pool_host.mha"
# The MHA host pool methods whose direct branches call the module globals below.
DIRECT_CALLERS = ("load_to_device_per_layer", "backup_from_device_all_layer")
_MARK = "_sgl_hicache_cpu_compat"


class CompatTargetMissing(RuntimeError):
    """A symbol this module patches is not where sglang 0.5.23 has it (the message names it)."""


@dataclass(frozen=True)
class PatchTarget:
    module: str
    attribute: str
    why: str

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attribute}"


TARGETS = (
    PatchTarget(BASE_MODULE, "HostKVCache.__init__", "force pin_memory=False (no cudaHostRegister)"),
    PatchTarget(MHA_MODULE, "transfer_kv_direct", "absent without sgl_kernel.kvcacheio; plain torch"),
    PatchTarget("torch.cpu", "Stream.synchronize", "stub stream lacks it; CPU work is synchronous"),
    PatchTarget("torch.cpu", "Stream.query", "stub stream lacks it; CPU work is synchronous"),
    PatchTarget(MHA_MODULE, "transfer_kv_per_layer_direct_pf_lf", "page_first_direct load; plain torch"),
    PatchTarget(MHA_MODULE, "transfer_kv_all_layer_direct_lf_pf", "page_first_direct backup; plain torch"),
)


def transfer_kv_direct(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """`dst_layers[l][dst_indices[i]] = src_layers[l][src_indices[i]]` for every layer `l` and row `i`.

    The semantics of `sgl_kernel.kvcacheio.transfer_kv_direct` (rows are tokens, indices are whole
    pages). HiCache's indices are pages of `page_size` consecutive rows, so the copy is planned once
    per call, in pages: runs of pages consecutive on both sides become one slice copy per layer (a
    single memcpy-like pass); when there are more runs than `MAX_SLICE_RUNS`, page-aligned pages are
    gathered and scattered as whole pages. Indices that are not consecutive within a page are copied
    row by row (correct for any index list). Raises ValueError on mismatched layer or index counts, a
    count that is not whole pages, or mismatched row shapes.
    """
    _check_transfer(src_layers, dst_layers, src_indices, dst_indices, page_size)
    if src_indices.numel() == 0:
        return
    src_idx, dst_idx = src_indices.to("cpu", torch.int64), dst_indices.to("cpu", torch.int64)
    plan = _plan(src_idx, dst_idx, page_size)
    for src, dst in zip(src_layers, dst_layers, strict=True):
        _copy(src, dst, plan, page_size)


MAX_SLICE_RUNS = 16
"""Above this many runs, one gather/scatter of whole pages beats a Python loop of slice copies."""


@dataclass(frozen=True)
class _Plan:
    runs: list[tuple[int, int, int]]  # (src row, dst row, rows): consecutive on both sides
    src_pages: torch.Tensor | None  # page numbers (row // page_size) when every page is aligned
    dst_pages: torch.Tensor | None
    src_rows: torch.Tensor  # the row indices, for the row-by-row fallback
    dst_rows: torch.Tensor


def _plan(src: torch.Tensor, dst: torch.Tensor, page_size: int) -> _Plan:
    s, d = src.view(-1, page_size), dst.view(-1, page_size)
    step = torch.arange(page_size)
    if not (torch.equal(s - s[:, :1], step.expand_as(s)) and torch.equal(d - d[:, :1], step.expand_as(d))):
        return _Plan([], None, None, src, dst)  # not whole pages: row by row
    s0, d0 = s[:, 0], d[:, 0]
    breaks = ((s0[1:] != s0[:-1] + page_size) | (d0[1:] != d0[:-1] + page_size)).nonzero().flatten() + 1
    starts = [0, *breaks.tolist()]
    ends = [*starts[1:], s0.numel()]
    runs = [(int(s0[a]), int(d0[a]), (b - a) * page_size) for a, b in zip(starts, ends, strict=True)]
    aligned = bool((s0 % page_size == 0).all() and (d0 % page_size == 0).all())
    if not aligned:
        return _Plan(runs, None, None, src, dst)
    return _Plan(runs, s0 // page_size, d0 // page_size, src, dst)


def _copy(src: torch.Tensor, dst: torch.Tensor, plan: _Plan, page_size: int) -> None:
    if plan.runs and (len(plan.runs) <= MAX_SLICE_RUNS or plan.src_pages is None):
        for s, d, n in plan.runs:
            dst[d : d + n].copy_(src[s : s + n])
    elif plan.src_pages is not None and plan.dst_pages is not None:
        src_view = src[: src.shape[0] // page_size * page_size].view(-1, page_size, *src.shape[1:])
        dst_view = dst[: dst.shape[0] // page_size * page_size].view(-1, page_size, *dst.shape[1:])
        dst_view.index_copy_(0, plan.dst_pages, src_view.index_select(0, plan.src_pages))
    else:
        dst.index_copy_(0, plan.dst_rows, src.index_select(0, plan.src_rows))


def _check_transfer(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    if len(src_layers) != len(dst_layers):
        raise ValueError(
            f"transfer_kv_direct: {len(src_layers)} source layers, {len(dst_layers)} destination"
        )
    n = src_indices.numel()
    if dst_indices.numel() != n:
        raise ValueError(f"transfer_kv_direct: {n} source indices, {dst_indices.numel()} destination")
    if page_size <= 0 or n % page_size:
        raise ValueError(f"transfer_kv_direct: {n} indices are not whole pages of {page_size}")
    for src, dst in zip(src_layers, dst_layers, strict=True):
        if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
            raise ValueError(
                f"transfer_kv_direct: rows {tuple(src.shape[1:])} {src.dtype} -> {tuple(dst.shape[1:])} {dst.dtype}"
            )


def _stream_synchronize(self: torch.cpu.Stream) -> None:
    return None


def _stream_query(self: torch.cpu.Stream) -> bool:
    return True


def _import(target: PatchTarget) -> ModuleType:
    try:
        return importlib.import_module(target.module)
    except ImportError as e:
        raise CompatTargetMissing(f"{target.name}: module {target.module} does not import ({e})") from e


def _host_kv_cache(module: ModuleType) -> Any:
    cls: Any = getattr(module, "HostKVCache", None)
    init = getattr(cls, "__init__", None) if isinstance(cls, type) else None
    param = inspect.signature(init).parameters.get("pin_memory") if init is not None else None
    if param is None or param.kind is not inspect.Parameter.KEYWORD_ONLY:
        raise CompatTargetMissing(f"{TARGETS[0].name}: no keyword-only pin_memory parameter")
    return cls


DIRECT_COPIES: tuple[tuple[PatchTarget, Callable[..., None], tuple[str, ...]], ...] = (
    (TARGETS[1], transfer_kv_direct, DIRECT_CALLERS),
    (TARGETS[4], transfer_kv_per_layer_direct_pf_lf, ("load_to_device_per_layer",)),
    (TARGETS[5], transfer_kv_all_layer_direct_lf_pf, ("backup_from_device_all_layer",)),
)
"""Each copy we provide as a module global of `MHA_MODULE`, and the host pool methods that call it."""


def _mha_module(module: ModuleType) -> ModuleType:
    cls = getattr(module, "MHATokenToKVPoolHost", None)
    for target, fn, callers in DIRECT_COPIES:
        params = frozenset(inspect.signature(fn).parameters)
        for method in callers:
            code = getattr(getattr(cls, method, None), "__code__", None)
            if code is None or target.attribute not in code.co_names:
                raise CompatTargetMissing(
                    f"{target.name}: MHATokenToKVPoolHost.{method} no longer calls the module global"
                )
            if params not in _keyword_calls(code):
                raise CompatTargetMissing(
                    f"{target.name}: MHATokenToKVPoolHost.{method} no longer passes exactly "
                    f"{', '.join(sorted(params))} by keyword"
                )
        existing = getattr(module, target.attribute, None)
        if existing is not None and existing is not fn:
            raise CompatTargetMissing(f"{target.name}: already bound to {existing!r}; refusing to replace it")
    return module


def _keyword_calls(code: CodeType) -> set[frozenset[str]]:
    """The keyword names of each call in `code` that passes keywords (CPython keeps them as a tuple
    constant per call)."""
    return {
        frozenset(c)
        for c in code.co_consts
        if isinstance(c, tuple) and c and all(isinstance(n, str) for n in c)
    }


def check_targets() -> None:
    """Raise CompatTargetMissing unless every patch target exists in the installed sglang and torch."""
    _host_kv_cache(_import(TARGETS[0]))
    _mha_module(_import(TARGETS[1]))
    if not isinstance(getattr(torch.cpu, "Stream", None), type):
        raise CompatTargetMissing("torch.cpu.Stream: not a class in this torch")


def _force_unpinned(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def init_unpinned(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **{**kwargs, "pin_memory": False})  # pin_memory is keyword-only

    setattr(init_unpinned, _MARK, True)
    return init_unpinned


def _patch_host_pool() -> None:
    cls = _host_kv_cache(_import(TARGETS[0]))
    if not getattr(cls.__init__, _MARK, False):
        cls.__init__ = _force_unpinned(cls.__init__)


def _patch_transfer() -> None:
    module = _mha_module(_import(TARGETS[1]))
    for target, fn, _ in DIRECT_COPIES:
        setattr(module, target.attribute, fn)


def _patch_cpu_stream() -> None:
    stream = torch.cpu.Stream
    for name, fn in (("synchronize", _stream_synchronize), ("query", _stream_query)):
        if not hasattr(stream, name):
            setattr(stream, name, fn)


def is_applied() -> bool:
    base, mha = importlib.import_module(BASE_MODULE), importlib.import_module(MHA_MODULE)
    return (
        getattr(base.HostKVCache.__init__, _MARK, False)
        and all(getattr(mha, target.attribute, None) is fn for target, fn, _ in DIRECT_COPIES)
        and hasattr(torch.cpu.Stream, "synchronize")
        and hasattr(torch.cpu.Stream, "query")
    )


def apply() -> bool:
    """Patch everything listed in the module docstring; returns False (and patches nothing) where CUDA
    is available. Idempotent. Raises CompatTargetMissing, naming the symbol, before patching anything
    if a target is missing."""
    if torch.cuda.is_available():
        return False
    check_targets()
    _patch_host_pool()
    _patch_transfer()
    _patch_cpu_stream()
    return True


def enabled_by_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether `SGL_HICACHE_CPU_HICACHE_COMPAT` (or its `SGLANG_` copy made by sglang) asks for the
    patches; raises ValueError on a value that is neither true nor false."""
    environ = os.environ if environ is None else environ
    name = ENV_VAR if ENV_VAR in environ else ENV_VAR_SGLANG_TWIN
    raw = environ.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name}={environ[name]!r}: expected 1/0 (true/false, yes/no, on/off)")
