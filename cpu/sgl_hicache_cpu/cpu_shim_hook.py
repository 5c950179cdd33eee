"""Serves `sgl_hicache_cpu.sgl_kernel_cpu_shim` as `sgl_kernel` when no real build can be had.

`install()` appends a finder to the *end* of `sys.meta_path`, so it is consulted only after every
normal finder failed to find `sgl_kernel`: an installed sgl-kernel build always wins. The finder also
declines when torch sees a CUDA/ROCm device (a GPU machine must use the real kernels).

sglang imports `sgl_kernel` while its scheduler modules are imported, before its plugin hook
(`load_plugins()`) runs, in processes it spawns. So the finder is installed at interpreter start by
a one-line `sgl_hicache_cpu_shim.pth` in site-packages, which the CPU profile's setup writes with
`python -m sgl_hicache_cpu.install_cpu_shim` (GPU installs never write it). Installing it costs
no import of torch: torch is only consulted when `sgl_kernel` is actually looked for.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

SHIMMED = "sgl_kernel"
SHIM_MODULE = "sgl_hicache_cpu.sgl_kernel_cpu_shim"


def gpu_present() -> bool:
    import torch

    return bool(torch.cuda.is_available())


class SglKernelCpuShimFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != SHIMMED or gpu_present():
            return None
        return importlib.machinery.ModuleSpec(fullname, self, origin=SHIM_MODULE)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(SHIM_MODULE)

    def exec_module(self, module: ModuleType) -> None:
        return None


def install() -> None:
    """Idempotent: at most one shim finder is ever on `sys.meta_path`."""
    if not any(isinstance(f, SglKernelCpuShimFinder) for f in sys.meta_path):
        sys.meta_path.append(SglKernelCpuShimFinder())
