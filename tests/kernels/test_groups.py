"""The layer-grouped packed layout (format v6): pack, unpack, prefixes and one group alone, for both
backends, against a reference written out layer by layer here.

The Triton cases run on a GPU (marker `gpu`) or under TRITON_INTERPRET=1 (marker `interpret`, in the
child pytest of test_interpret.py).
"""

from __future__ import annotations

import os

import pytest
import torch
from sgl_hicache_kernels import KVKind, KVPoolView, default_group_layers, pack_kv, packed_nbytes, unpack_kv

from .kv_factory import FP8, byte_rows, fresh_like, make_slots, make_view

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_DEVICE = "cpu" if INTERPRET else ("cuda" if torch.cuda.is_available() else None)
triton_case = pytest.mark.skipif(
    TRITON_DEVICE is None, reason="Triton path needs a GPU or TRITON_INTERPRET=1"
)
triton_mark = pytest.mark.interpret if TRITON_DEVICE != "cuda" else pytest.mark.gpu
BACKENDS = ["torch", pytest.param("triton", marks=[triton_mark, triton_case])]
LAYERS = 5


def ref_grouped(view: KVPoolView, slots: torch.Tensor, group_layers: int) -> torch.Tensor:
    """For each group of `group_layers` layers: every page of `slots`, each page every layer of the
    group (K block then V block), a partial last page zero padded. Loops, obviously right."""
    ps, rows = view.page_size, byte_rows(view)
    per_layer = len(rows) // len(view.layers)
    out: list[torch.Tensor] = []
    for lo in range(0, len(view.layers), group_layers):
        group_rows = rows[lo * per_layer : min(len(view.layers), lo + group_layers) * per_layer]
        for start in range(0, slots.numel(), ps):
            page = slots[start : start + ps]
            for r in group_rows:
                block = torch.zeros(ps, r.shape[1], dtype=torch.uint8, device=r.device)
                block[: page.numel()] = r[page]
                out.append(block.flatten())
    return torch.cat(out) if out else torch.empty(0, dtype=torch.uint8)


def device_for(backend: str) -> str:
    return (TRITON_DEVICE or "cpu") if backend == "triton" else "cpu"


def view_for(kind: KVKind, dtype: torch.dtype, page_size: int, device: str) -> KVPoolView:
    heads, dim = (1, 576) if kind is KVKind.MLA else (2, 64)
    return make_view(kind, dtype, heads, dim, page_size=page_size, num_slots=8 * page_size + 70,
                     layers=LAYERS, device=device)  # fmt: skip


CASES = [(KVKind.MHA, torch.bfloat16), (KVKind.MHA, FP8), (KVKind.MLA, torch.bfloat16)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("group_layers", [1, 2, 3, 4, LAYERS, 0])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].value}-{c[1]}")
def test_grouped_pack_matches_reference(backend: str, group_layers: int, page_size: int, case: tuple) -> None:
    view = view_for(*case, page_size, device_for(backend))
    slots = make_slots("pages" if page_size > 1 else "scattered", 37, view)
    out = torch.full((packed_nbytes(view, 37) + 3,), 0xAB, dtype=torch.uint8, device=view.device)
    pack_kv(view, slots, out, backend=backend, group_layers=group_layers)  # type: ignore[arg-type]
    expected = ref_grouped(view, slots.cpu(), group_layers or LAYERS).to(view.device)
    assert expected.numel() == packed_nbytes(view, 37)  # the same bytes as page-major, rearranged
    assert torch.equal(out[: expected.numel()], expected)
    assert torch.equal(out[expected.numel() :], torch.full((3,), 0xAB, dtype=torch.uint8, device=view.device))


def test_whole_groups_are_the_page_major_layout() -> None:
    view = view_for(KVKind.MHA, torch.float16, 4, "cpu")
    slots = make_slots("pages", 21, view)
    a = torch.empty(packed_nbytes(view, 21), dtype=torch.uint8)
    b = torch.empty_like(a)
    pack_kv(view, slots, a)
    pack_kv(view, slots, b, group_layers=LAYERS)
    assert torch.equal(a, b) and view.groups(0) is view.groups(LAYERS) and view.groups(0).count == 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_grouped_prefix_and_one_group_alone(backend: str, page_size: int) -> None:
    """Any page prefix of an extent's slots unpacks from the whole extent's buffer (its token count
    given), and one group unpacks its own layers only, leaving the others untouched."""
    view = view_for(KVKind.MHA, torch.bfloat16, page_size, device_for(backend))
    groups = view.groups(2)
    assert groups.ranges == ((0, 2), (2, 4), (4, 5))
    n = 3 * page_size + 5
    slots = make_slots("pages" if page_size > 1 else "scattered", n, view)
    packed = torch.empty(packed_nbytes(view, n), dtype=torch.uint8, device=view.device)
    pack_kv(view, slots, packed, backend=backend, group_layers=2)  # type: ignore[arg-type]
    for m in sorted({page_size, 2 * page_size, n}):
        restored = fresh_like(view)
        unpack_kv(restored, slots[:m], packed, backend=backend, group_layers=2, packed_tokens=n)  # type: ignore[arg-type]
        for src, dst in zip(byte_rows(view), byte_rows(restored), strict=True):
            assert torch.equal(dst[slots[:m]], src[slots[:m]])
            untouched = torch.ones(view.num_slots, dtype=torch.bool, device=view.device)
            untouched[slots[:m]] = False
            assert not dst[untouched].any()
    for g, (lo, hi) in enumerate(groups.ranges):
        restored = fresh_like(view)
        unpack_kv(restored, slots, packed, backend=backend, group_layers=2, packed_tokens=n, group=g)  # type: ignore[arg-type]
        for layer in range(LAYERS):
            for src, dst in zip(view.layers[layer], restored.layers[layer], strict=True):
                a, b = src.view(torch.uint8).flatten(1), dst.view(torch.uint8).flatten(1)
                assert torch.equal(b[slots], a[slots]) if lo <= layer < hi else not b.any()


def test_group_byte_math() -> None:
    view = view_for(KVKind.MHA, torch.bfloat16, 4, "cpu")
    groups = view.groups(2)
    per_layer = packed_nbytes(view, 4) // LAYERS  # one page of one layer
    assert [groups.section(g, 9) for g in range(3)] == [
        (0, 3 * 2 * per_layer), (6 * per_layer, 12 * per_layer), (12 * per_layer, 15 * per_layer)
    ]  # fmt: skip
    assert groups.span(1, 9, 4, 9) == (6 * per_layer + 2 * per_layer, 12 * per_layer)
    assert groups.landed(9, 7 * per_layer) == [9, 0, 0]  # group 1 holds less than one page
    assert groups.landed(9, 8 * per_layer) == [9, 4, 0]
    assert groups.landed(9, 15 * per_layer) == [9, 9, 9]
    assert [groups.group_of(layer) for layer in range(LAYERS)] == [0, 0, 1, 1, 2]
    with pytest.raises(ValueError, match="page-aligned"):
        groups.span(0, 9, 2, 4)
    assert default_group_layers(32) == 8 and default_group_layers(5) == 2 and default_group_layers(2) == 1
    sub = view.layer_range(2, 4)
    assert sub.start_layer == 2 and sub.layers == view.layers[2:4]
