"""`hicache-timeout-tuned`: HiCache's `timeout` prefetch policy with its timeouts derived from the
disk's measured read speed (`disk_speed`), passed in the extra-config keys sglang 0.5.23 reads."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from benchmarks.bench import disk_speed, systems
from benchmarks.bench.disk_speed import PrefetchTimeouts, tuned_timeouts
from benchmarks.bench.spec import HICACHE, Shape, SpecError

KV_BYTES = 23040  # SmolLM2-135M's KV per token (the `model` fixture's shape)


def test_the_per_ki_token_timeout_is_the_read_time_of_1024_tokens_times_the_margin() -> None:
    t = tuned_timeouts(KV_BYTES, read_mib_s=200.0)
    assert t.per_ki_token_s == pytest.approx(2.0 * KV_BYTES * 1024 / (200 * 2**20))  # 0.225 s
    assert t.base_s == disk_speed.TUNED_BASE_S
    assert tuned_timeouts(KV_BYTES, 400.0).per_ki_token_s == pytest.approx(
        t.per_ki_token_s / 2
    )  # twice as fast
    assert tuned_timeouts(4 * KV_BYTES, 200.0).per_ki_token_s == pytest.approx(4 * t.per_ki_token_s)
    assert tuned_timeouts(KV_BYTES, 200.0, margin=3.0).per_ki_token_s == pytest.approx(1.5 * t.per_ki_token_s)


@pytest.mark.parametrize("tokens", [16, 1000, 16384, 10**6])
@pytest.mark.parametrize("speed", [50.0, 450.0, 3000.0])
def test_a_prefetch_read_at_the_measured_speed_fits_its_timeout_with_the_margin(
    tokens: int, speed: float
) -> None:
    t = tuned_timeouts(131072, speed)  # kvheavy: 128 KiB a token
    read_s = tokens * 131072 / (speed * 2**20)
    assert t.timeout_s(tokens) >= disk_speed.TUNED_MARGIN * read_s
    assert t.timeout_s(tokens) == pytest.approx(t.base_s + disk_speed.TUNED_MARGIN * read_s)


@pytest.mark.parametrize("bad", [dict(kv_bytes_per_token=0, read_mib_s=1.0), dict(kv_bytes_per_token=1, read_mib_s=0.0),
                                 dict(kv_bytes_per_token=1, read_mib_s=float("nan")),
                                 dict(kv_bytes_per_token=1, read_mib_s=1.0, margin=0.5)])  # fmt: skip
def test_impossible_inputs_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="tuned timeouts need"):
        tuned_timeouts(**bad)  # type: ignore[arg-type]


def test_the_keys_are_those_sglang_reads() -> None:
    """sglang 0.5.23 pops exactly these keys from `--hicache-storage-backend-extra-config` (read from
    its source, without importing it)."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).parent / "srt/mem_cache/hybrid_cache/hybrid_cache_controller.py"
    text = source.read_text()
    for key in PrefetchTimeouts(0.5, 0.2).extra_config():
        assert f'extra_config.pop(\n            "{key}"' in text or f'extra_config.pop("{key}"' in text, key


def test_the_tuned_configuration_passes_them_and_the_others_pass_none(model: Path, tmp_path: Path) -> None:
    shape = Shape(disk_read_mib_s=200.0)
    flags = systems.build("hicache-timeout-tuned", shape, model, tmp_path).flags
    extra = json.loads(flags[flags.index("--hicache-storage-backend-extra-config") + 1])
    assert extra == tuned_timeouts(KV_BYTES, 200.0).extra_config()
    assert flags[flags.index("--hicache-storage-prefetch-policy") + 1] == "timeout"
    for name in ("hicache-timeout-budget", "hicache-timeout-r2"):  # sglang's default timeouts
        assert (
            "--hicache-storage-backend-extra-config" not in systems.build(name, shape, model, tmp_path).flags
        )
    label = HICACHE["hicache-timeout-tuned"].label
    assert "(sglang's default) with its timeouts tuned to the disk's measured read speed" in label
    assert "at sglang's default timeouts" in HICACHE["hicache-timeout-budget"].label
    with pytest.raises(
        SpecError, match="hicache-timeout-tuned: its timeouts are tuned to the disk's read speed"
    ):
        systems.build("hicache-timeout-tuned", Shape(), model, tmp_path)


def test_a_run_with_it_measures_the_disk_once_unless_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(disk_speed, "measure_read_mib_s", lambda d: calls.append(d) or 321.0)
    measured = disk_speed.measured_shape(Shape(), ["ours", "hicache-timeout-tuned"], tmp_path)
    assert measured.disk_read_mib_s == 321.0 and calls == [tmp_path]
    assert disk_speed.measured_shape(
        Shape(disk_read_mib_s=5.0), ["hicache-timeout-tuned"], tmp_path
    ) == Shape(disk_read_mib_s=5.0)
    assert disk_speed.measured_shape(Shape(), ["ours", "hicache-timeout-budget"], tmp_path) == Shape()
    assert calls == [tmp_path]
    with pytest.raises(SpecError, match="disk read speed must be > 0"):
        Shape(disk_read_mib_s=0.0)


def test_measuring_reads_what_it_wrote_and_leaves_nothing(tmp_path: Path) -> None:
    assert disk_speed.measure_read_mib_s(tmp_path / "d", size_mib=4) > 0
    assert list((tmp_path / "d").iterdir()) == []
