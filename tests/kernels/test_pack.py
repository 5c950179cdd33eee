"""pack_kv / unpack_kv against plain-torch references, for both backends.

The torch backend runs here on CPU. The Triton cases run on a GPU when one is present (marker `gpu`)
or under TRITON_INTERPRET=1 on CPU (marker `interpret`): test_interpret.py runs this file in a
subprocess with that variable set, so it never leaks into the rest of the suite.
"""

from __future__ import annotations

import os

import pytest
import torch
from sgl_hicache_kernels import KVKind, KVPoolView, pack_kv, packed_nbytes, unpack_kv

from .kv_factory import FP8, byte_rows, fresh_like, make_slots, make_view

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_DEVICE = "cpu" if INTERPRET else ("cuda" if torch.cuda.is_available() else None)
triton_case = pytest.mark.skipif(
    TRITON_DEVICE is None,
    reason="Triton path needs a GPU or TRITON_INTERPRET=1 (test_interpret.py runs it in a subprocess)",
)
triton_mark = pytest.mark.interpret if TRITON_DEVICE != "cuda" else pytest.mark.gpu


def ref_pack(view: KVPoolView, slots: torch.Tensor) -> torch.Tensor:
    """Page by page, buffer by buffer, in a Python loop: slow and obviously right."""
    ps, rows, chunks = view.page_size, byte_rows(view), []
    for start in range(0, slots.numel(), ps):
        page = slots[start : start + ps]
        for r in rows:
            block = torch.zeros(ps, r.shape[1], dtype=torch.uint8, device=r.device)
            block[: page.numel()] = r[page]
            chunks.append(block.flatten())
    return torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device=slots.device)


def ref_unpack(view: KVPoolView, slots: torch.Tensor, packed: torch.Tensor) -> list[torch.Tensor]:
    """The buffers (as byte rows) after writing token i of `packed` to slot slots[i], one at a time."""
    rows = [r.clone() for r in byte_rows(view)]
    ps, token_bytes = view.page_size, sum(r.shape[1] for r in rows)
    for i, slot in enumerate(slots.tolist()):
        page_start = i // ps * ps * token_bytes
        offset = page_start
        for r in rows:
            rb = r.shape[1]
            at = offset + (i % ps) * rb
            r[slot] = packed[at : at + rb]
            offset += ps * rb
    return rows


MHA_SHAPES = [
    (KVKind.MHA, dtype, heads, head_dim, None)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, FP8)
    for heads in (1, 2)
    for head_dim in (64, 128)
]
OTHER_SHAPES = [
    (KVKind.MLA, torch.bfloat16, 1, 576, None),
    (KVKind.MLA, FP8, 1, 576, None),
    (KVKind.MLA, torch.float32, 1, 576, None),
    (KVKind.MHA, torch.bfloat16, 3, 128, 64),  # v_head_dim != head_dim: K and V rows differ
]
TRITON_SHAPES = [
    (KVKind.MHA, torch.bfloat16, 2, 64, None),
    (KVKind.MHA, FP8, 1, 128, None),
    (KVKind.MHA, torch.float32, 3, 128, 64),
    (KVKind.MLA, torch.bfloat16, 1, 576, None),
    (KVKind.MLA, FP8, 1, 576, None),
]


def shape_id(shape: tuple) -> str:
    kind, dtype, heads, head_dim, v_head_dim = shape
    v = f"-v{v_head_dim}" if v_head_dim else ""
    return f"{kind.value}-{str(dtype).removeprefix('torch.')}-h{heads}-d{head_dim}{v}"


def build(shape: tuple, page_size: int, device: str = "cpu", zeros: bool = False) -> KVPoolView:
    kind, dtype, heads, head_dim, v_head_dim = shape
    return make_view(
        kind, dtype, heads, head_dim, v_head_dim=v_head_dim, page_size=page_size,
        num_slots=max(5 * page_size, 160) + 3, device=device, zeros=zeros,
    )  # fmt: skip


def check_pack(view: KVPoolView, slots: torch.Tensor, backend: str) -> None:
    out = torch.full((packed_nbytes(view, slots.numel()) + 5,), 0xAB, dtype=torch.uint8, device=view.device)
    pack_kv(view, slots, out, backend=backend)  # type: ignore[arg-type]
    expected = ref_pack(view, slots)
    assert torch.equal(out[: expected.numel()], expected)
    assert torch.equal(out[expected.numel() :], torch.full_like(out[expected.numel() :], 0xAB))


def check_unpack(view: KVPoolView, slots: torch.Tensor, backend: str) -> None:
    gen = torch.Generator().manual_seed(2)
    nbytes = packed_nbytes(view, slots.numel())
    packed = torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8).to(view.device)
    expected = ref_unpack(view, slots, packed)
    unpack_kv(view, slots, packed, backend=backend)  # type: ignore[arg-type]
    for got, want in zip(byte_rows(view), expected, strict=True):
        assert torch.equal(got, want)


