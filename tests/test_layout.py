"""The package's import structure (read from the source, nothing imported): the kernels never
reach the planner, and no module imports one that imports it back. CPU only, no CuTe DSL."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

PACKAGE = "fa4gen"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _resolve(node: ast.ImportFrom, importer: str) -> str:
    """The absolute module of a ``from`` import (relative ones resolved against the importer)."""
    if not node.level:
        return node.module or ""
    package = importer if _modules()[importer].name == "__init__.py" else importer.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _runtime_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


@cache
def _graph() -> dict[str, frozenset[str]]:
    """Module -> the package modules it imports, at module level or inside functions: ``import
    fa4gen.x.y`` is an edge to fa4gen.x.y, ``from fa4gen.x import y`` one to fa4gen.x (and one to
    fa4gen.x.y too where y is a module). A parent package that Python loads on the way is no
    edge; a package's __init__ importing its submodules is one, and so is a submodule importing
    its package's __init__ (together they make a cycle). Imports under ``if TYPE_CHECKING:`` are
    left out: they never run, so they make no import cycle."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in _runtime_nodes(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node, name)
                edges.add(base)
                edges.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules)
        graph[name] = frozenset(e for e in edges if e in modules and e != name)
    return graph


def _cycles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each as one cycle
    through it, sorted: a shortest path back to its first module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(_a_cycle(graph, set(component), component[0]) for component in components)


def _a_cycle(graph: dict[str, frozenset[str]], members: set[str], start: str) -> list[str]:
    """A shortest path from ``start`` back to itself within ``members`` (breadth first)."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph[node] & members):
                if succ == start:
                    return paths[node] + [start]
                if succ not in paths:
                    paths[succ] = paths[node] + [succ]
                    following.append(succ)
        frontier = following
    raise AssertionError(f"{start} is in no cycle")


def _reachable(graph: dict[str, frozenset[str]], starts: list[str]) -> dict[str, list[str]]:
    """Module -> a path of imports from one of ``starts`` to it."""
    paths = {start: [start] for start in starts}
    frontier = list(starts)
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph[node]):
                if succ not in paths:
                    paths[succ] = paths[node] + [succ]
                    following.append(succ)
        frontier = following
    return paths


def test_the_graph_sees_the_package():
    graph = _graph()
    assert {
        "fa4gen",
        "fa4gen.planner",
        "fa4gen.planner.sm90",
        "fa4gen.kernels.sm90.fwd",
        "fa4gen.kernels.sm90.config",
    } <= set(graph)
    assert "fa4gen.kernels.sm90.config" in graph["fa4gen.planner.sm90"]
    assert "fa4gen.planner.sm90" in graph["fa4gen.planner"]
    # a cycle the checker must find: a -> b -> c -> a, beside a tail d -> a
    toy = {"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"}), "d": frozenset({"a"})}
    assert _cycles(toy) == [["a", "b", "c", "a"]]
    assert _cycles({"a": frozenset({"b"}), "b": frozenset()}) == []


def test_kernels_never_import_the_planner():
    """The kernel reads its config (fa4gen.kernels.<arch>.config); the planner produces it. No
    module of fa4gen.kernels imports the planner, directly or through other modules."""
    graph = _graph()
    kernels = [name for name in graph if name == f"{PACKAGE}.kernels" or name.startswith(f"{PACKAGE}.kernels.")]
    assert len(kernels) > 5
    reached = _reachable(graph, kernels)
    planner = {
        name: " -> ".join(path)
        for name, path in reached.items()
        if name == f"{PACKAGE}.planner" or name.startswith(f"{PACKAGE}.planner.")
    }
    assert planner == {}


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_what_shapes_an_artifact_never_imports_a_host_only_module():
    """The cache key fingerprints every module but the host-only ones (toolchain.HOST_ONLY_*):
    a fingerprinted module that imported one would let an edit there change a kernel while its
    key stayed the same."""
    from fa4gen.toolchain import _host_only

    graph = _graph()

    def host_only(name: str) -> bool:
        path = _modules()[name]
        return name == PACKAGE or _host_only(path.relative_to(ROOT))

    shaping = [name for name in graph if not host_only(name)]
    assert {"fa4gen.compiler", "fa4gen.emitter", "fa4gen.kernels.sm90.fwd"} <= set(shaping)
    assert {"fa4gen.hf", "fa4gen.runtime", "fa4gen.cache"} <= {n for n in graph if host_only(n)}
    reached = _reachable(graph, shaping)
    leaks = {name: " -> ".join(path) for name, path in reached.items() if host_only(name)}
    assert leaks == {}
