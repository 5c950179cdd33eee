"""Our launcher's `main` run in-process with sglang's start stubbed (tests of flags and refusals)."""

from __future__ import annotations

import contextlib
import io
import os
from typing import NamedTuple

import pytest

import sgl_hicache.launch_server as launch_server
import sgl_hicache.server.hints as hints
from sgl_hicache.server.handoff import ENV_CONFIG

PREFIX = "python -m sgl_hicache.launch_server: error: "


class Run(NamedTuple):
    code: int
    stderr: str
    started: list[list[str]]  # the argv sglang was started with, once per start
    env: dict[str, str]  # the environment after main returned


def run_main(argv: list[str], env: dict[str, str] | None = None, seam: bool = True) -> Run:
    """`launch_server.main(argv)` under `env` (no other `SGL_HICACHE_*` variable), sglang's start and
    (with `seam`) the seam check stubbed; sglang's argument parser is not: it refuses sglang's flags."""
    started: list[list[str]] = []
    stderr = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_CONFIG, "")  # recorded, so that what main exports is undone
        for name in [n for n in os.environ if n.startswith("SGL_HICACHE_")]:
            mp.delenv(name)
        for name, value in (env or {}).items():
            mp.setenv(name, value)
        mp.setenv("PYTHONWARNINGS", "")
        if seam:
            mp.setattr(launch_server, "check_seam", lambda: None)
        mp.setattr(launch_server, "run_sglang", lambda args: started.append(args) or 0)
        mp.setattr(hints, "private_runtime_dir", contextlib.nullcontext)
        with contextlib.redirect_stderr(stderr):
            code = launch_server.main(argv)
        after = dict(os.environ)
    return Run(code, stderr.getvalue(), started, after)


def refusal(run: Run) -> str:
    """The one line a refused launch printed, without the prefix; fails unless it was refused so."""
    lines = run.stderr.splitlines()
    assert run.code == 2 and len(lines) == 1 and lines[0].startswith(PREFIX), run.stderr
    assert run.started == [], "sglang was started"
    return lines[0].removeprefix(PREFIX)