def check_round_trip(view: KVPoolView, slots: torch.Tensor, backend: str) -> None:
    """pack, then unpack every prefix length that matters into a fresh pool."""
    out = torch.empty(packed_nbytes(view, slots.numel()), dtype=torch.uint8, device=view.device)
    pack_kv(view, slots, out, backend=backend)  # type: ignore[arg-type]
    n, ps = slots.numel(), view.page_size
    for m in sorted({n, n // 2, ps, n - 1} & set(range(n + 1))):
        restored = fresh_like(view)
        packed = out if m % 2 else out[: packed_nbytes(view, m)]  # whole extent or just the prefix
        unpack_kv(restored, slots[:m], packed, backend=backend)  # type: ignore[arg-type]
        for src, dst in zip(byte_rows(view), byte_rows(restored), strict=True):
            assert torch.equal(dst[slots[:m]], src[slots[:m]])
            untouched = torch.ones(view.num_slots, dtype=torch.bool, device=view.device)
            untouched[slots[:m]] = False
            assert not dst[untouched].any()


@pytest.mark.parametrize("pattern", ["scattered", "pages", "runs"])
@pytest.mark.parametrize("n_tokens", [0, 1, 7, 33, 129])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("shape", MHA_SHAPES + OTHER_SHAPES, ids=shape_id)
def test_torch_pack_matches_ref(shape: tuple, page_size: int, n_tokens: int, pattern: str) -> None:
    view = build(shape, page_size)
    check_pack(view, make_slots(pattern, n_tokens, view), "torch")


@pytest.mark.parametrize("pattern", ["scattered", "pages", "runs"])
@pytest.mark.parametrize("n_tokens", [0, 1, 33, 67])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("shape", MHA_SHAPES[::3] + OTHER_SHAPES, ids=shape_id)
def test_torch_unpack_matches_ref(shape: tuple, page_size: int, n_tokens: int, pattern: str) -> None:
    view = build(shape, page_size)
    check_unpack(view, make_slots(pattern, n_tokens, view), "torch")


@pytest.mark.parametrize("pattern", ["scattered", "pages", "runs"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("shape", TRITON_SHAPES, ids=shape_id)
def test_torch_round_trip_and_prefix(shape: tuple, page_size: int, pattern: str) -> None:
    view = build(shape, page_size)
    check_round_trip(view, make_slots(pattern, 71, view), "torch")


@triton_mark
@triton_case
@pytest.mark.parametrize("pattern", ["scattered", "pages"])
@pytest.mark.parametrize("n_tokens", [0, 67])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("shape", TRITON_SHAPES, ids=shape_id)
def test_triton_pack_matches_ref(shape: tuple, page_size: int, n_tokens: int, pattern: str) -> None:
    view = build(shape, page_size, TRITON_DEVICE or "cpu")
    check_pack(view, make_slots(pattern, n_tokens, view), "triton")


@triton_mark
@triton_case
@pytest.mark.parametrize("pattern", ["scattered", "pages"])
@pytest.mark.parametrize("n_tokens", [1, 33])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", TRITON_SHAPES, ids=shape_id)
def test_triton_unpack_matches_ref(shape: tuple, page_size: int, n_tokens: int, pattern: str) -> None:
    view = build(shape, page_size, TRITON_DEVICE or "cpu")
    check_unpack(view, make_slots(pattern, n_tokens, view), "triton")


@triton_mark
@triton_case
@pytest.mark.parametrize("pattern", ["scattered", "pages"])
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("shape", TRITON_SHAPES[::2], ids=shape_id)
def test_triton_round_trip_and_prefix(shape: tuple, page_size: int, pattern: str) -> None:
    view = build(shape, page_size, TRITON_DEVICE or "cpu")
    check_round_trip(view, make_slots(pattern, 23, view), "triton")


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=[triton_mark, triton_case])])
def test_duplicate_slots_pack_twice(backend: str) -> None:
    view = build(TRITON_SHAPES[0], 1, TRITON_DEVICE or "cpu" if backend == "triton" else "cpu")
    check_pack(view, make_slots("duplicates", 9, view), backend)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=[triton_mark, triton_case])])
def test_backends_agree_on_unaligned_buffers(backend: str) -> None:
    """Rows of 2 bytes x odd head_dim and a packed buffer at an odd address: no vector-width shortcut applies."""
    device = TRITON_DEVICE or "cpu" if backend == "triton" else "cpu"
    view = make_view(KVKind.MHA, torch.float16, 1, 9, page_size=4, num_slots=23, device=device)
    slots = make_slots("scattered", 10, view)
    out = torch.zeros(packed_nbytes(view, 10) + 1, dtype=torch.uint8, device=device)
    pack_kv(view, slots, out[1:], backend=backend)  # type: ignore[arg-type]
    assert torch.equal(out[1:], ref_pack(view, slots))
    restored = fresh_like(view)
    unpack_kv(restored, slots, out[1:], backend=backend)  # type: ignore[arg-type]
    assert all(
        torch.equal(a[slots], b[slots]) for a, b in zip(byte_rows(view), byte_rows(restored), strict=True)
    )


@triton_mark
@triton_case
@pytest.mark.parametrize("config", [(64, 1, 3), (256, 2, 5), (16384, 8, 16)], ids=str)
@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_launch_configs(config: tuple[int, int, int], page_size: int) -> None:
    """Forced configs: many steps per span (the looped path), groups that do not divide the spans."""
    from sgl_hicache_kernels.pack_triton import LaunchConfig, pack_kv_triton, unpack_kv_triton
    from sgl_hicache_kernels.plan import plan_copy

    view = build(TRITON_SHAPES[3], page_size, TRITON_DEVICE or "cpu")
    for pattern in ("scattered", "pages"):
        slots = make_slots(pattern, 19, view)
        out = torch.zeros(packed_nbytes(view, 19), dtype=torch.uint8, device=view.device)
        plan = plan_copy(view, slots, out, scatter=False)
        pack_kv_triton(view, slots, out, plan, LaunchConfig(*config))
        assert torch.equal(out, ref_pack(view, slots))
        restored = fresh_like(view)
        unpack_kv_triton(restored, slots, out, plan, LaunchConfig(*config))
        assert all(
            torch.equal(a[slots], b[slots]) for a, b in zip(byte_rows(view), byte_rows(restored), strict=True)
        )
