"""What the wheels hold (issues 28, 39): the runtime wheel (`sgl-hicache`, the repository root) holds
the runtime only, every module of it, names in its entry points only what it holds, and depends on
the kernels' wheel (`sgl-hicache-kernels`, `kernels/`) at its version, which holds every kernel
module; the CPU profile's wheel (`sgl-hicache-cpu`, `cpu/`) holds the CPU pieces and its entry
points. The benchmarks and the model generator (`benchmarks/`) are in none: they run from a
checkout's root, and the runtime says so."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from email.parser import HeaderParser
from pathlib import Path

import pytest

from sgl_hicache import launch_server
from sgl_hicache.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def build_wheel(project: Path, parts: tuple[str, ...], tmp: Path) -> zipfile.ZipFile:
    """Build `project`'s wheel from a copy of its `parts`: an in-place build would leave build/ and
    egg-info in the checkout (stale modules in later wheels, stale entry points for sglang)."""
    source = tmp / "source"
    for part in parts:
        if (project / part).is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
            shutil.copytree(project / part, source / part, ignore=ignore)
        else:
            source.mkdir(parents=True, exist_ok=True)
            shutil.copy2(project / part, source / part)
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--disable-pip-version-check",
         "-w", str(tmp / "dist"), str(source)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("*.whl")
    return zipfile.ZipFile(wheel)


def entry_points(wheel: zipfile.ZipFile) -> dict[str, dict[str, str]]:
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(wheel.read(name).decode())
    return {section: dict(parser[section]) for section in parser.sections()}


def requirements(wheel: zipfile.ZipFile) -> list[str]:
    """The wheel's `Requires-Dist` lines (its METADATA)."""
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return HeaderParser().parsestr(wheel.read(name).decode()).get_all("Requires-Dist") or []


def module_file(target: str) -> str:
    """`pkg.mod:attr` -> `pkg/mod.py`."""
    return target.partition(":")[0].replace(".", "/") + ".py"


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    return build_wheel(
        ROOT, ("pyproject.toml", "README.md", "sgl_hicache"), tmp_path_factory.mktemp("runtime")
    )


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    return build_wheel(
        ROOT / "kernels", ("pyproject.toml", "sgl_hicache_kernels"), tmp_path_factory.mktemp("kernels")
    )


