"""Does mypy check calls into `sgl_hicache.kernels`? A probe module passes a `str` as `pack_kv`'s view.

`kernels/` is installed as `sgl_hicache.kernels` through setuptools `package-dir`; the editable
install maps it with an import hook, which mypy cannot follow: without help mypy finds `sgl_hicache`
in the working directory, no `sgl_hicache/kernels` inside it, and `ignore_missing_imports` silently
makes every name imported from `sgl_hicache.kernels` `Any`. `typings/sgl_hicache/kernels` (a symlink
to `kernels/`) on the config's `mypy_path` gives mypy the installed package's shape, so it checks the
boundary as `make typecheck` runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = """\
from sgl_hicache.kernels import pack_kv


def probe() -> None:
    pack_kv("not a view", 0, 0)
"""
EXPECTED = 'Argument 1 to "pack_kv" has incompatible type "str"; expected "KVPoolView"'


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mypy_cache")


def mypy(probe_dir: Path, cache_dir: Path, mypy_path: Path | None, *flags: str) -> str:
    probe = probe_dir / "probe.py"
    probe.write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "MYPYPATH"}
    if mypy_path is not None:
        env["MYPYPATH"] = str(mypy_path)
    command = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
               "--cache-dir", str(cache_dir), *flags, str(probe)]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    return result.stdout + result.stderr


def test_mypy_checks_the_boundary_given_the_package_shape(tmp_path: Path, mypy_cache: Path) -> None:
    shape = tmp_path / "shape"
    (shape / "sgl_hicache").mkdir(parents=True)
    (shape / "sgl_hicache" / "kernels").symlink_to(ROOT / "kernels", target_is_directory=True)
    # torch's own types are not what this probes: leaving site-packages out keeps it at ~1 s, not ~15 s
    assert EXPECTED in mypy(tmp_path, mypy_cache, shape, "--no-site-packages")


def test_mypy_checks_the_boundary_as_make_typecheck_runs_it(tmp_path: Path, mypy_cache: Path) -> None:
    assert EXPECTED in mypy(tmp_path, mypy_cache, None)
