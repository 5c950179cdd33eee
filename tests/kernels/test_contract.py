"""Defined behaviour at the edges: empty input, argument errors, duplicates, granularity, byte math."""

from __future__ import annotations

import os

import pytest
import torch
from sgl_hicache_kernels import KVKind, KVPoolView, pack_kv, packed_nbytes, page_bytes, unpack_kv
from sgl_hicache_kernels.plan import plan_copy

from .kv_factory import FP8, fresh_like, make_slots, make_view


@pytest.fixture
def view() -> KVPoolView:
    return make_view(KVKind.MHA, torch.bfloat16, 2, 64, page_size=4, num_slots=30)


def out_for(view: KVPoolView, n: int) -> torch.Tensor:
    return torch.zeros(packed_nbytes(view, n), dtype=torch.uint8)


def test_byte_math_mha() -> None:
    view = make_view(KVKind.MHA, torch.bfloat16, 2, 128, v_head_dim=64, page_size=16, num_slots=40, layers=3)
    assert view.row_bytes == (512, 256) * 3 and view.token_bytes == 3 * 768
    assert page_bytes(view) == 16 * 3 * 768
    assert view.block_offsets == (
        0,
        16 * 512,
        16 * 768,
        16 * 768 + 16 * 512,
        2 * 16 * 768,
        2 * 16 * 768 + 16 * 512,
    )
    assert [packed_nbytes(view, n) for n in (0, 1, 16, 17)] == [
        0,
        page_bytes(view),
        page_bytes(view),
        2 * page_bytes(view),
    ]


def test_byte_math_mla_fp8() -> None:
    view = make_view(KVKind.MLA, FP8, 1, 576, page_size=1, num_slots=10, layers=4)
    assert view.token_bytes == 4 * 576 and page_bytes(view) == 4 * 576
    assert packed_nbytes(view, 7) == 7 * 4 * 576


def test_view_rejects_inconsistent_buffers() -> None:
    k, v = torch.zeros(10, 2, 64, dtype=torch.bfloat16), torch.zeros(10, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="shape"):
        KVPoolView(KVKind.MHA, ((k, v),), 1, torch.bfloat16, 2, 128)
    with pytest.raises(ValueError, match="same slot count"):
        KVPoolView(KVKind.MHA, ((k, v[:9]),), 1, torch.bfloat16, 2, 64)
    with pytest.raises(ValueError, match="contiguous"):
        KVPoolView(
            KVKind.MHA, ((k, v.transpose(0, 1).contiguous().transpose(0, 1)),), 1, torch.bfloat16, 2, 64
        )
    with pytest.raises(ValueError, match="byte"):
        KVPoolView(KVKind.MHA, ((k, v),), 1, torch.float32, 2, 64)
    with pytest.raises(ValueError, match="page_size"):
        KVPoolView(KVKind.MHA, ((k, v),), 0, torch.bfloat16, 2, 64)
    with pytest.raises(ValueError, match="buffer"):
        KVPoolView(KVKind.MLA, ((k, v),), 1, torch.bfloat16, 1, 64)


def test_empty_slots_are_a_no_op(view: KVPoolView) -> None:
    empty = torch.empty(0, dtype=torch.int64)
    out = torch.full((8,), 7, dtype=torch.uint8)
    pack_kv(view, empty, out)
    unpack_kv(view, empty, out[:0])
    assert torch.equal(out, torch.full((8,), 7, dtype=torch.uint8))


def test_unsorted_slots_define_packed_order(view: KVPoolView) -> None:
    slots = torch.tensor([9, 2, 5])
    out = out_for(view, 3)
    pack_kv(view, slots, out)
    reversed_out = out_for(view, 3)
    pack_kv(view, slots.flip(0), reversed_out)
    page = out.view(-1, 4, 2 * 64 * 2)  # [page blocks of layer-0 K ...]: first block's rows are tokens 0..3
    assert torch.equal(page[0, 0], view.layers[0][0][9].view(torch.uint8).flatten())
    assert torch.equal(page[0, 2], view.layers[0][0][5].view(torch.uint8).flatten())
    assert not torch.equal(out, reversed_out)


def test_duplicate_slots_rejected_in_unpack_only(view: KVPoolView) -> None:
    slots = torch.tensor([3, 8, 3])
    out = out_for(view, 3)
    pack_kv(view, slots, out)  # a gather may repeat a slot
    with pytest.raises(ValueError, match="duplicate"):
        unpack_kv(fresh_like(view), slots, out)