@pytest.fixture(scope="module")
def cpu_profile(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    return build_wheel(ROOT / "cpu", ("pyproject.toml", "sgl_hicache_cpu"), tmp_path_factory.mktemp("cpu"))


def test_the_runtime_wheel_holds_every_runtime_module_and_nothing_else(runtime: zipfile.ZipFile) -> None:
    held = {n for n in runtime.namelist() if n.endswith(".py")}
    expected = {
        f"sgl_hicache/{p.relative_to(ROOT / 'sgl_hicache')}" for p in (ROOT / "sgl_hicache").rglob("*.py")
    }
    assert held == expected
    outside = ("benchmarks/", "sgl_hicache_cpu/", "sgl_hicache_kernels/", "kernels/", "tests/")
    assert not [n for n in runtime.namelist() if n.startswith(outside)]
    assert not [n for n in held if "modelgen" in n or "/platform/" in n or "/bench/" in n or "kernels" in n]


def test_the_runtime_wheel_depends_on_the_kernels_at_their_version(runtime: zipfile.ZipFile) -> None:
    version = tomllib.loads((ROOT / "kernels" / "pyproject.toml").read_text())["project"]["version"]
    assert version == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert f"sgl-hicache-kernels=={version}" in requirements(runtime)


def test_the_kernels_wheel_holds_every_kernel_module_and_nothing_else(kernels: zipfile.ZipFile) -> None:
    package = ROOT / "kernels" / "sgl_hicache_kernels"
    held = {n for n in kernels.namelist() if not n.startswith("sgl_hicache_kernels-")}  # not .dist-info
    assert held == {f"sgl_hicache_kernels/{p.relative_to(package)}" for p in package.rglob("*.py")}
    assert not [n for n in kernels.namelist() if n.endswith("entry_points.txt")]
    assert not [r for r in requirements(kernels) if r.startswith(("sgl-hicache", "sglang"))]


def test_the_runtime_wheel_names_only_what_it_holds(runtime: zipfile.ZipFile) -> None:
    points = entry_points(runtime)
    assert points["sglang.srt.plugins"] == {"sgl_hicache": "sgl_hicache.server.plugin:register"}
    assert "sglang.srt.platforms" not in points  # the CPU platform is the CPU profile's
    for group in points.values():
        for target in group.values():
            assert (
                module_file(target) in runtime.namelist()
                or target.partition(":")[0].replace(".", "/") + "/__init__.py" in runtime.namelist()
            ), target


def test_the_cpu_profile_wheel_holds_the_cpu_pieces(cpu_profile: zipfile.ZipFile) -> None:
    held = {n for n in cpu_profile.namelist() if n.endswith(".py")}
    expected = {f"sgl_hicache_cpu/{p.name}" for p in (ROOT / "cpu" / "sgl_hicache_cpu").glob("*.py")}
    assert held == expected
    points = entry_points(cpu_profile)
    assert points["sglang.srt.platforms"] == {"sgl_hicache_cpu": "sgl_hicache_cpu.cpu_tp_platform:activate"}
    assert points["sglang.srt.plugins"] == {"sgl_hicache_cpu": "sgl_hicache_cpu.plugin:register"}
    for group in points.values():
        for target in group.values():
            assert module_file(target) in held, target


def without_the_checkout(tmp_path: Path) -> dict[str, str]:
    """An environment where this checkout's `sgl_hicache` is importable but the checkout is not on the
    import path: a directory holding only a link to the package (as an install would) takes the
    place of PYTHONPATH, which may name the checkout (`PYTHONPATH=$PWD` in a worktree)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sgl_hicache").symlink_to(ROOT / "sgl_hicache", target_is_directory=True)
    return {**os.environ, "PYTHONPATH": str(site)}


def bench_help(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run `code` (`python -c`) from `tmp_path`, a directory outside the checkout."""
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=without_the_checkout(tmp_path),
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def one_line(where: str) -> list[str]:
    return [
        "python -m sgl_hicache.bench: the benchmark runs from a source checkout of sgl-hicache "
        f"(it is not in the installed package): run it from {where}"
    ]


FORWARD = """
import runpy, sys
sys.argv[1:] = ["--help"]
runpy.run_module("sgl_hicache.bench", run_name="__main__")
"""


def test_the_benchmark_outside_the_checkouts_root_names_the_checkout(tmp_path: Path) -> None:
    """An editable install knows its checkout, but the benchmark is run from there only: the
    forwarder puts nothing on the import path (issue 39)."""
    out = bench_help(FORWARD, tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip().splitlines() == one_line(str(ROOT))


NO_CHECKOUT = """
import sys
from pathlib import Path
import sgl_hicache.bench as forwarder
forwarder.CHECKOUT = Path("/nonexistent")  # as an installed wheel, far from any checkout
sys.argv[1:] = ["--help"]
sys.exit(forwarder.main())
"""


def test_the_benchmark_of_an_installed_wheel_says_where_it_runs(tmp_path: Path) -> None:
    out = bench_help(NO_CHECKOUT, tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip().splitlines() == one_line("a checkout's root")


WITHOUT_CPU_PROFILE = """
import runpy, sys
sys.modules["sgl_hicache_cpu"] = None  # a GPU box: the CPU profile is not installed
sys.argv[1:] = ["--help"]
runpy.run_module("sgl_hicache.bench", run_name="__main__")
"""


def test_the_benchmark_runs_from_the_checkouts_root_without_the_cpu_profile() -> None:
    out = subprocess.run([sys.executable, "-c", WITHOUT_CPU_PROFILE], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--servers" in out.stdout and "--device" in out.stdout


def test_two_servers_are_not_pinned_without_the_cpu_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks.bench import cluster

    assert all(share for share in cluster.server_cpus())  # here: each server its own CPUs
    monkeypatch.setitem(sys.modules, "sgl_hicache_cpu", None)
    monkeypatch.delitem(sys.modules, "sgl_hicache_cpu.cpu_tp_env", raising=False)
    assert cluster.server_cpus() == (None,) * cluster.SERVERS


def test_cpu_tensor_parallelism_without_the_cpu_profile_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sgl_hicache_cpu", None)  # as where `cpu/` is not installed
    monkeypatch.delitem(sys.modules, "sgl_hicache_cpu.cpu_tp_env", raising=False)
    assert launch_server.cpu_tp_defaults(["--device", "cpu"]) == {}
    assert launch_server.cpu_tp_defaults(["--device", "cpu", "--tp-size", "1"]) == {}
    with pytest.raises(ConfigError, match="needs the CPU profile"):
        launch_server.cpu_tp_defaults(["--device", "cpu", "--tp-size", "2"])
    with pytest.raises(ConfigError, match="needs the CPU profile"):
        launch_server.cpu_tp_defaults(["--device", "cpu", "--tensor-parallel-size=4"])
    with pytest.raises(ConfigError, match="needs the CPU profile"):  # argparse keeps the last
        launch_server.cpu_tp_defaults(["--device", "cpu", "--tp-size", "1", "--tensor-parallel-size", "2"])
    assert launch_server.cpu_tp_defaults(["--device", "cpu", "--tp-size=2", "--tp-size", "1"]) == {}
