"""The import graph of sgl_hicache, read with `ast` (nothing is imported but in the last test).

- No import cycles inside `cache/` or `server/`: module- and function-level imports count,
  `if TYPE_CHECKING:` imports do not (they never run). A function-level import can run at any
  moment, a signal handler included: one that finds its module half-imported fails.
- Inside `tier/` and `cache/` no cycles at all, type-only imports included.
- Layers: `tier` imports nothing of `cache`/`server`/`bench`, and the kernels (`sgl_hicache_kernels`,
  the top-level `kernels/` directory, a distribution the runtime depends on) nothing of the runtime
  `sgl_hicache`; here type-only imports count too (a type is a dependency).
- The tier's wings (`tier/file`, `tier/mooncake`, `tier/testing`) never import each other, and the
  top of `tier/` (the contract and what every backend shares) imports no wing: it reaches a
  backend only through `tier/registry.py`, whose lazy imports name each wing's module by string
  (checked here to exist).
- The tier names no command-line flag (issue 39): no string literal holding `--hicache` and no use
  of config's field-to-flag names; the server layer words what users see with the flags.
- `cache` imports nothing of `server`/`bench`: the server builds the cache and passes in what it
  needs (metrics, a hint source), never the other way.
- Importing the sglang plugin (`server/plugin.py`, imported in every sglang process of the
  environment, whatever the server's flags) imports no other module of ours.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    typing_only: bool


PACKAGES = {
    "sgl_hicache": ROOT / "sgl_hicache",
    # The kernels: distribution sgl-hicache-kernels, which the runtime depends on.
    "sgl_hicache_kernels": ROOT / "kernels" / "sgl_hicache_kernels",
    # Not installed with the runtime: the benchmarks and the model generator (run from a checkout) and
    # the CPU profile (distribution sgl-hicache-cpu). Read so that edges into them are seen.
    "benchmarks.bench": ROOT / "benchmarks" / "bench",
    "benchmarks.modelgen": ROOT / "benchmarks" / "modelgen",
    "sgl_hicache_cpu": ROOT / "cpu" / "sgl_hicache_cpu",
}
DEV = ("benchmarks.bench", "benchmarks.modelgen", "sgl_hicache_cpu")
LAYERS = {
    "sgl_hicache.tier": ("sgl_hicache.cache", "sgl_hicache.server", *DEV),
    # The runtime depends on the kernels' distribution: the kernels import none of it.
    "sgl_hicache_kernels": ("sgl_hicache", *DEV),
    "sgl_hicache.cache": ("sgl_hicache.server", *DEV),
    "sgl_hicache.server": DEV,
    "sgl_hicache.cli": ("sgl_hicache.cache", "sgl_hicache.server", *DEV),
    "sgl_hicache.config": DEV,
    # The CPU profile's platform, its plugin and its patches never import the runtime's cache.
    "sgl_hicache_cpu": ("sgl_hicache.cache", "sgl_hicache.server", "benchmarks.bench"),
}
# The only edges from the runtime into what its install does not hold, each a function-level import
# that fails with a one-line message where that piece is missing: the benchmark's forwarder, and
# the CPU profile's defaults for `--device cpu --tp-size N` in the launcher.
RUNTIME_TO_DEV = {
    Edge("sgl_hicache.bench", "benchmarks.bench.cli", False),
    Edge("sgl_hicache.launch_server", "sgl_hicache_cpu.cpu_tp_env", False),
}


@cache
def modules() -> dict[str, Path]:
    found = {}
    for package, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join((package, *parts[: -1 if parts[-1] == "__init__" else None]))] = path
    return found


@cache
def edges() -> tuple[Edge, ...]:
    return tuple(edge for name, path in modules().items() for edge in imports_of(name, path))


def imports_of(name: str, path: Path) -> Iterator[Edge]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node, typing_only in walk(ast.parse(path.read_text(), str(path)), False):
        for target in targets(node, package):
            if target is not None and target != name:
                yield Edge(name, target, typing_only)


def walk(node: ast.AST, typing_only: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node, typing_only
    elif isinstance(node, ast.If) and is_type_checking(node.test):
        for stmt in node.body:
            yield from walk(stmt, True)
        for stmt in node.orelse:
            yield from walk(stmt, typing_only)
    else:
        for child in ast.iter_child_nodes(node):
            yield from walk(child, typing_only)


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def targets(node: ast.Import | ast.ImportFrom, package: str) -> Iterator[str | None]:
    if isinstance(node, ast.Import):
        yield from (known(alias.name) for alias in node.names)
        return
    base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
    module = ".".join([*base, *([node.module] if node.module else [])])
    for alias in node.names:  # `from package import module` imports the module
        yield known(f"{module}.{alias.name}") or known(module)


def known(dotted: str) -> str | None:
    """The longest prefix of `dotted` that is one of our modules."""
    parts = dotted.split(".")
    return next((m for i in range(len(parts), 0, -1) if (m := ".".join(parts[:i])) in modules()), None)


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or with a self-import (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read() -> None:
    assert "sgl_hicache_kernels.layout" in modules() and "sgl_hicache.cache.spill_radix_cache" in modules()
    assert Edge("sgl_hicache.cache.controller", "sgl_hicache_kernels", False) in edges()
    assert Edge("sgl_hicache.cache.warm_start", "sgl_hicache.cache.tree", False) in edges()
    assert Edge("sgl_hicache.server.factory", "sgl_hicache.cache.device", True) in edges()
    assert Edge("sgl_hicache_kernels", "sgl_hicache_kernels.layout", False) in edges()  # relative
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"c"}, "d": {"a"}}) == [["a", "b"], ["c"]]


@pytest.mark.parametrize("package", ["sgl_hicache.cache", "sgl_hicache.server"])
def test_no_import_cycles_inside(package: str) -> None:
    graph: dict[str, set[str]] = {}
    for e in edges():
        if not e.typing_only and in_package(e.source, package) and in_package(e.target, package):
            graph.setdefault(e.source, set()).add(e.target)
    assert cycles(graph) == []


@pytest.mark.parametrize(("layer", "forbidden"), LAYERS.items())
def test_layering(layer: str, forbidden: tuple[str, ...]) -> None:
    bad = sorted(
        f"{e.source} -> {e.target}"
        for e in edges()
        if in_package(e.source, layer) and any(in_package(e.target, f) for f in forbidden)
    )
    assert not bad, f"{layer} must not import {forbidden}: {bad}"


def test_the_runtime_reaches_outside_the_wheel_only_where_it_says() -> None:
    outside = {
        edge
        for edge in edges()
        if in_package(edge.source, "sgl_hicache") and any(in_package(edge.target, dev) for dev in DEV)
    }
    assert outside == RUNTIME_TO_DEV


@pytest.mark.parametrize("package", ["sgl_hicache.tier", "sgl_hicache.cache"])
def test_no_import_cycles_even_type_only(package: str) -> None:
    """Inside `tier/` and `cache/` type-only imports count too: a module that names another's type
    for its annotations depends on it (reading it needs the other), so no circle of any kind."""
    graph: dict[str, set[str]] = {}
    for e in edges():
        if in_package(e.source, package) and in_package(e.target, package):
            graph.setdefault(e.source, set()).add(e.target)
    assert cycles(graph) == []


TIER = "sgl_hicache.tier"
WINGS = ("sgl_hicache.tier.file", "sgl_hicache.tier.mooncake", "sgl_hicache.tier.testing")


def wing_of(module: str) -> str | None:
    return next((w for w in WINGS if in_package(module, w)), None)


@pytest.mark.parametrize("wing", WINGS)
def test_a_wing_of_the_tier_imports_no_other_wing(wing: str) -> None:
    bad = sorted(
        f"{e.source} -> {e.target}"
        for e in edges()
        if in_package(e.source, wing) and wing_of(e.target) not in (None, wing)
    )
    assert not bad, f"{wing} must not import another wing of the tier: {bad}"


def test_the_top_of_the_tier_reaches_a_wing_only_through_the_registry() -> None:
    bad = sorted(
        f"{e.source} -> {e.target}"
        for e in edges()
        if in_package(e.source, TIER) and wing_of(e.source) is None and wing_of(e.target) is not None
    )
    assert not bad, f"the top of tier/ imports a wing (go through tier/registry.py): {bad}"
    from sgl_hicache.tier.registry import BACKENDS

    for backend in BACKENDS.values():
        assert wing_of(backend.module) is not None and backend.module in modules(), backend
        assert f"class {backend.cls}(" in modules()[backend.module].read_text(), backend


FLAG_NAMERS = ("flag_named", "flag_of")  # config's field-to-flag names (sgl_hicache/config/fields.py)


def cli_names_in(path: Path) -> list[str]:
    """Where the module at `path` names a command-line flag: a string literal holding `--hicache`
    (docstrings included), or a use of config's field-to-flag names (`FLAG_NAMERS`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "--hicache" in node.value:
            names.append(repr(node.value[:40]))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names += [a.name for a in node.names if a.name.rpartition(".")[2] in FLAG_NAMERS]
        elif isinstance(node, ast.Name | ast.Attribute):
            names += [n for n in (getattr(node, "id", None), getattr(node, "attr", None)) if n in FLAG_NAMERS]
        found += [f"{path.name}:{node.lineno}: {n}" for n in names if hasattr(node, "lineno")]
    return found


def test_the_tier_names_no_command_line_flag() -> None:
    """Issue 39: the tier speaks in its config's terms (`TierConfig` fields, typed results); the
    server layer words what users see with the flags' names (e.g. `server/room.py`)."""
    assert cli_names_in(Path(__file__)), "the check finds nothing: it proves nothing"
    bad = [hit for name, path in modules().items() if in_package(name, TIER) for hit in cli_names_in(path)]
    assert not bad, f"tier/ names command-line flags: {bad}"


IMPORT_PLUGIN = """
import json, sys
before = set(sys.modules)
import sgl_hicache.server.plugin
print(json.dumps(sorted(m for m in set(sys.modules) - before if m.startswith("sgl_hicache"))))
"""


def test_importing_the_plugin_imports_nothing_else_of_ours() -> None:
    out = subprocess.run([sys.executable, "-c", IMPORT_PLUGIN], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    imported = set(json.loads(out.stdout))
    assert imported <= {"sgl_hicache", "sgl_hicache.server", "sgl_hicache.server.plugin"}, imported
