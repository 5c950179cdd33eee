from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from sgl_hicache.config import (
    Compression,
    ConfigError,
    GiB,
    MiB,
    PrefetchPolicy,
    SpillConfig,
    TierConfig,
    parse_size,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("512M", 512 * MiB),
        ("200G", 200 * GiB),
        ("200GiB", 200 * GiB),
        ("1.5T", 1536 * GiB),
        (" 2g ", 2 * GiB),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "12x", "-1G", "1.2.3G", "G", "1e3", "inf"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match="cannot parse size"):
        parse_size(text)


@pytest.mark.parametrize(
    ("text", "expected"), [("200", 200 * GiB), ("1.5", 1536 * MiB), ("0", 0), ("512M", 512 * MiB)]
)
def test_a_bare_number_is_in_the_unit_asked_for(text: str, expected: int) -> None:
    """Sizes in sglang's unit: `--hicache-size 200` is 200 GB, and so is our `200`."""
    assert parse_size(text, bare=GiB) == expected


def test_a_bare_number_can_be_refused_with_a_hint() -> None:
    with pytest.raises(ConfigError, match=r"^4 has no unit \(give a unit, e\.g\. 4M\)$"):
        parse_size("4", bare=None)
    assert parse_size("4M", bare=None) == 4 * MiB and parse_size("4096B", bare=None) == 4096


@pytest.mark.parametrize("name", ["wait_complete", "wait"])
def test_sglangs_policy_name_and_our_old_one_are_the_same_member(name: str) -> None:
    assert PrefetchPolicy(name) is PrefetchPolicy.WAIT_COMPLETE
    assert [p.value for p in PrefetchPolicy] == ["wait_complete", "timeout", "best_effort"]


def test_json_round_trip_preserves_every_field() -> None:
    config = SpillConfig(
        tier=TierConfig(
            directory=Path("/x/y"), capacity_bytes=3 * GiB, compression=Compression.ZSTD, io_threads=3
        ),
        enabled=True,
        prefetch_policy=PrefetchPolicy.WAIT_COMPLETE,
        staging_bytes=64 * MiB,
    )
    again = SpillConfig.from_json(config.to_json())
    assert again == config
    assert isinstance(again.tier.directory, Path) and again.tier.compression is Compression.ZSTD


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SpillConfig().enabled = True  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"capacity_bytes": 0}, "capacity_bytes"),
        ({"io_threads": 0}, "io_threads"),
        ({"chunk_bytes": 1000}, "chunk_bytes"),
    ],
)
def test_tier_config_validation_names_the_field(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        TierConfig(**kwargs)  # type: ignore[arg-type]
    assert err.value.field == field


def test_from_json_rejects_unknown_settings() -> None:
    with pytest.raises(ConfigError, match="unknown SpillConfig settings: bogus"):
        SpillConfig.from_json('{"bogus": 1}')
