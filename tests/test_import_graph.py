"""The import graph of sgl_hicache, read with `ast` (nothing is imported).

- No import cycles inside `cache/`: module- and function-level imports count, `if TYPE_CHECKING:`
  imports do not (they never run).
- Layers: `tier` imports nothing of `cache`/`server`/`bench`, and `kernels` (the top-level
  `kernels/` directory, installed as `sgl_hicache.kernels`) nothing of `cache`/`server`; here
  type-only imports count too (a type is a dependency).
- `cache` imports nothing of `server`/`bench`: the server builds the cache and passes in what it
  needs (metrics, a hint source), never the other way.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"sgl_hicache": ROOT / "sgl_hicache", "sgl_hicache.kernels": ROOT / "kernels"}
LAYERS = {
    "sgl_hicache.tier": ("sgl_hicache.cache", "sgl_hicache.server", "sgl_hicache.bench"),
    "sgl_hicache.kernels": ("sgl_hicache.cache", "sgl_hicache.server"),
    "sgl_hicache.cache": ("sgl_hicache.server", "sgl_hicache.bench"),
}


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    typing_only: bool


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
    assert "sgl_hicache.kernels.layout" in modules() and "sgl_hicache.cache.spill_radix_cache" in modules()
    assert Edge("sgl_hicache.cache.spill_io", "sgl_hicache.kernels", False) in edges()
    assert Edge("sgl_hicache.cache.warm_start", "sgl_hicache.cache.spill_radix_cache", True) in edges()
    assert Edge("sgl_hicache.kernels", "sgl_hicache.kernels.layout", False) in edges()  # relative
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"c"}, "d": {"a"}}) == [["a", "b"], ["c"]]


def test_no_import_cycles_inside_cache() -> None:
    graph: dict[str, set[str]] = {}
    for e in edges():
        if (
            not e.typing_only
            and in_package(e.source, "sgl_hicache.cache")
            and in_package(e.target, "sgl_hicache.cache")
        ):
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
