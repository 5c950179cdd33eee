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

Layer-grouped layout (`LayerGroups`, format v6): the layers are cut into groups of `group_layers`
consecutive layers (the last may be shorter), and the packed bytes of n tokens are one section per
group, back to back, each the page-major layout above of its own layers only (a sub-view,
`KVPoolView.layer_range`). A load can then finish and verify group 0 before group 1 (layer-wise
restore), and a prefix of pages is a prefix of every section. One group of every layer is exactly
the page-major layout.
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

    @functools.cached_property
    def _group_layouts(self) -> dict[int, LayerGroups]:
        return {}

    def groups(self, group_layers: int) -> LayerGroups:
        """The layer-grouped layout of this view with `group_layers` layers per group (0, or at least
        every layer: one group, the page-major layout). Built once per value."""
        n = len(self.layers)
        key = group_layers if 0 < group_layers < n else n
        if key not in self._group_layouts:
            self._group_layouts[key] = LayerGroups(self, key)
        return self._group_layouts[key]

    def layer_range(self, lo: int, hi: int) -> KVPoolView:
        """The view of layers [lo, hi) only (local indices; sglang's `start_layer + lo` first)."""
        if not 0 <= lo < hi <= len(self.layers):
            raise ValueError(f"layer range [{lo}, {hi}) outside [0, {len(self.layers)})")
        if (lo, hi) == (0, len(self.layers)):
            return self
        return KVPoolView(self.kind, self.layers[lo:hi], self.page_size, self.dtype, self.heads, self.head_dim,
                          self.v_head_dim, self.start_layer + lo)  # fmt: skip

    def alignment(self) -> int:
        """Largest of 16/8/4/2/1 bytes dividing every row and buffer address (16: 16-byte vectors)."""
        return common_alignment(self.row_bytes, [b.data_ptr() for b in self.buffers])


DEFAULT_LAYER_GROUPS = 4
"""Extents are written in this many layer groups (format v6): a layer-wise restore can start the
forward once the first quarter of the layers has landed."""


def default_group_layers(num_layers: int, groups: int = DEFAULT_LAYER_GROUPS) -> int:
    """Layers per group for at most `groups` groups of `num_layers` layers: ceil(num_layers / groups)."""
    return max(1, -(-num_layers // max(1, groups)))


class LayerGroups:
    """The layer-grouped packed layout of one view (see the module doc). Group g holds local layers
    `ranges[g]`; its section in a packed buffer of n tokens starts after the sections of the groups
    before it, each `ceil(n / page_size)` pages of its own layers."""

    def __init__(self, view: KVPoolView, group_layers: int) -> None:
        n = len(view.layers)
        self.view = view
        self.group_layers = group_layers if 0 < group_layers < n else n
        self.ranges = tuple((lo, min(n, lo + self.group_layers)) for lo in range(0, n, self.group_layers))
        self.subviews = tuple(view.layer_range(lo, hi) for lo, hi in self.ranges)
        self.page_bytes = tuple(page_bytes(sub) for sub in self.subviews)
        self._before = tuple(sum(self.page_bytes[:g]) for g in range(len(self.ranges)))

    @property
    def count(self) -> int:
        return len(self.ranges)

    def group_of(self, layer: int) -> int:
        """The group of local layer `layer`."""
        return min(self.count - 1, max(0, layer) // self.group_layers)

    def section(self, group: int, n_tokens: int) -> tuple[int, int]:
        """Byte range of `group`'s section in a packed buffer of `n_tokens` tokens."""
        pages = -(-n_tokens // self.view.page_size)
        start = pages * self._before[group]
        return start, start + pages * self.page_bytes[group]

    def span(self, group: int, n_tokens: int, first: int, end: int) -> tuple[int, int]:
        """Byte range of tokens [first, end) of `group` in a packed buffer of `n_tokens` tokens
        (`first` a multiple of the page size): a packed buffer of the group's sub-view on its own."""
        if first % self.view.page_size or not 0 <= first <= end <= n_tokens:
            raise ValueError(f"tokens [{first}, {end}) of {n_tokens}: not a page-aligned range")
        start = self.section(group, n_tokens)[0]
        sub = self.subviews[group]
        return start + packed_nbytes(sub, first), start + packed_nbytes(sub, end)

    def landed(self, n_tokens: int, nbytes: int) -> list[int]:
        """Per group, how many leading tokens lie within the first `nbytes` bytes of a packed buffer
        of `n_tokens` tokens (whole pages, or all of them)."""
        out = []
        for g in range(self.count):
            start, end = self.section(g, n_tokens)
            pages = max(0, min(nbytes, end) - start) // self.page_bytes[g] if end > start else 0
            out.append(n_tokens if nbytes >= end else min(n_tokens, pages * self.view.page_size))
        return out


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
