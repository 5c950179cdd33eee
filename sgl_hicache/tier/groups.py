"""Layer groups (format v6): a payload of whole pages cut into sections of `g` layers each, each
section into chunks; and the rearrangement of a payload from one grouping to another."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

import numpy as np


def normal_groups(group_layers: int, num_layers: int) -> int:
    """Layers per group, 0 or at least `num_layers` (one group: page-major) as `num_layers`."""
    return group_layers if 0 < group_layers < num_layers else num_layers


def section_lengths(payload_len: int, token_count: int, page_size: int, num_layers: int,
                    group_layers: int) -> tuple[int, ...]:  # fmt: skip
    """Raw bytes of each layer group's section of a payload of `token_count` tokens (whole pages of
    `num_layers` equal layers). Page-major (`group_layers` 0 or >= num_layers): one section, any
    length. Raises ValueError if a grouped payload is not whole pages of equal layers."""
    g = normal_groups(group_layers, num_layers)
    if g == num_layers:
        return (payload_len,)
    pages = -(-token_count // page_size)
    if pages == 0 or payload_len % (pages * num_layers):
        raise ValueError(f"a payload of {payload_len} B is not {pages} pages of {num_layers} equal layers")
    layer = payload_len // (pages * num_layers)
    return tuple(pages * layer * (min(num_layers, lo + g) - lo) for lo in range(0, num_layers, g))


def chunk_total(sections: Sequence[int], chunk_bytes: int) -> int:
    """How many chunks `chunk_spans` cuts, counted without building them (a header read without its
    MAC may claim any length)."""
    return sum(-(-length // chunk_bytes) for length in sections)


def chunk_spans(sections: Sequence[int], chunk_bytes: int) -> list[tuple[int, int]]:
    """(raw offset, raw length) of each chunk: every section cut into `chunk_bytes` pieces."""
    out: list[tuple[int, int]] = []
    start = 0
    for length in sections:
        out.extend((start + o, min(chunk_bytes, length - o)) for o in range(0, length, chunk_bytes))
        start += length
    return out


def section_of(sections: Sequence[int], offsets: Sequence[int]) -> list[int]:
    """The section (layer group) each raw payload offset lies in, for a payload cut into `sections`."""
    ends = list(itertools.accumulate(sections))
    return [bisect.bisect_right(ends, offset) for offset in offsets]


def regroup(buf: memoryview, pages: int, num_layers: int, src_groups: int, dst_groups: int) -> None:
    """Rearrange `buf` (`pages` whole pages of `num_layers` equal layers, laid out in groups of
    `src_groups` layers) in place into groups of `dst_groups` (0: page-major). Raises ValueError if
    `buf` is not whole pages of equal layers."""
    src, dst = normal_groups(src_groups, num_layers), normal_groups(dst_groups, num_layers)
    if src == dst or not buf.nbytes:
        return
    if pages <= 0 or buf.nbytes % (pages * num_layers):
        raise ValueError(f"{buf.nbytes} B are not {pages} pages of {num_layers} equal layers")
    raw = np.frombuffer(buf, dtype=np.uint8)
    layer = buf.nbytes // (pages * num_layers)
    canon = np.empty((pages, num_layers, layer), dtype=np.uint8)  # [page, layer, bytes]
    _sections(raw, pages, num_layers, layer, src, canon, read=True)
    out = np.empty_like(raw)
    _sections(out, pages, num_layers, layer, dst, canon, read=False)
    raw[:] = out


def _sections(flat: np.ndarray, pages: int, num_layers: int, layer: int, groups: int, canon: np.ndarray,
              read: bool) -> None:  # fmt: skip
    start = 0
    for lo in range(0, num_layers, groups):
        hi = min(num_layers, lo + groups)
        n = pages * (hi - lo) * layer
        section = flat[start : start + n].reshape(pages, hi - lo, layer)
        if read:
            canon[:, lo:hi] = section
        else:
            section[...] = canon[:, lo:hi]
        start += n
