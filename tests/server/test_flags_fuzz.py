"""Fuzzing our launcher's flags and `SGL_HICACHE_*` overrides (issue 12): any value of any of our
flags, in either spelling, over any environment overrides, gives either a frozen config handed to
sglang with exactly the values asked for (flag over environment), or one line on stderr and exit
code 2 with sglang never started. Most examples run `launch_server.main` in-process (sglang's start
stubbed); a few failing ones run the real command in a subprocess."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import sgl_hicache.launch_server as launch_server
import sgl_hicache.server.hints as hints
from sgl_hicache.config import ConfigError, SpillConfig, convert
from sgl_hicache.server.flags import Flag, spill_flags
from sgl_hicache.server.handoff import ENV_CONFIG, import_config

FLAGS = spill_flags()
PREFIX = "python -m sgl_hicache.launch_server: error: "
MODEL = ["--model-path", "/nonexistent-model"]

# Text an environment variable or an exec'd argument can hold (no NUL, no lone surrogates).
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=24)
NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.sampled_from(
        ["0", "-1", "1", "4096", "4097", "512M", "1.5T", " 2g ", "1e3", "0x10", "9" * 40, "1.2.3G"]
    ),
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


def values_for(flag: Flag) -> st.SearchStrategy[str]:
    """Mostly plausible values (so that many examples are accepted), one in five anything."""
    base = str(trusted_dir())
    if flag.type is Path:
        valid = [base, base + "/new/sub"]
        bad = st.one_of(st.sampled_from(["relative/dir", "/etc/hostname/tier", "/proc/1/x", "/"]), TEXT)
        bad = st.one_of(bad, TEXT.map(lambda t: base + "/" + t))
    elif flag.type is bool:
        valid, bad = ["1", "0", "true", "False", "yes", "off"], TEXT
    elif flag.type in (int, float):
        valid, bad = [str(flag.default), str(flag.default * 2)], st.one_of(NUMBERS, TEXT)
    else:
        valid, bad = [m.value for m in flag.type], TEXT
    return st.tuples(st.integers(0, 4), st.sampled_from(valid), bad).map(
        lambda t: t[2] if t[0] == 4 else t[1]
    )


@st.composite
def arguments(draw: st.DrawFn, subprocess_safe: bool = False) -> tuple[list[str], dict[str, str]]:
    """(argv of our flags around sglang's, environment overrides)."""
    argv = list(MODEL)
    env: dict[str, str] = {}
    for flag in FLAGS:
        if flag.type is bool:
            form = draw(st.sampled_from([None, flag.name, "--no-" + flag.name.removeprefix("--")]))
            argv += [form] if form else []
        elif draw(st.integers(0, 2)) == 0:
            value = draw(values_for(flag))
            joined = draw(st.booleans()) or value.startswith("-")  # a separate "-x" is another flag
            argv += [f"{flag.name}={value}"] if joined else [flag.name, value]
        if draw(st.integers(0, 5)) == 0:
            env[flag.env] = draw(st.one_of(st.sampled_from(["1", "0", "true", "wait"]), values_for(flag)))
    if draw(st.booleans()):
        argv += ["--enable-hicache-spill", "--hicache-spill-dir", str(trusted_dir())]
    if draw(st.integers(0, 9)) == 0:  # a flag left without its value
        argv.append(draw(st.sampled_from([f.name for f in FLAGS if f.type is not bool])))
    return argv, env


def get(config: SpillConfig, flag: Flag) -> Any:
    return functools.reduce(getattr, flag.path, config)


def given_value(flag: Flag, argv: list[str], env: dict[str, str]) -> Any:
    """What `flag` was set to (its last spelling on the command line, else its variable), or the
    field's default."""
    raw: Any = None
    for i, arg in enumerate(argv):
        if flag.type is bool and arg in (flag.name, "--no-" + flag.name.removeprefix("--")):
            raw = arg == flag.name
        elif arg == flag.name and i + 1 < len(argv):
            raw = argv[i + 1]
        elif arg.startswith(flag.name + "="):
            raw = arg.split("=", 1)[1]
    if raw is None:
        raw = env.get(flag.env)
    return flag.default if raw is None else convert(flag.type, raw)


def run_main(argv: list[str], env: dict[str, str]) -> tuple[int, str, list[list[str]], dict[str, str]]:
    """`launch_server.main(argv)` under `env`, sglang stubbed: (exit code, stderr, sglang argvs, env after)."""
    started: list[list[str]] = []
    stderr = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_CONFIG, "")  # recorded, so that what main exports is undone
        for name in [n for n in os.environ if n.startswith("SGL_HICACHE_")]:
            mp.delenv(name)
        for name, value in env.items():
            mp.setenv(name, value)
        mp.setenv("PYTHONWARNINGS", "")
        mp.setattr(launch_server, "check_seam", lambda: None)
        mp.setattr(launch_server, "run_sglang", lambda args: started.append(args) or 0)
        mp.setattr(hints, "private_runtime_dir", contextlib.nullcontext)
        with contextlib.redirect_stderr(stderr):
            code = launch_server.main(argv)
        after = dict(os.environ)
    return code, stderr.getvalue(), started, after


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
    for flag in FLAGS:
        assert get(config, flag) == given_value(flag, argv, env), flag.name
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
                            text=True, timeout=120, env={**base, **env})  # fmt: skip
    assert result.returncode == 2 and result.stderr == expected, result.stderr


def test_a_missing_value_is_one_line_too() -> None:
    code, stderr, started, _ = run_main([*MODEL, "--hicache-spill-capacity"], {})
    assert code == 2 and len(stderr.splitlines()) == 1 and stderr.startswith(PREFIX) and not started
    with pytest.raises(ConfigError):
        launch_server.parse(["--hicache-spill-io-threads", "--hicache-spill-capacity", "1G"])
