"""The worked sizing examples of docs/OPERATIONS.md ("Capacity sizing", issue 40, 5), recomputed
from the code's own arithmetic: the KV bytes of a token on one TP rank as the launcher computes them
from a `config.json` (`server/room.py`), an extent file's size as the tier bounds it (`cache/pins.py`
over `tier/format.py`'s `file_bound`) and a packed history's staging bytes (`kernels`). Every cell of
the guide's two example tables must be what these give, so a change of the format or of the
arithmetic that moves a figure fails here until the guide says the new one."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from sgl_hicache.cache.pins import file_bytes
from sgl_hicache.config import GiB, MiB
from sgl_hicache.server.room import kv_token_bytes

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "OPERATIONS.md"

CONFIGS: dict[str, dict[str, Any]] = {  # the fields of each model's config.json that size its KV
    "Llama-3.1-8B": {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "hidden_size": 4096},
    "Llama-3.1-70B": {"num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                      "hidden_size": 8192},
    "DeepSeek-V3": {"num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
                    "hidden_size": 7168, "kv_lora_rank": 512, "qk_rope_head_dim": 64},
}  # fmt: skip
EXAMPLES = [("Llama-3.1-8B", 1, "bf16"), ("Llama-3.1-70B", 8, "bf16"), ("DeepSeek-V3", 8, "bf16"),
            ("DeepSeek-V3", 8, "fp8_e4m3")]  # fmt: skip
CONVERSATION = 32_768  # tokens of one spilled conversation
EXTENT = 1_024  # tokens per extent: a turn's new tokens
LARGEST_EVICTION = 4_096  # tokens of the largest node evicted (staging holds two of them in flight)
CAPACITY = 3690 * GiB  # --hicache-spill-capacity 3690G on the 4 TB XFS volume
VOLUME = 4 * 10**12  # bytes of the drive, for drive writes per day
EVICTED_PER_S = 1_000
CHUNK = 4 * MiB
PAGE = 1


def label(model: str, tp: int, dtype: str) -> str:
    return f"{model}, TP {tp}" + (", fp8 KV" if dtype.startswith("fp8") else "")


def per_rank(model: str, tp: int, dtype: str) -> int:
    b = kv_token_bytes(CONFIGS[model], SimpleNamespace(kv_cache_dtype=dtype, tp_size=tp))
    assert isinstance(b, Fraction) and b.denominator == 1
    return int(b)


def space_row(model: str, tp: int, dtype: str) -> list[str]:
    """| model | KV B/token, one rank | all ranks | one extent's file, one rank | a conversation | conversations |"""
    token = per_rank(model, tp, dtype)
    extent = file_bytes(EXTENT, EXTENT * token, CHUNK, PAGE)
    conversation = CONVERSATION // EXTENT * extent * tp
    return [label(model, tp, dtype), f"{token:,}", f"{token * tp:,}", f"{extent:,}",
            f"{conversation:,} ({conversation / GiB:.2f} GiB)", f"{CAPACITY // conversation:,}"]  # fmt: skip


def rate_row(model: str, tp: int, dtype: str) -> list[str]:
    """| model | written at 1,000 tokens/s | budget rewritten every | drive writes a day | staging |"""
    token = per_rank(model, tp, dtype)
    written = EVICTED_PER_S * token * tp  # B/s; the extent's own overhead (< 0.03 %) left out
    staging = (CONVERSATION + 2 * LARGEST_EVICTION) * token
    return [label(model, tp, dtype), f"{written / 1e6:,.0f} MB/s", f"{CAPACITY / written / 3600:.1f} h",
            f"{written * 86_400 / VOLUME:.1f}", f"{staging / GiB:.2f} GiB (`{-(-staging // GiB)}G`)"]  # fmt: skip


def guide_row(first_cell: str, width: int) -> list[str]:
    """The cells of the guide's table rows that start with `first_cell` and have `width` cells."""
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in GUIDE.read_text().splitlines()
        if line.startswith(f"| {first_cell} |")
    ]
    (row,) = [r for r in rows if len(r) == width]
    return row


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: label(*e))
def test_the_guides_space_figures_are_the_codes(example: tuple[str, int, str]) -> None:
    expected = space_row(*example)
    assert guide_row(expected[0], len(expected)) == expected


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: label(*e))
def test_the_guides_rate_and_staging_figures_are_the_codes(example: tuple[str, int, str]) -> None:
    expected = rate_row(*example)
    assert guide_row(expected[0], len(expected)) == expected


def test_the_per_token_formulas_the_guide_states() -> None:
    """layers x 2 x KV heads of a rank x head_dim x bytes; MLA: layers x (rank + rope dim) x bytes, whole on every rank."""
    assert per_rank("Llama-3.1-8B", 1, "bf16") == 32 * 2 * 8 * 128 * 2 == 131_072
    assert per_rank("Llama-3.1-70B", 8, "bf16") == 80 * 2 * 1 * 128 * 2 == 40_960
    assert per_rank("Llama-3.1-70B", 16, "bf16") == 40_960, "a KV head is replicated past 8 ranks"
    assert per_rank("DeepSeek-V3", 8, "bf16") == per_rank("DeepSeek-V3", 1, "bf16") == 61 * (512 + 64) * 2
    text = GUIDE.read_text()
    for figure in (
        "32 × 2 × 8 × 128 × 2 = 131,072",
        "80 × 2 × 1 × 128 × 2 = 40,960",
        "61 × (512 + 64) × 2 = 70,272",
    ):
        assert figure in text, figure


def test_the_capacity_the_guide_sets_fits_the_measured_volume() -> None:
    """The 4 TB XFS volume offered 3,970,138,193,920 B (statvfs f_bavail); less 1 GiB of min-free,
    `3690G` leaves the guide's margin for inodes, directories and alias links (outside the budget)."""
    available = 3_970_138_193_920
    assert available - GiB > CAPACITY
    text = GUIDE.read_text()
    for figure in (f"{available:,}", f"{available - GiB:,}", f"{CAPACITY:,}", "3690G"):
        assert figure in text, figure