@pytest.mark.parametrize("bad", [[-1], [30], [0, 31, 2]])
def test_out_of_range_slots(view: KVPoolView, bad: list[int]) -> None:
    slots = torch.tensor(bad)
    with pytest.raises(ValueError, match="out of range"):
        pack_kv(view, slots, out_for(view, len(bad)))
    with pytest.raises(ValueError, match="out of range"):
        unpack_kv(view, slots, out_for(view, len(bad)))


@pytest.mark.parametrize(
    "make_out",
    [
        lambda n: torch.zeros(n - 1, dtype=torch.uint8),  # too small
        lambda n: torch.zeros(n, dtype=torch.int8),  # wrong dtype
        lambda n: torch.zeros(n // 2, dtype=torch.int16),  # right bytes, wrong dtype
        lambda n: torch.zeros(2, n, dtype=torch.uint8),  # not 1-D
        lambda n: torch.zeros(2 * n, dtype=torch.uint8)[::2],  # not contiguous
        lambda n: [0] * n,  # not a tensor
    ],
    ids=["short", "int8", "int16", "2d", "strided", "list"],
)
def test_bad_packed_buffer(view: KVPoolView, make_out: object) -> None:
    slots = torch.tensor([1, 2, 3])
    bad = make_out(packed_nbytes(view, 3))  # type: ignore[operator]
    with pytest.raises(ValueError, match="packed buffer"):
        pack_kv(view, slots, bad)
    with pytest.raises(ValueError, match="packed buffer"):
        unpack_kv(view, slots, bad)


@pytest.mark.parametrize(
    "slots",
    [torch.tensor([1, 2], dtype=torch.int32), torch.tensor([[1, 2]]), [1, 2]],
    ids=["int32", "2d", "list"],
)
def test_bad_slots(view: KVPoolView, slots: object) -> None:
    with pytest.raises(ValueError, match="slots"):
        pack_kv(view, slots, out_for(view, 2))  # type: ignore[arg-type]


def test_unknown_backend(view: KVPoolView) -> None:
    with pytest.raises(ValueError, match="backend"):
        pack_kv(view, torch.tensor([1]), out_for(view, 1), backend="cuda")  # type: ignore[arg-type]


def test_larger_packed_buffer_is_fine_and_its_tail_untouched(view: KVPoolView) -> None:
    out = torch.full((packed_nbytes(view, 5) + 100,), 0xCD, dtype=torch.uint8)
    pack_kv(view, torch.arange(5), out)
    assert (out[packed_nbytes(view, 5) :] == 0xCD).all()


def test_partial_last_page_padding_is_zeroed(view: KVPoolView) -> None:
    out = torch.full((packed_nbytes(view, 5),), 0xCD, dtype=torch.uint8)
    pack_kv(view, torch.arange(5), out)
    rb = view.row_bytes[0]
    last = out[page_bytes(view) :].view(-1, 4, rb)  # blocks of the second (partial) page
    assert not last[:, 1:].any() and last[:, 0].any()


@pytest.mark.parametrize(
    ("slots", "granular"),
    [
        ([4, 5, 6, 7, 0, 1, 2, 3], True),  # shuffled aligned pages
        ([8, 9, 10], True),  # one partial page at a page start
        ([4, 5, 6, 7, 9, 10], False),  # partial page not at a page start
        ([5, 6, 7, 8], False),  # a run across pages
        ([4, 5, 7, 6], False),  # aligned start, wrong order
    ],
)
def test_page_granular_plan(view: KVPoolView, slots: list[int], granular: bool) -> None:
    s = torch.tensor(slots)
    plan = plan_copy(view, s, out_for(view, len(slots)), scatter=False)
    assert plan == (len(slots), granular)


def test_prefix_of_pages_is_prefix_of_bytes(view: KVPoolView) -> None:
    slots = make_slots("scattered", 11, view)
    full, prefix = out_for(view, 11), out_for(view, 8)
    pack_kv(view, slots, full)
    pack_kv(view, slots[:8], prefix)
    assert torch.equal(full[: prefix.numel()], prefix)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available(),
    reason="needs compiled Triton on CPU",
)
def test_triton_on_cpu_without_interpreter_says_why(view: KVPoolView) -> None:
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        pack_kv(view, torch.tensor([1]), out_for(view, 1), backend="triton")
