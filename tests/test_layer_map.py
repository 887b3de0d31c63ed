"""The layer map in docs/architecture.md is the code's (issue 18): every import goes down a layer.

The doc's two tables (between ``<!-- layer-map:python -->`` and ``<!-- layer-map:rust -->``
markers) give each Python package or module and each crate a layer. Python imports are the ones
``tests/test_import_layers.py`` finds (every kind, at every depth); crate dependencies are each
``Cargo.toml``'s ``[dependencies]`` on workspace crates. An import from layer *i* must go to a layer
below *i*; a module or crate without a row fails, and so does a row that names nothing.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from pathlib import Path

import pytest

from test_import_layers import import_graph

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"


def layer_table(doc: str, kind: str) -> dict[str, int]:
    """Name -> layer from the doc's table between the ``layer-map:<kind>`` markers."""
    match = re.search(rf"<!-- layer-map:{kind} -->\n(.*?)<!-- /layer-map:{kind} -->", doc, re.S)
    if match is None:
        raise AssertionError(f"{DOC}: no layer-map:{kind} table")
    layers: dict[str, int] = {}
    for line in match.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].isdigit():
            continue  # the header and its rule
        for name in cells[1].split(","):
            if name.strip() in layers:
                raise AssertionError(f"{DOC}: {name.strip()} has two rows")
            layers[name.strip()] = int(cells[0])
    return layers


def home(module: str, layers: Mapping[str, int]) -> str | None:
    """The longest row name that is ``module`` or a package above it (``kvtier`` only for itself)."""
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in layers:
            return ".".join(parts[:n])
    return module if module in layers else None


def upward(edges: Mapping[str, set[str]], layers: Mapping[str, int]) -> list[str]:
    """Every edge that does not go to a lower layer, described."""
    return [
        f"{a} (layer {layers[a]}) imports {b} (layer {layers[b]})"
        for a, targets in sorted(edges.items())
        for b in sorted(targets)
        if layers[b] >= layers[a]
    ]


def python_edges(layers: Mapping[str, int]) -> tuple[dict[str, set[str]], list[str], set[str]]:
    """Row -> rows it imports (between rows only), modules with no row, rows that matched a module."""
    edges: dict[str, set[str]] = {}
    unplaced: list[str] = []
    used: set[str] = set()
    for module, imported in import_graph().items():
        a = home(module, layers)
        if a is None:
            unplaced.append(module)
            continue
        used.add(a)
        for target in imported:
            b = home(target, layers)
            if b is not None and b != a:
                edges.setdefault(a, set()).add(b)
    return edges, sorted(unplaced), used


def crate_edges() -> dict[str, set[str]]:
    manifests = {p.parent.name: tomllib.loads(p.read_text()) for p in (ROOT / "crates").glob("*/Cargo.toml")}
    names = {m["package"]["name"] for m in manifests.values()}
    return {
        m["package"]["name"]: {d for d in m.get("dependencies", {}) if d in names} for m in manifests.values()
    }


def test_python_imports_go_down_the_layer_map() -> None:
    layers = layer_table(DOC.read_text(), "python")
    edges, unplaced, used = python_edges(layers)
    assert not unplaced, f"modules with no row in {DOC.name}'s layer map: {unplaced}"
    assert not set(layers) - used, f"layer-map rows that name no module: {sorted(set(layers) - used)}"
    assert not upward(edges, layers), "imports that do not go down the layer map:\n" + "\n".join(
        upward(edges, layers)
    )


def test_crate_dependencies_go_down_the_layer_map() -> None:
    layers = layer_table(DOC.read_text(), "rust")
    edges = crate_edges()
    assert set(edges) == set(layers), f"crates {sorted(edges)} vs layer-map rows {sorted(layers)}"
    assert not upward(edges, layers), "crate dependencies that do not go down:\n" + "\n".join(
        upward(edges, layers)
    )


def test_the_checker_fails_an_upward_edge_and_a_missing_row() -> None:
    doc = "<!-- layer-map:python -->\n| layer | m | w |\n|---|---|---|\n| 0 | a.x | |\n| 1 | a.y, a |\n<!-- /layer-map:python -->"
    layers = layer_table(doc, "python")
    assert layers == {"a.x": 0, "a.y": 1, "a": 1}
    assert home("a.x.deep", layers) == "a.x" and home("a.z", layers) is None and home("a", layers) == "a"
    assert upward({"a.y": {"a.x"}}, layers) == []
    assert upward({"a.x": {"a.y"}}, layers) == ["a.x (layer 0) imports a.y (layer 1)"]
    assert upward({"a": {"a.y"}}, layers) == ["a (layer 1) imports a.y (layer 1)"]
    with pytest.raises(AssertionError, match="two rows"):
        layer_table(doc.replace("a.y, a", "a.y, a.x"), "python")
    with pytest.raises(AssertionError, match="no layer-map:rust"):
        layer_table(doc, "rust")
