"""The torch path's run copies (page_size 1 on CPU): run detection and bytes against the references.

`RUN_BYTES` is lowered so that runs of a few slots take the slice path on these tiny pools.
"""

from __future__ import annotations

import pytest
import torch
from sgl_hicache_kernels import KVKind, KVPoolView, pack_torch
from sgl_hicache_kernels.pack_torch import long_runs

from .kv_factory import FP8, make_slots
from .test_pack import build, check_pack, check_round_trip, check_unpack


def runs_of(slots: list[int], min_len: int = 1) -> list[tuple[int, int, int]]:
    return long_runs(torch.tensor(slots, dtype=torch.int64), min_len)


@pytest.mark.parametrize(
    ("slots", "min_len", "expected"),
    [
        ([], 1, []),
        ([7], 1, [(0, 1, 7)]),
        ([7], 2, []),
        ([3, 4, 5, 6], 1, [(0, 4, 3)]),  # all one run
        ([3, 4, 5, 6], 5, []),  # shorter than min_len
        ([9, 8, 7], 1, [(0, 1, 9), (1, 2, 8), (2, 3, 7)]),  # descending: no runs
        ([4, 4, 5, 5], 1, [(0, 1, 4), (1, 3, 4), (3, 4, 5)]),  # a repeat ends a run
        ([10, 11, 0, 1, 2, 50, 20, 21, 22, 23], 3, [(2, 5, 0), (6, 10, 20)]),  # unsorted, gaps between
        ([0, 1, 2, 5, 6, 7], 3, [(0, 3, 0), (3, 6, 5)]),  # runs back to back, no gap
        ([2, 3], 2, [(0, 2, 2)]),  # exactly min_len
    ],
)
def test_long_runs(slots: list[int], min_len: int, expected: list[tuple[int, int, int]]) -> None:
    assert runs_of(slots, min_len) == expected


def test_long_runs_large_values_and_a_run_at_the_end() -> None:
    big = 2**40
    assert runs_of([5, big, big + 1, big + 2], 2) == [(1, 4, big)]


SHAPES = [
    (KVKind.MHA, torch.bfloat16, 2, 64, None),
    (KVKind.MHA, torch.float32, 3, 128, 64),  # K and V rows differ
    (KVKind.MLA, FP8, 1, 576, None),
]

SLOT_LISTS = {
    "one_run": list(range(40, 111)),
    "run_gap_run": [*range(5, 25), 140, 3, 99, *range(60, 80)],
    "gap_run_gap": [150, 2, *range(30, 60), 131, 7],
    "short_runs_only": [10, 11, 50, 51, 90, 91],
    "scattered": None,
}


@pytest.fixture
def tiny_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs of 4 slots (bf16 rows of 256 B) or 2 slots (the other shapes) and more take the slice path."""
    monkeypatch.setattr(pack_torch, "RUN_BYTES", 1024)


def slots_for(name: str, view: KVPoolView) -> torch.Tensor:
    listed = SLOT_LISTS[name]
    return make_slots("scattered", 37, view) if listed is None else torch.tensor(listed, dtype=torch.int64)


@pytest.mark.usefixtures("tiny_runs")
@pytest.mark.parametrize("name", sorted(SLOT_LISTS))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_run_path_matches_ref(shape: tuple, name: str) -> None:
    view = build(shape, 1)
    slots = slots_for(name, view)
    check_pack(view, slots, "torch")
    check_unpack(view, slots, "torch")
    check_round_trip(build(shape, 1), slots, "torch")


@pytest.mark.usefixtures("tiny_runs")
def test_run_path_pack_with_repeated_runs() -> None:
    view = build(SHAPES[0], 1)
    check_pack(view, torch.tensor([*range(8, 20), *range(8, 20), 8], dtype=torch.int64), "torch")


@pytest.mark.usefixtures("tiny_runs")
def test_run_path_not_taken_for_pages() -> None:
    """page_size > 1 keeps the page / token index ops: runs there are a page_size-1 matter."""
    view = build(SHAPES[0], 16)
    check_pack(view, torch.arange(3, 40, dtype=torch.int64), "torch")
    check_unpack(view, torch.arange(3, 40, dtype=torch.int64), "torch")
