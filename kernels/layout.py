"""The frozen view of a paged KV pool and the byte math of the packed layout.

Packed layout (the bytes the tier stores), page-major:

    for each page p (tokens slots[p*page_size : (p+1)*page_size], in the order of `slots`):
        for each layer l:
            MHA: K block [page_size, heads, head_dim] bytes, then V block [page_size, heads, v_head_dim]
            MLA: one block [page_size, 1, kv_lora_rank + qk_rope_head_dim]

Every page occupies `page_bytes(view)` bytes, including a partial last page (its missing rows are zero
padding), so the position of token i's rows depends on i alone, never on how many tokens were packed:
a prefix of pages is a prefix of bytes, and any prefix of the slots unpacks from the same buffer.
With page_size 1 the layout is token-major.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch


class KVKind(enum.Enum):
    MHA = "mha"  # a K and a V buffer per layer
    MLA = "mla"  # one compressed-KV buffer per layer


@dataclass(frozen=True, eq=False)  # identity equality: fields hold tensors
class KVPoolView:
    """Which tensors hold a paged KV pool and how; built once per pool, never mutated.

    `layers[l]` is `(k, v)` for MHA and `(kv,)` for MLA (local layer index: sglang's layer
    `start_layer + l`). Every buffer is a contiguous `[num_slots, heads, dim]` tensor on one device,
    indexed by KV slot. `dtype` is the logical KV dtype (e.g. float8_e4m3fn); the buffers may store it
    as another dtype of the same size (sglang stores fp8 as uint8). Bytes are moved, never values.
    """

    kind: KVKind
    layers: tuple[tuple[torch.Tensor, ...], ...]
    page_size: int
    dtype: torch.dtype
    heads: int
    head_dim: int
    v_head_dim: int | None = None  # MHA only; None means head_dim
    start_layer: int = 0

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if not self.layers:
            raise ValueError("a KV pool view needs at least one layer")
        per_layer = 2 if self.kind is KVKind.MHA else 1
        if any(len(layer) != per_layer for layer in self.layers):
            raise ValueError(f"{self.kind.name} layers hold {per_layer} buffer(s) each")
        if self.kind is KVKind.MLA and (self.heads != 1 or self.v_head_dim is not None):
            raise ValueError("MLA buffers have one head and no separate V")
        for i, buf in enumerate(self.buffers):
            self._check_buffer(i, buf)

    def _check_buffer(self, i: int, buf: torch.Tensor) -> None:
        dim = self.head_dim if i % 2 == 0 or self.kind is KVKind.MLA else self.value_dim
        first = self.buffers[0]
        if buf.dim() != 3 or tuple(buf.shape[1:]) != (self.heads, dim):
            raise ValueError(f"buffer {i}: shape {tuple(buf.shape)}, expected [slots, {self.heads}, {dim}]")
        if buf.shape[0] != first.shape[0] or buf.device != first.device:
            raise ValueError(f"buffer {i}: all buffers need the same slot count and device")
        if not buf.is_contiguous():
            raise ValueError(f"buffer {i} is not contiguous")
        if buf.element_size() != self.dtype.itemsize:
            raise ValueError(
                f"buffer {i}: stored as {buf.dtype}, not {self.dtype.itemsize}-byte {self.dtype}"
            )

    @property
    def value_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """All buffers in packing order: k0, v0, k1, v1, ... (MLA: kv0, kv1, ...)."""
        return tuple(buf for layer in self.layers for buf in layer)

    @property
    def device(self) -> torch.device:
        return self.layers[0][0].device

    @property
    def num_slots(self) -> int:
        return int(self.layers[0][0].shape[0])

    @property
    def row_bytes(self) -> tuple[int, ...]:
        """Bytes of one slot's row in each buffer, in packing order."""
        return tuple(buf[0].numel() * buf.element_size() for buf in self.buffers)

    @property
    def token_bytes(self) -> int:
        return sum(self.row_bytes)

    @property
    def block_offsets(self) -> tuple[int, ...]:
        """Byte offset of each buffer's block inside a packed page."""
        offsets, acc = [], 0
        for rb in self.row_bytes:
            offsets.append(acc)
            acc += self.page_size * rb
        return tuple(offsets)

    def byte_rows(self) -> tuple[torch.Tensor, ...]:
        """Each buffer as a uint8 `[num_slots, row_bytes]` view (shares memory)."""
        return tuple(buf.view(torch.uint8).view(self.num_slots, -1) for buf in self.buffers)

    @functools.cached_property
    def base_buffer(self) -> torch.Tensor:
        """The buffer at the lowest address: the kernels address every buffer from it."""
        return min(self.buffers, key=lambda b: b.data_ptr())

    @functools.cached_property
    def buffer_table(self) -> torch.Tensor:
        """int64 `[n_buffers, 3]` on the pool's device, one row per buffer in packing order:
        (byte offset of the buffer from `base_buffer`, row bytes, block offset in a packed page).
        Built once (the buffers of a live pool never move), so launches copy nothing host-to-device."""
        base = self.base_buffer.data_ptr()
        rows = [
            [buf.data_ptr() - base, rb, off]
            for buf, rb, off in zip(self.buffers, self.row_bytes, self.block_offsets, strict=True)
        ]
        return torch.tensor(rows, dtype=torch.int64).to(self.device)

    def alignment(self) -> int:
        """Largest of 16/8/4/2/1 bytes dividing every row and buffer address (16: 16-byte vectors)."""
        return common_alignment(self.row_bytes, [b.data_ptr() for b in self.buffers])


def common_alignment(sizes: tuple[int, ...] | list[int], addresses: list[int]) -> int:
    for unit in (16, 8, 4, 2):
        if all(s % unit == 0 for s in sizes) and all(a % unit == 0 for a in addresses):
            return unit
    return 1


def page_bytes(view: KVPoolView) -> int:
    """Bytes of one packed page: page_size tokens of every layer's K and V (MLA: KV)."""
    return view.page_size * view.token_bytes


def packed_nbytes(view: KVPoolView, n_tokens: int) -> int:
    """Bytes that `n_tokens` tokens occupy packed: whole pages, a partial last page padded."""
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    return -(-n_tokens // view.page_size) * page_bytes(view)
