"""The pin budget counts what the tier keeps (issue 38, 10): the bytes of extent files (header,
padding and KV), not only the packed KV bytes, so pins never hold more of the tier than pin_share
of its budget; and pin_share must be below 1 (pins holding the whole budget would leave no room to
spill anything else)."""

from __future__ import annotations

from typing import Any

import pytest
from sgl_hicache_kernels import packed_nbytes

from sgl_hicache.cache.hint_source import HintRefused, RetentionHint
from sgl_hicache.config import ConfigError, SpillConfig
from tests.cache.conftest import Stack

CONVERSATION = list(range(1000, 1064))


def file_bytes_on_disk(s: Stack) -> int:
    return sum(p.stat().st_size for p in s.tier_dir.rglob("*.ext"))


def test_a_pinned_extent_is_charged_at_least_its_file(make_stack: Any) -> None:
    s = make_stack()
    s.insert(CONVERSATION)
    s.cache.retention.apply(RetentionHint("pin", CONVERSATION, None, None, 60.0))
    s.evict_all()
    pins = s.cache.retention.pins
    assert s.metrics.totals["pinned_spilled_tokens"] == len(CONVERSATION)
    on_disk = file_bytes_on_disk(s)
    assert on_disk > packed_nbytes(s.cache.controller.view, len(CONVERSATION)), "a header at least"
    assert pins.kept_bytes >= on_disk and pins.pinned_bytes >= on_disk, (pins.kept_bytes, on_disk)


def test_a_pin_whose_kv_fits_but_whose_file_does_not_is_refused(make_stack: Any) -> None:
    probe = make_stack()
    probe.insert(CONVERSATION)
    probe.evict_all()
    packed = packed_nbytes(probe.cache.controller.view, len(CONVERSATION))
    budget = (packed + file_bytes_on_disk(probe)) // 2  # above the KV, below the file holding it
    s = make_stack(capacity_bytes=2 * budget, pin_share=0.5)
    refused = s.cache.retention.take([], CONVERSATION, None, None, "pin", 30.0)
    assert isinstance(refused, HintRefused) and f"pin budget of {budget} B" in refused.reason, refused


@pytest.mark.parametrize("share", [1.0, 1.5, float("nan")])
def test_a_pin_share_of_1_or_more_is_refused_in_one_line(share: float) -> None:
    with pytest.raises(ConfigError) as refused:
        SpillConfig(pin_share=share)
    assert "pin share must be in [0, 1)" in str(refused.value) and "\n" not in str(refused.value)


def test_a_pin_share_below_1_is_taken() -> None:
    assert SpillConfig(pin_share=0.99).pin_share == 0.99 and SpillConfig(pin_share=0).pin_share == 0
