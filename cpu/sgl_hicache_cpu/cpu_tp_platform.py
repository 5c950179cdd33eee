"""sglang's CPU platform as an out-of-tree platform, so that `--tp-size N` runs on CPU (sglang 0.5.23).

Why: every model-parallel group gets a PyNccl communicator unless the current platform is out of
tree and declares `capabilities.supports_pynccl=False` (`init_model_parallel_group`,
distributed/parallel_state.py:2180-2185). With the CUDA build of torch (which sglang's dependencies
bring) `libnccl.so.2` loads, so on a machine without a GPU `PyNcclCommunicator` reaches
`torch.cuda.device(cpu)` and start-up stops with "Expected a cuda device, but got: cpu"
(pynccl.py:116). (With a CPU build of torch the NCCL library is missing and PyNccl switches itself
off, which is why sglang's own CPU TP works there.) Without PyNccl, CPU all-reduce is gloo's
`torch.distributed.all_reduce` (`GroupCoordinator.all_reduce`, or sgl_kernel's shm all-reduce where
AMX/arm64 is present).

`CpuTPPlatform` is `CpuSRTPlatform` with `is_out_of_tree()` true. Being out of tree is all the seam
needs (`supports_pynccl` is False in CPU's capabilities already; it is restated). But sglang asks an
out-of-tree platform about more than PyNccl, so each such question reachable on CPU is answered as
sglang answers it in tree for CPU (`MIRRORS` names each site); `check_targets` verifies they exist:

- dispatch key (kernels/fused_op.py `_oot_dispatch_key`): None, so `BaseFusedOp` resolves its
  forward exactly as in tree (kernel backends, then `forward_cpu` with AMX, then native);
- default attention backend (arg_groups/model_override_base.py): as `handle_cpu_backends`;
- decode graph runner (cuda_graph_setup.py): `CPUGraphRunner`, used with `--enable-torch-compile`;
- memory capacity (utils/common.py `get_device_memory_capacity`): `get_cpu_memory_capacity()`, so
  memory-derived defaults (chunked prefill, graph batch sizes) are the same;
- server-args defaults: `disable_custom_all_reduce=True`. Custom all-reduce is CUDA/ROCm only
  (`dispatch_custom_allreduce` asserts ROCm off CUDA); left on, every TP group would log its failed
  set-up as a warning. The resolved server arguments are otherwise the in-tree platform's.

(The piecewise-compilation backend is not mirrored: `sglang.srt.compilation.backend` does not import
without CUDA, XPU or NPU, so that path is closed to CPU in tree as well.)

Still different from the in-tree CPU platform, because sglang has no seam for them: features that
refuse out-of-tree platforms (speculative decoding, KV-cache sharding, the unified memory pool,
fp4/mxfp8 KV, DeepSeek-V4/MiniMax/HiSparse pools, `prefill_only_disable_kv_cache`), custom ops
registered for PrivateUse1 instead of CUDA (neither serves CPU tensors), and a weight update asking
`recapture_cuda_graph` re-runs decode-graph set-up (which captures nothing on CPU without torch compile).

Selection (`activate`, entry-point group `sglang.srt.platforms`, name `PLATFORM_NAME`): sglang loads
every platform plugin and uses the one that activates, or a built-in platform when none does
(platforms/__init__.py `_resolve_platform`). This one activates only when asked by name
(`SGLANG_PLATFORM=sgl_hicache_cpu`, which sglang also uses to load no other platform plugin), with
`SGLANG_USE_CPU_ENGINE=1` and no GPU; otherwise it declines and sglang is unaffected. Our launcher and
`ServerProcess` ask for it for `--device cpu --tp-size N>1` (`sgl_hicache_cpu.cpu_tp_env`).
`check_targets` runs at the two load points sglang gives a platform, argument resolution in the
launcher and `init_backend` in each worker, not in `activate` (see there).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
from sglang.srt.platforms.cpu import CpuSRTPlatform

logger = logging.getLogger(__name__)

PLATFORM_NAME = "sgl_hicache_cpu"  # the entry point's name in pyproject.toml
QUALNAME = f"{__name__}.CpuTPPlatform"


class PlatformTargetMissing(RuntimeError):
    """Something this platform relies on is not what sglang 0.5.23 has (the message names it)."""


@dataclass(frozen=True)
class Mirror:
    """An sglang function that asks out-of-tree platforms `asks` where it answers in tree for CPU."""

    module: str
    function: str
    asks: str  # a name its code uses, proving it still consults the platform

    @property
    def name(self) -> str:
        return f"{self.module}.{self.function}"


MIRRORS = (
    Mirror("sglang.srt.distributed.parallel_state", "init_model_parallel_group", "supports_pynccl"),
    Mirror("sglang.kernels.fused_op", "BaseFusedOp._resolve_forward_method", "_oot_dispatch_key"),
    Mirror("sglang.kernels.fused_op", "_oot_dispatch_key", "get_dispatch_key_name"),
    Mirror("sglang.srt.arg_groups.model_override_base", "get_default_attn_backend",
           "get_default_attention_backend"),
    Mirror("sglang.srt.model_executor.model_runner_components.cuda_graph_setup", "capture_decode_graph",
           "get_graph_runner_cls"),
    Mirror("sglang.srt.utils.common", "get_device_memory_capacity", "get_device_total_memory"),
    Mirror("sglang.srt.arg_groups.platform_hook", "handle_platform_defaults", "apply_server_args_defaults"),
)  # fmt: skip

# What the overrides return or call, as (module, attribute).
IN_TREE_ANSWERS = (
    ("sglang.srt.model_executor.cpu_graph_runner", "CPUGraphRunner"),
    ("sglang.srt.utils.common", "get_cpu_memory_capacity"),
    ("sglang.srt.utils.common", "is_host_cpu_arm64"),
)
OVERRIDDEN = (
    "is_out_of_tree", "get_dispatch_key_name", "get_default_attention_backend", "get_graph_runner_cls",
    "get_device_total_memory", "apply_server_args_defaults", "init_backend",
)  # fmt: skip


class CpuTPPlatform(CpuSRTPlatform):
    capabilities = msgspec.structs.replace(CpuSRTPlatform.capabilities, supports_pynccl=False)

    def is_out_of_tree(self) -> bool:
        return True

    def get_dispatch_key_name(self) -> str | None:  # type: ignore[override]
        return None

    def get_default_attention_backend(self) -> str:
        from sglang.srt.utils.common import is_host_cpu_arm64

        return "torch_native" if is_host_cpu_arm64() else "intel_amx"

    def get_graph_runner_cls(self) -> type | None:
        from sglang.srt.model_executor.cpu_graph_runner import CPUGraphRunner

        return CPUGraphRunner  # type: ignore[no-any-return]

    def get_device_total_memory(self, device_id: int = 0) -> int:
        """The per-rank capacity sglang assumes for CPU in tree, in bytes; 0 when unknown (sglang
        reads 0 as "no capacity known", as its in-tree `None`)."""
        from sglang.srt.utils.common import get_cpu_memory_capacity

        mib = get_cpu_memory_capacity()
        return 0 if mib is None else int(mib) << 20

    def apply_server_args_defaults(self, server_args: Any) -> None:
        check_targets()  # the launcher's load point: sglang resolves its arguments here
        server_args.disable_custom_all_reduce = True

    def init_backend(self) -> None:
        check_targets()  # a worker's load point: sglang calls it while importing its model runner


def _resolve(module: str, dotted: str) -> Any:
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as e:
        raise PlatformTargetMissing(f"{module}.{dotted}: module does not import ({e})") from e
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise PlatformTargetMissing(f"{module}.{dotted}: not found")
    return obj


def _check_mirror(mirror: Mirror) -> None:
    code = getattr(inspect.unwrap(_resolve(mirror.module, mirror.function)), "__code__", None)
    if code is None or mirror.asks not in code.co_names:
        raise PlatformTargetMissing(f"{mirror.name}: no longer consults the platform's {mirror.asks}")


def _check_overrides() -> None:
    from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform

    if "supports_pynccl" not in PlatformCapabilities.__struct_fields__:
        raise PlatformTargetMissing(
            "sglang.srt.platforms.interface.PlatformCapabilities.supports_pynccl: gone"
        )
    for name in OVERRIDDEN:
        base = getattr(SRTPlatform, name, None)
        ours = inspect.signature(getattr(CpuTPPlatform, name)).parameters
        if base is None or list(inspect.signature(base).parameters) != list(ours):
            raise PlatformTargetMissing(
                f"sglang.srt.platforms.interface.SRTPlatform.{name}: signature changed"
            )


def check_targets() -> None:
    """Raise PlatformTargetMissing, naming the symbol, unless every out-of-tree question this platform
    answers (`MIRRORS`), every method it overrides and every in-tree answer it returns is as in
    sglang 0.5.23."""
    _check_overrides()
    for mirror in MIRRORS:
        _check_mirror(mirror)
    for module, attribute in IN_TREE_ANSWERS:
        _resolve(module, attribute)


def accelerator_present() -> bool:
    xpu, npu = getattr(torch, "xpu", None), getattr(torch, "npu", None)
    return bool(
        torch.cuda.is_available()
        or (xpu is not None and xpu.is_available())
        or (npu is not None and npu.is_available())
    )


def activate() -> str | None:
    """sglang's platform-plugin hook: this platform's qualified name, or None to decline (module
    docstring, "Selection"). It runs while `import sglang` is still under way (utils/common.py
    resolves the platform at import), so it imports nothing; the targets are checked later."""
    if os.environ.get("SGLANG_PLATFORM") != PLATFORM_NAME:
        return None
    if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        logger.warning("%s declines: SGLANG_USE_CPU_ENGINE=1 is not set", PLATFORM_NAME)
        return None
    if accelerator_present():
        logger.warning(
            "%s declines: this machine has a GPU; CPU tensor parallelism is not for it", PLATFORM_NAME
        )
        return None
    return QUALNAME
