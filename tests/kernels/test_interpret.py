"""Runs the Triton cases of the kernel tests under TRITON_INTERPRET=1 in a child pytest.

Triton decides interpreted vs compiled when a kernel is decorated (at import), so the variable has to
be set before the first import; a child process keeps it out of every other test in this session.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.mark.interpret
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="already inside the interpreter run")
@pytest.mark.parametrize("test_file", ["test_pack.py", "test_groups.py", "test_sglang_pools.py"])
def test_triton_cases_under_interpreter(test_file: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "interpret",
        "-p",
        "no:cacheprovider",
        str(HERE / test_file),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout.splitlines()[-1], proc.stdout[-2000:]
