"""Does mypy check calls into `sgl_hicache_kernels`? A probe module passes a `str` as `pack_kv`'s view.

The kernels are their own distribution (`kernels/`, sgl-hicache-kernels), installed editable through
an import hook that mypy cannot follow: without help mypy finds no `sgl_hicache_kernels`, and
`ignore_missing_imports` silently makes every name imported from it `Any`, so no call across the
boundary is checked. The config's `mypy_path` names `kernels/`, where mypy reads the package: the
first test runs mypy as `make typecheck` does and must see the probe's error; the second runs it
with that entry left out and sees the error vanish, which is what the first guards against.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = """\
from sgl_hicache_kernels import pack_kv


def probe() -> None:
    pack_kv("not a view", 0, 0)
"""
EXPECTED = 'Argument 1 to "pack_kv" has incompatible type "str"; expected "KVPoolView"'
MYPY_PATH = re.compile(r'^mypy_path = "(.*)"$', re.MULTILINE)


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mypy_cache")


def mypy(probe_dir: Path, cache_dir: Path, config: Path, *flags: str) -> str:
    probe = probe_dir / "probe.py"
    probe.write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "MYPYPATH"}
    command = [sys.executable, "-m", "mypy", "--config-file", str(config),
               "--cache-dir", str(cache_dir), *flags, str(probe)]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    return result.stdout + result.stderr


def test_mypy_checks_the_boundary_as_make_typecheck_runs_it(tmp_path: Path, mypy_cache: Path) -> None:
    assert EXPECTED in mypy(tmp_path, mypy_cache, ROOT / "pyproject.toml")


def test_without_the_kernels_on_mypy_path_the_boundary_goes_unchecked(
    tmp_path: Path, mypy_cache: Path
) -> None:
    config = (ROOT / "pyproject.toml").read_text()
    (entries,) = MYPY_PATH.findall(config)
    kept = [e for e in entries.split(",") if e != "$MYPY_CONFIG_FILE_DIR/kernels"]
    assert len(kept) == len(entries.split(",")) - 1, entries  # the config names kernels/ once
    edited = tmp_path / "pyproject.toml"  # $MYPY_CONFIG_FILE_DIR: tmp_path, so name ROOT's dirs
    edited.write_text(MYPY_PATH.sub(f'mypy_path = "{",".join(kept)}"', config).replace(
        "$MYPY_CONFIG_FILE_DIR", str(ROOT)))  # fmt: skip
    # torch's own types are not what this probes: leaving site-packages out keeps it at ~1 s, not ~15 s
    out = mypy(tmp_path, mypy_cache, edited, "--no-site-packages")
    assert EXPECTED not in out and "Success" in out, out
