"""Fuzzing our launcher's flags and `SGL_HICACHE_*` overrides (issue 12): any value of any of our
flags, in either spelling, any `--hicache-spill-extra-config` JSON, over any environment overrides,
gives either a frozen config handed to sglang with exactly the values asked for (flag or JSON key
over environment), or one line on stderr and exit code 2 with sglang never started. Most examples
run `launch_server.main` in-process (sglang's start stubbed); a few failing ones run the real command
in a subprocess."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import sgl_hicache.launch_server as launch_server
from sgl_hicache.config import ConfigError, MooncakeConfig, SpillBackend, SpillConfig, format_size
from sgl_hicache.server import flags as flags_module
from sgl_hicache.server.flags import EXTRA_CONFIG, Setting
from sgl_hicache.server.handoff import ENV_CONFIG, import_config
from tests.server.launcher import PREFIX, run_main

FLAGS = [s for s in flags_module.settings() if s.flag]
KNOBS = [s for s in flags_module.settings() if s.key]
MODEL = ["--model-path", "sgl-hicache-test/no-such-model"]

# Text an environment variable or an exec'd argument can hold (no NUL, no lone surrogates).
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=24)
NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.sampled_from(["0", "-1", "1", "1.9", "4096", "4097", "512M", "1.5T", " 2g ", "1e3", "0x10"]),
    st.sampled_from(["9" * 40, "1.2.3G", "4M"]),
)
JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), TEXT, NUMBERS
)


TRUSTED: list[Path] = []  # set by the fixture below (strategies draw it at generation time)


@pytest.fixture(scope="module", autouse=True)
def trusted_root(tmp_path_factory: pytest.TempPathFactory) -> None:
    """An existing tier root that passes the trust checks (ours, 0700), removed with pytest's tmp."""
    path = tmp_path_factory.mktemp("fuzz_tier")
    path.chmod(0o700)
    TRUSTED[:] = [path]


def trusted_dir() -> Path:
    return TRUSTED[0]


def valid_texts(setting: Setting) -> list[str]:
    if setting.type is bool:
        return ["1", "0", "true", "False", "yes", "off"]
    if setting.bare is not None:  # a size: bare numbers are GB (or need a unit)
        return [format_size(setting.default), format_size(setting.default * 2), "512M", "1"]
    if setting.type in (int, float):
        return [str(setting.default), str(setting.default * 2), "1", "2"]
    if setting.type is MooncakeConfig:
        return [
            '{"master": "10.0.0.1:50051"}',
            '{"master": "h:1", "protocol": "rdma", "local_buffer_size": "1G"}',
        ]
    return [m.value for m in setting.type] + (["wait"] if setting.name == "prefetch_policy" else [])


def texts_for(setting: Setting) -> st.SearchStrategy[str]:
    """Mostly plausible values (so that many examples are accepted), one in five anything."""
    base = str(trusted_dir())
    if setting.type is Path:
        valid = [base, base + "/new/sub"]
        bad = st.one_of(st.sampled_from(["relative/dir", "/etc/hostname/tier", "/proc/1/x", "/"]), TEXT)
        bad = st.one_of(bad, TEXT.map(lambda t: base + "/" + t))
    elif setting.type in (int, float):
        valid, bad = valid_texts(setting), st.one_of(NUMBERS, TEXT)
    else:
        valid, bad = valid_texts(setting), TEXT
    return st.tuples(st.integers(0, 4), st.sampled_from(valid), bad).map(
        lambda t: t[2] if t[0] == 4 else t[1]
    )


def json_for(setting: Setting) -> st.SearchStrategy[Any]:
    """A JSON value for a key of the extra config: mostly of the right type, sometimes anything."""
    valid: list[Any] = [setting.default, setting.default * 2] if setting.type in (int, float) else []
    if setting.type is bool:
        valid = [True, False]
    elif setting.type not in (int, float):
        valid = [m.value for m in setting.type]
    if setting.bare is not None:
        valid = ["4M", "8M", "1G"]
    return st.one_of(st.sampled_from(valid), st.sampled_from(valid), st.sampled_from(valid), JSON_SCALARS)


@st.composite
def extra_config(draw: st.DrawFn) -> str:
    keys = draw(st.lists(st.sampled_from(KNOBS), max_size=4))
    obj = {s.key: draw(json_for(s)) for s in keys}
    if draw(st.integers(0, 9)) == 0:
        obj[draw(st.sampled_from(["io_thread", "bogus", "chunk_bytes", ""]))] = 1
    text = json.dumps(obj)
    return draw(st.sampled_from([text] * 8 + [text[:-1], "[1]", "null", ""]))


