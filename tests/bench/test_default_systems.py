"""The default `--systems`: what a user comparing wants (recompute, the resident reference, ours and
each peer's strongest configurations), every configuration still available by name, and said so in
`--help`."""

from __future__ import annotations

import pytest

from benchmarks import long_history as lh
from benchmarks.bench.cli import parser, spec_from
from benchmarks.bench.spec import (
    DEFAULT_SYSTEMS,
    FAMILIES,
    HICACHE,
    LMCACHE,
    SYSTEMS,
    BenchSpec,
    expand_systems,
)


def test_the_default_is_the_comparison_a_user_wants() -> None:
    spec = spec_from(parser().parse_args([]))
    assert spec.systems == DEFAULT_SYSTEMS == BenchSpec().systems
    assert {"recompute", "ours", "resident"} <= set(DEFAULT_SYSTEMS)
    for peer, members in FAMILIES.items():
        assert 1 <= sum(s in members for s in DEFAULT_SYSTEMS) <= 3, peer  # each peer, at its best only
    assert len(DEFAULT_SYSTEMS) <= 8 < len(SYSTEMS)  # the size of a run before LMCache joined
    assert lh.main.__module__ and set(lh.DEFAULT_SYSTEMS) == set(DEFAULT_SYSTEMS) - {"resident"}


def test_every_configuration_is_still_available_by_name() -> None:
    for name in SYSTEMS:
        assert expand_systems(name, "cuda") == (name,)
    assert expand_systems("all", "cuda") == SYSTEMS
    assert expand_systems("all") == tuple(s for s in SYSTEMS if s != "hicache-nixl")
    assert expand_systems("lmcache,ours") == (*LMCACHE, "ours")
    assert expand_systems("hicache", "cuda") == tuple(HICACHE)
    assert spec_from(parser().parse_args(["--systems", "all"])).systems == expand_systems("all")


def test_help_says_what_the_default_is_and_names_every_configuration(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "2000")  # no line break inside a name
    with pytest.raises(SystemExit):
        parser().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"default {','.join(DEFAULT_SYSTEMS)}" in text
    assert "strongest configurations of each peer" in text
    for name in SYSTEMS:
        assert name in text, name
