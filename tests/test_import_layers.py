"""The package's import layers (DESIGN.md §1, issue 18): files import downward only.

Every module under ``python/kvtier`` is parsed with :mod:`ast` (nothing is imported) and every
import statement in it counts: module level, inside functions and methods, and under
``if TYPE_CHECKING:`` (a type-only import is still a dependency a reader must follow), and
``__import__``/``importlib.import_module`` calls with a literal module name.
``import a.b`` and ``from a.b import c`` depend on ``a.b``, or on ``a.b.c`` where that is a module;
relative imports are resolved against the importing package; ``kvtier._core`` (the PyO3 extension)
is a module of its own. Merely being a submodule of a package is not an import of that package's
``__init__``; an explicit ``from kvtier.engine import load`` inside ``kvtier.engine.llm`` is.

The rules:

(a) No import cycle between kvtier modules, however long, at any level.
(b) ``kvtier.sched`` and ``kvtier.radix`` are the control plane's lowest layers (DESIGN.md §1: the
    policies and the prefix index, used by the simulator and the reference engine alike). They may
    import themselves, ``kvtier.sched`` may import ``kvtier.radix`` (below it in the layer map, not
    the reverse), and both may import the data model's pure basics, :data:`BASICS`:
    ``kvtier.errors`` (the error family, what both import today), ``kvtier.geometry`` and
    ``kvtier.keys`` (the Python faces of kvtier-core's geometry and block keys, which do no I/O),
    and ``kvtier.tiers`` (the one tier enum, issue 18 step 5).
    Nothing else: no store, transfer, config, simulator, engine, connector or CLI.
(c) ``kvtier.sim`` (the simulator) never imports the CPU reference engine (``kvtier.engine``), the
    engine integrations (``kvtier.integrations``) or the front ends above it (``kvtier.bench``,
    ``kvtier.cli``): the engine is validated *against* the simulator (``kvtier.engine.calibrate``,
    ``kvtier.engine.validate`` import ``kvtier.sim``), never the other way round.
(d) ``kvtier.testing`` (loopback servers for tests, issue 18) is scaffolding, not product: only
    :data:`TESTING_IMPORTERS` (the benchmarks and the demo, which start a throw-away server when
    given none) import it, and it imports no other kvtier module.

:data:`ALLOWED_EDGES` lists the known exceptions, each with its issue and what removes it; an entry
that no longer matches an import fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from itertools import pairwise
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "python"
EXTENSIONS = ("kvtier._core",)  # compiled modules: no source to parse, nothing they import counts
BASICS = frozenset({"kvtier.errors", "kvtier.geometry", "kvtier.keys", "kvtier.tiers"})
SIM_FORBIDDEN = ("kvtier.engine", "kvtier.integrations", "kvtier.bench", "kvtier.cli")
TESTING = "kvtier.testing"
TESTING_IMPORTERS = ("kvtier.bench", "kvtier.engine.replay")

#: (importer, imported) -> why it is still there and what removes it. Each entry is left out of the
#: graph for every rule below; any cycle or layer break that does not need it still fails.
ALLOWED_EDGES: Mapping[tuple[str, str], str] = {}

Graph = dict[str, dict[str, int]]  # importer -> imported -> first line


def discover(root: Path) -> dict[str, tuple[Path, bool]]:
    """Module name -> (source file, whether it is a package's ``__init__``)."""
    modules: dict[str, tuple[Path, bool]] = {}
    for path in sorted((root / "kvtier").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def imports_of(source: str, module: str, is_package: bool, known: Iterable[str]) -> Iterator[tuple[str, int]]:
    """``(imported kvtier module, line)`` for every import statement in ``source``, at any depth."""
    known = set(known)

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            targets = [
                f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in known else origin
                for alias in node.names
            ]
        elif isinstance(node, ast.Call) and (dynamic := _dynamic_import(node)) is not None:
            targets = [dynamic]
        else:
            continue
        for target in targets:
            if target == "kvtier" or target.startswith("kvtier."):
                resolved = resolve(target)
                if resolved is not None and resolved != module:
                    yield resolved, node.lineno


def _dynamic_import(node: ast.Call) -> str | None:
    """The literal name in ``__import__("kvtier.x")`` or ``importlib.import_module("kvtier.x")``."""
    if not node.args:
        return None
    func, first = node.func, node.args[0]
    named = (isinstance(func, ast.Name) and func.id == "__import__") or (
        isinstance(func, ast.Attribute) and func.attr == "import_module"
    )
    if named and isinstance(first, ast.Constant) and isinstance(first.value, str):
        return first.value
    return None


def import_graph(root: Path = PACKAGE_ROOT) -> Graph:
    modules = discover(root)
    known = set(modules) | set(EXTENSIONS)
    graph: Graph = {name: {} for name in known}
    for name, (path, is_package) in modules.items():
        for imported, line in imports_of(path.read_text(), name, is_package, known):
            graph[name].setdefault(imported, line)
    return graph


def without_allowed(graph: Graph) -> Graph:
    return {
        a: {b: line for b, line in out.items() if (a, b) not in ALLOWED_EDGES} for a, out in graph.items()
    }


def cycles(graph: Graph) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) through each strongly connected component of more than one
    module, found by Tarjan's algorithm (iteratively) and a search inside the component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return [_cycle_in(graph, set(component), component[0]) for component in components]


def _cycle_in(graph: Graph, component: set[str], start: str) -> list[str]:
    """A shortest path from ``start`` back to itself inside ``component`` (breadth first)."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child not in component:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if child not in parent:
                    parent[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{start} is in a strongly connected component but on no cycle")


def describe(graph: Graph, cycle: list[str]) -> str:
    steps = [f"{a} (line {graph[a][b]})" for a, b in pairwise(cycle)]
    return " -> ".join([*steps, cycle[-1]])


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.fixture(scope="module")
def graph() -> Graph:
    return import_graph()


# The checker itself -------------------------------------------------------------------------------


def test_imports_are_found_at_every_depth_and_resolved() -> None:
    source = """
from __future__ import annotations
import kvtier.sim.cost
from typing import TYPE_CHECKING
from . import core
from ..errors import ConfigError
from kvtier import _core, geometry
if TYPE_CHECKING:
    from kvtier.engine.scheduler import Engine

def f() -> None:
    from kvtier.engine import load
    import numpy
    importlib.import_module("kvtier.sim")
"""
    known = {
        "kvtier", "kvtier._core", "kvtier.errors", "kvtier.geometry", "kvtier.engine",
        "kvtier.engine.scheduler", "kvtier.sim", "kvtier.sim.core", "kvtier.sim.cost",
        "kvtier.sim.run",
    }  # fmt: skip
    found = dict(imports_of(source, "kvtier.sim.run", False, known))
    assert found == {
        "kvtier.sim.cost": 3,
        "kvtier.sim.core": 5,
        "kvtier.errors": 6,
        "kvtier._core": 7,
        "kvtier.geometry": 7,
        "kvtier.engine.scheduler": 9,
        "kvtier.engine": 12,
        "kvtier.sim": 14,
    }


def test_cycles_are_found_and_named() -> None:
    g: Graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}, "e": {"d": 5}}
    assert cycles(g) == [["a", "b", "c", "a"]]
    assert describe(g, ["a", "b", "c", "a"]) == "a (line 1) -> b (line 2) -> c (line 3) -> a"
    assert cycles({"a": {"b": 1}, "b": {}}) == []
    two = cycles({"a": {"b": 1}, "b": {"a": 1}, "c": {"d": 1}, "d": {"c": 1}})
    assert two == [["c", "d", "c"], ["a", "b", "a"]] or two == [["a", "b", "a"], ["c", "d", "c"]]


def test_the_real_graph_is_the_package(graph: Graph) -> None:
    assert {"kvtier", "kvtier._core", "kvtier.sched.base", "kvtier.sim.engine"} <= set(graph)
    assert "kvtier.sched.base" in graph["kvtier.sim.engine"]
    assert "kvtier._core" in graph["kvtier.keys"]


# The rules --------------------------------------------------------------------------------------


def test_no_import_cycles(graph: Graph) -> None:
    found = cycles(without_allowed(graph))
    assert not found, "import cycles:\n" + "\n".join(describe(graph, c) for c in found)


def test_allowed_edges_are_still_imports(graph: Graph) -> None:
    stale = [edge for edge in ALLOWED_EDGES if edge[1] not in graph.get(edge[0], {})]
    assert not stale, f"no longer imported: remove from ALLOWED_EDGES: {stale}"


@pytest.mark.parametrize("layer", ["kvtier.sched", "kvtier.radix"])
def test_sched_and_radix_import_nothing_above_them(graph: Graph, layer: str) -> None:
    own = ("kvtier.sched", "kvtier.radix") if layer == "kvtier.sched" else ("kvtier.radix",)
    bad = [
        f"{importer} imports {imported} (line {line})"
        for importer, out in without_allowed(graph).items()
        if in_package(importer, layer)
        for imported, line in out.items()
        if imported not in BASICS and not any(in_package(imported, p) for p in own)
    ]
    assert not bad, (
        f"{layer} may import only itself, {sorted(BASICS)}"
        + (", kvtier.radix" if layer == "kvtier.sched" else "")
        + ":\n"
        + "\n".join(bad)
    )


def test_the_simulator_does_not_import_the_engine(graph: Graph) -> None:
    bad = [
        f"{importer} imports {imported} (line {line})"
        for importer, out in without_allowed(graph).items()
        if in_package(importer, "kvtier.sim")
        for imported, line in out.items()
        if any(in_package(imported, p) for p in SIM_FORBIDDEN)
    ]
    assert not bad, "kvtier.sim must not import " + ", ".join(SIM_FORBIDDEN) + ":\n" + "\n".join(bad)


def test_only_benchmarks_and_the_demo_import_the_test_harness(graph: Graph) -> None:
    edges = [
        (importer, imported, line)
        for importer, out in without_allowed(graph).items()
        for imported, line in out.items()
        if in_package(imported, TESTING) != in_package(importer, TESTING)
    ]
    bad = [
        f"{importer} imports {imported} (line {line})"
        for importer, imported, line in edges
        if in_package(importer, TESTING) or not any(in_package(importer, p) for p in TESTING_IMPORTERS)
    ]
    assert not bad, (
        f"{TESTING} is imported only by {', '.join(TESTING_IMPORTERS)} and imports no kvtier module:\n"
        + "\n".join(bad)
    )
    assert any(in_package(imported, TESTING) for _, imported, _ in edges)  # the rule sees real imports
