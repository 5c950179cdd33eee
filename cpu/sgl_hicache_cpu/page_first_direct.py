"""Plain-torch versions of sgl_kernel's two `page_first_direct` KV copies, for HiCache on CPU.

sglang's HiCache puts its host pool in the `page_first_direct` layout whenever its L3 is `mooncake`
with the `direct` I/O backend (`arg_groups/hicache_hook.py`: a whole page of every layer is one
object in the store). The MHA host pool then moves KV with two functions it imports from
`sgl_kernel.kvcacheio` only on CUDA/ROCm/XPU (`pool_host/mha.py`), so on CPU they are missing:

- `transfer_kv_per_layer_direct_pf_lf`: host (page first) -> device (layer first), one layer;
- `transfer_kv_all_layer_direct_lf_pf`: device (layer first) -> host (page first), every layer.

A page-first host buffer is `[pages, layers, page_size, *row]` (one per component: K and V for
MHA, the latent alone for MLA); a device buffer is one layer's `[rows, *row]`. Index lists are
token rows in whole pages, as sgl_kernel's `transfer_kv_page_first_direct_impl` takes them
(sgl-kernel/csrc/kvcacheio/transfer.cu): the host side of page `i` is page
`indices[i * page_size] // page_size`, the device side the `page_size` rows from
`indices[i * page_size]`. The kernel trusts the rest of each page's indices; these copies check
them instead (a host page must be aligned, each page's rows consecutive on both sides) and raise
ValueError for anything else, so an index list they do not implement is refused, never copied
somewhere else. Each call is one gather and one scatter per component and layer (no Python loop
over pages). `sgl_hicache_cpu.hicache_cpu_compat` installs them into sglang.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class _Pages(NamedTuple):
    host: torch.Tensor  # page numbers in the page-first buffers
    device: torch.Tensor  # the device rows of those pages, page after page


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """Host -> device for layers `layer_id ..`: `dst_ptrs` is `[K of each layer, V of each layer]`
    (MHA: `src_ptrs` = `[K, V]` page-first buffers) or `[latent of each layer]` (MLA: one buffer);
    the call sglang makes per layer passes one layer (`[device_k, device_v]`)."""
    name = "transfer_kv_per_layer_direct_pf_lf"
    layers = _check_buffers(name, src_ptrs, dst_ptrs, layer_id, page_size)
    pages = _pages(name, src_ptrs, dst_ptrs, src_indices, dst_indices, page_size, host_is_src=True)
    for c, host in enumerate(src_ptrs):
        for j in range(layers):
            device = dst_ptrs[c * layers + j]
            rows = host[:, layer_id + j].index_select(0, pages.host)
            device.index_copy_(0, pages.device, rows.reshape(-1, *device.shape[1:]))


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Device -> host for every layer: `src_ptrs` is `[K of each layer, V of each layer]` (MHA:
    `dst_ptrs` = `[K, V]` page-first buffers) or `[latent of each layer]` (MLA: one buffer)."""
    name = "transfer_kv_all_layer_direct_lf_pf"
    layers = _check_buffers(name, dst_ptrs, src_ptrs, 0, page_size)
    pages = _pages(name, dst_ptrs, src_ptrs, dst_indices, src_indices, page_size, host_is_src=False)
    for c, host in enumerate(dst_ptrs):
        for j in range(layers):
            device = src_ptrs[c * layers + j]
            rows = device.index_select(0, pages.device).view(-1, *host.shape[2:])
            host[:, j].index_copy_(0, pages.host, rows)


def _check_buffers(
    name: str, host: Sequence[torch.Tensor], device: Sequence[torch.Tensor], first: int, page_size: int
) -> int:
    """Layers per component; ValueError unless every buffer fits the others (nothing copied yet)."""
    if page_size <= 0:
        raise ValueError(f"{name}: page size {page_size}")
    if len(host) not in (1, 2) or not device or len(device) % len(host):
        raise ValueError(
            f"{name}: {len(host)} page-first buffers (1: MLA, 2: K and V) for {len(device)} device layers"
        )
    layers = len(device) // len(host)
    for c, buf in enumerate(host):
        if buf.dim() < 3 or buf.shape[2] != page_size or first < 0 or first + layers > buf.shape[1]:
            raise ValueError(
                f"{name}: layers {first}..{first + layers - 1} in pages of {page_size} of a page-first "
                f"buffer {tuple(buf.shape)}"
            )
        for dev in device[c * layers : (c + 1) * layers]:
            if buf.shape[3:] != dev.shape[1:] or buf.dtype != dev.dtype:
                raise ValueError(
                    f"{name}: host rows {tuple(buf.shape[3:])} {buf.dtype}, device rows "
                    f"{tuple(dev.shape[1:])} {dev.dtype}"
                )
    return layers


def _pages(
    name: str,
    host_bufs: Sequence[torch.Tensor],
    device_bufs: Sequence[torch.Tensor],
    host: torch.Tensor,
    device: torch.Tensor,
    page_size: int,
    *,
    host_is_src: bool,
) -> _Pages:
    """The pages of the index lists; ValueError unless they are whole pages inside the buffers."""
    n = host.numel()
    if device.numel() != n:
        src, dst = (n, device.numel()) if host_is_src else (device.numel(), n)
        raise ValueError(f"{name}: {src} source indices, {dst} destination")
    if n % page_size:
        raise ValueError(f"{name}: {n} indices are not whole pages of {page_size}")
    h = host.to("cpu", torch.int64).view(-1, page_size)
    d = device.to("cpu", torch.int64).view(-1, page_size)
    step = torch.arange(page_size)
    if not torch.equal(h - h[:, :1], step.expand_as(h)) or bool((h[:, 0] % page_size).any()):
        raise ValueError(f"{name}: host indices are not whole aligned pages of {page_size}")
    if not torch.equal(d - d[:, :1], step.expand_as(d)):
        raise ValueError(f"{name}: device indices are not pages of {page_size} consecutive rows")
    pages, rows = min(b.shape[0] for b in host_bufs), min(b.shape[0] for b in device_bufs)
    if n and (h.min() < 0 or h.max() >= pages * page_size or d.min() < 0 or d.max() >= rows):
        raise ValueError(f"{name}: indices outside the buffers ({pages} host pages, {rows} device rows)")
    return _Pages(h[:, 0] // page_size, d.flatten())
