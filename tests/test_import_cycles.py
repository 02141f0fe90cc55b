"""No import cycle inside any package (packages/*/src/nnscaler/<part>).

The rule, read statically with ``ast`` (nothing is imported):
- every ``import`` / ``from ... import`` of a module of the same part counts, at module level,
  inside a function body and under ``if TYPE_CHECKING:``: an import moved into a function only
  hides a cycle from the interpreter, and one made for type checking only hides it from the
  reader; either way the two modules need each other (a helper that names the type of a class
  whose module imports the helper is that class spread over two files). Such a name goes to the
  lower module, or the helper names a small interface the lower module defines
  (``nnscaler.ir.tracer.surface.TracerSurface`` for the tracer's helpers).
- the edge goes to the module named: ``from pkg import sub`` reaches ``pkg.sub`` when ``sub`` is a
  module file, otherwise ``pkg`` (its ``__init__``). The parent packages Python runs first are not
  counted: a package's ``__init__`` importing its own modules is its export list, not a cycle.
Each cycle is reported as a chain of files with the line of each import.
"""
from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def module_name(src: Path, path: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, module: str, is_package: bool, known: set[str]) -> dict[str, int]:
    """``{imported module: line}`` for each module of ``known`` that ``source`` imports."""
    package = module if is_package else module.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pieces = package.split(".")
                pieces = pieces[:len(pieces) - (node.level - 1)]
                base = ".".join(pieces + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for name in names:
            while name and name not in known:  # `import a.b.c` of a name inside a module
                name = name.rpartition(".")[0]
            if name and name != module:
                found.setdefault(name, node.lineno)
    return found


def graph_of(sources: dict[str, tuple[str, bool]]) -> dict[str, dict[str, int]]:
    """The import graph of ``{module: (source, is_package)}``."""
    known = set(sources)
    return {m: imports_of(src, m, is_pkg, known) for m, (src, is_pkg) in sources.items()}


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (a list of modules, first == last) per strongly connected group."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan; the graphs are a few hundred modules
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    out = []
    for group in groups:
        members = set(group)
        start = min(group)
        # the shortest way back to `start` inside the group, by breadth-first search
        paths = {start: [start]}
        frontier = [start]
        chain = None
        while frontier and chain is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w == start:
                        chain = paths[v] + [start]
                        break
                    if w in members and w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
                if chain:
                    break
            frontier = nxt
        out.append(chain)
    return out


def package_sources(part_src: Path) -> tuple[dict[str, tuple[str, bool]], dict[str, Path]]:
    src = part_src.parents[1]  # packages/nnscaler-x/src
    sources, files = {}, {}
    for path in sorted(part_src.rglob("*.py")):
        name = module_name(src, path)
        sources[name] = (path.read_text(encoding="utf-8"), path.name == "__init__.py")
        files[name] = path
    return sources, files


PARTS = sorted(ROOT.glob("packages/*/src/nnscaler/*/__init__.py"))


def test_every_package_is_checked():
    assert len(PARTS) >= 8, PARTS


@pytest.mark.parametrize("init", PARTS, ids=lambda p: p.parent.name)
def test_no_import_cycle_inside_the_package(init: Path):
    sources, files = package_sources(init.parent)
    graph = graph_of(sources)
    found = cycles(graph)
    report = []
    for chain in found:
        steps = [f"{files[a].relative_to(ROOT)}:{graph[a][b]} imports {b}" for a, b in zip(chain, chain[1:])]
        report.append("\n    ".join(steps))
    assert not found, ("import cycles; move the shared name to the lower module, or import it "
                       "from the module that defines it:\n  " + "\n  ".join(report))


# ------------------------------------------------------------------- the checker can fail


def _graph(modules: dict[str, str]) -> dict[str, dict[str, int]]:
    """The graph of modules ``p.*`` in a package ``p`` with an empty ``__init__``."""
    sources = {m: (textwrap.dedent(s), False) for m, s in modules.items()}
    return graph_of({"p": ("", True), **sources})


@pytest.mark.parametrize("a_source", [
    "from p.b import x",                      # module level
    "def f():\n    from .b import x",         # hidden in a function
    "import p.b.x",                           # a name past the module
])
def test_a_cycle_is_found(a_source):
    graph = _graph({"p.a": a_source, "p.b": "from .a import y"})
    assert cycles(graph) == [["p.a", "p.b", "p.a"]]


def test_a_longer_cycle_is_reported_as_a_chain():
    graph = _graph({"p.a": "from .b import x", "p.b": "from .c import x", "p.c": "from .a import x"})
    assert cycles(graph) == [["p.a", "p.b", "p.c", "p.a"]]


def test_no_false_cycle():
    # a package's __init__ exporting its modules, and a module importing a sibling, is no cycle
    graph = graph_of({"p": ("from .a import x\nfrom .b import y", True),
                      "p.a": ("from .b import y", False), "p.b": ("import os", False)})
    assert cycles(graph) == []


@pytest.mark.parametrize("a_source", [
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B",
    "import typing\nif typing.TYPE_CHECKING:\n    from p.b import B",
    "if TYPE_CHECKING:\n    pass\nelse:\n    from .b import B",
])
def test_type_checking_imports_count(a_source):
    graph = _graph({"p.a": a_source, "p.b": "from .a import y"})
    assert cycles(graph) == [["p.a", "p.b", "p.a"]]