@st.composite
def arguments(draw: st.DrawFn) -> tuple[list[str], dict[str, str]]:
    """(argv of our flags around sglang's, environment overrides)."""
    argv = list(MODEL)
    env: dict[str, str] = {}
    for flag in FLAGS:
        assert flag.flag is not None
        if flag.type is bool:
            form = draw(st.sampled_from([None, flag.flag, "--no-" + flag.flag.removeprefix("--")]))
            argv += [form] if form else []
        elif draw(st.integers(0, 2)) == 0:
            value = draw(texts_for(flag))
            joined = draw(st.booleans()) or value.startswith("-")  # a separate "-x" is another flag
            argv += [f"{flag.flag}={value}"] if joined else [flag.flag, value]
    for setting in [*FLAGS, *KNOBS]:
        if draw(st.integers(0, 5)) == 0:
            other = st.sampled_from(["1", "0", "true", "wait", "4M"])
            env[setting.env] = draw(st.one_of(texts_for(setting), texts_for(setting), other))
    if draw(st.booleans()):
        argv.append(f"{EXTRA_CONFIG}={draw(extra_config())}")
    if draw(st.booleans()):
        argv += ["--enable-hicache-spill", "--hicache-spill-dir", str(trusted_dir())]
    if draw(st.integers(0, 9)) == 0:  # a flag left without its value
        argv.append(draw(st.sampled_from([f.flag for f in FLAGS if f.type is not bool] + [EXTRA_CONFIG])))
    return argv, env


def get(config: SpillConfig, setting: Setting) -> Any:
    return functools.reduce(getattr, setting.path, config)


def given_value(setting: Setting, argv: list[str], env: dict[str, str]) -> Any:
    """What `setting` was set to (its flag's last spelling on the command line, or its key in the last
    extra config, else its variable), or the field's default."""
    if setting.key is not None:
        extras = [json.loads(a.split("=", 1)[1]) for a in argv if a.startswith(EXTRA_CONFIG + "=")]
        if extras and setting.key in extras[-1]:
            return setting.from_json(extras[-1][setting.key])
    raw: Any = None
    for i, arg in enumerate(argv):
        if setting.flag is None:
            break
        if setting.type is bool and arg in (setting.flag, "--no-" + setting.flag.removeprefix("--")):
            raw = arg == setting.flag
        elif arg == setting.flag and i + 1 < len(argv):
            raw = argv[i + 1]
        elif arg.startswith(setting.flag + "="):
            raw = arg.split("=", 1)[1]
    if isinstance(raw, bool):
        return raw
    if raw is None:
        raw = env.get(setting.env)
    return setting.default if raw is None else setting.from_text(raw)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arguments())
def test_flags_give_a_frozen_config_or_one_line_and_exit_2(args: tuple[list[str], dict[str, str]]) -> None:
    argv, env = args
    code, stderr, started, after = run_main(argv, env)
    event("refused" if code == 2 else "accepted")
    if code == 2:
        lines = stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(PREFIX) and lines[0] != PREFIX, stderr
        assert started == []
        return
    assert code == 0 and stderr == "" and len(started) == 1
    config = import_config({ENV_CONFIG: after[ENV_CONFIG]})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.enabled = not config.enabled  # type: ignore[misc]
    for setting in [*FLAGS, *KNOBS]:
        expected = given_value(setting, argv, env)
        if setting.type is MooncakeConfig and config.tier.backend is SpillBackend.MOONCAKE:
            expected = expected.with_env(env)  # unset keys from MOONCAKE_* (none here), then defaults
        assert get(config, setting) == expected, setting.label
    assert ("hicache_spill" in started[0]) == config.enabled


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arguments())
def test_refused_flags_exit_2_with_one_line_from_the_real_command(
    args: tuple[list[str], dict[str, str]],
) -> None:
    argv, env = args
    code, expected, _, _ = run_main(argv, env)
    assume(code == 2)  # only refusals: an accepted config would start sglang
    base = {k: v for k, v in os.environ.items() if not k.startswith("SGL_HICACHE_")}
    result = subprocess.run([sys.executable, "-m", "sgl_hicache.launch_server", *argv], capture_output=True,
                            text=True, timeout=240, env={**base, **env})  # fmt: skip
    assert result.returncode == 2 and result.stderr == expected, result.stderr


def test_a_missing_value_is_one_line_too() -> None:
    code, stderr, started, _ = run_main([*MODEL, "--hicache-spill-capacity"], {})
    assert code == 2 and len(stderr.splitlines()) == 1 and stderr.startswith(PREFIX) and not started
    with pytest.raises(ConfigError):
        launch_server.parse(["--hicache-spill-staging", "--hicache-spill-capacity", "1G"])
