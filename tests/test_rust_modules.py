"""The Rust crates' modules import downward only (issue 18, item 3): no cycle between the modules of
one crate, however long.

Every ``crates/*/src/**/*.rs`` file is one module (``lib.rs`` the crate root, ``a/mod.rs`` and
``a.rs`` both ``a``); nothing is compiled. Comments, string and char literals and ``#[cfg(test)]``
modules are blanked first. A module depends on another when its code names it: ``use`` trees
(braces expanded) and paths anywhere in the code that start with ``crate::``, ``super::`` or
``self::``, or with the name of a child module it declares (``mod pool;`` then ``use pool::X``).
A path depends on the longest prefix of it that is a module; a name the crate root re-exports
(``crate::Store``, from ``pub use store::Store`` in ``lib.rs``) depends on the module it comes
from. Declaring a child module (``mod pool;``) is containment, not a dependency: a child's
``impl super::Store`` depends on its parent, and the parent must not name the child back.

:data:`ALLOWED_CYCLES` lists the known cycles, each with why it is still there; an entry that no
longer matches a cycle fails too, so the list only shrinks.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from test_import_layers import Graph, cycles, describe

CRATES = Path(__file__).resolve().parents[1] / "crates"
ROOT = "crate"  # the crate root's module name (lib.rs)

#: The modules of one cycle (as ``"crate-name::module"``, sorted) -> why it is still there.
ALLOWED_CYCLES: Mapping[tuple[str, ...], str] = {}


def blank(source: str) -> str:
    """``source`` with comments and string/char literals replaced by spaces (newlines kept)."""
    out: list[str] = []
    i, n = 0, len(source)

    def keep_lines(text: str) -> str:
        return "".join(c if c == "\n" else " " for c in text)

    while i < n:
        c = source[i]
        if source.startswith("//", i):
            end = source.find("\n", i)
            end = n if end < 0 else end
            out.append(keep_lines(source[i:end]))
            i = end
        elif source.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if source.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif source.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(keep_lines(source[i:j]))
            i = j
        elif raw := re.match(r'b?r(#*)"', source[i:]):
            if i and (source[i - 1].isalnum() or source[i - 1] == "_"):
                out.append(c)
                i += 1
                continue
            close = '"' + raw.group(1)
            end = source.find(close, i + raw.end())
            end = n if end < 0 else end + len(close)
            out.append(keep_lines(source[i:end]))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and source[j] != '"':
                j += 2 if source[j] == "\\" else 1
            out.append(keep_lines(source[i : j + 1]))
            i = j + 1
        elif char := re.match(r"'(\\(x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]+\}|.)|[^\\'\n])'", source[i:]):
            out.append(" " * char.end())
            i += char.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)


def strip_test_modules(code: str) -> tuple[str, set[str]]:
    """``code`` (already blanked) without its ``#[cfg(test)] mod name { ... }`` blocks, and the
    names of ``#[cfg(test)] mod name;`` file modules (test-only files)."""
    test_files: set[str] = set()
    pattern = re.compile(
        r"#\[cfg\(test\)\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*([{;])"
    )
    while m := pattern.search(code):
        if m.group(2) == ";":
            test_files.add(m.group(1))
            code = code[: m.start()] + " " * (m.end() - m.start()) + code[m.end() :]
            continue
        depth, j = 1, m.end()
        while j < len(code) and depth:
            depth += {"{": 1, "}": -1}.get(code[j], 0)
            j += 1
        code = code[: m.start()] + "".join(ch if ch == "\n" else " " for ch in code[m.start() : j]) + code[j:]
    return code, test_files


def expand_use(tree: str) -> Iterator[list[str]]:
    """Every path of a ``use`` tree (``a::{b, c::{self, d as e}, *}`` -> ``a::b``, ``a::c``,
    ``a::c::d``, ``a``), as segments."""
    tokens = re.findall(r"::|[{},*]|\w+", tree)
    pos = 0

    def parse(prefix: list[str]) -> Iterator[list[str]]:
        nonlocal pos
        path = list(prefix)
        while pos < len(tokens):
            tok = tokens[pos]
            if tok == "{":
                pos += 1
                while pos < len(tokens) and tokens[pos] != "}":
                    yield from parse(path)
                    if pos < len(tokens) and tokens[pos] == ",":
                        pos += 1
                pos += 1
                return
            if tok in (",", "}"):
                break
            pos += 1
            if tok == "*" or tok == "::":
                continue
            if tok == "as":
                pos += 1  # the alias
                continue
            if tok != "self":
                path.append(tok)
        yield path

    yield from parse([])


def crate_modules(src: Path) -> dict[tuple[str, ...], Path]:
    """Module path (``()`` the root) -> its file, for every ``.rs`` file under ``src``."""
    modules: dict[tuple[str, ...], Path] = {}
    for path in sorted(src.rglob("*.rs")):
        parts = path.relative_to(src).with_suffix("").parts
        if parts in (("lib",), ("main",)):
            modules[()] = path
        elif parts[-1] == "mod":
            modules[parts[:-1]] = path
        else:
            modules[parts] = path
    return modules


def module_graph(src: Path, crate: str) -> Graph:
    """``"crate::module"`` -> the modules its code names -> the first line naming each."""
    files = crate_modules(src)
    code: dict[tuple[str, ...], str] = {}
    test_only: set[tuple[str, ...]] = set()
    for module, path in files.items():
        code[module], tests = strip_test_modules(blank(path.read_text()))
        test_only |= {(*module, name) for name in tests}
    known = {m for m in files if not any(m[: len(t)] == t for t in test_only)}
    reexports: dict[str, tuple[str, ...] | None] = {}  # None: re-exported from another crate
    for m in re.finditer(r"\bpub\s+use\s+([^;]+);", code.get((), "")):
        for path in expand_use(m.group(1)):
            if path and path[0] == "crate":
                path = path[1:]
            if path:
                local = (path[0],) in known
                reexports[path[-1]] = longest_module(tuple(path), known) if local else None
    name = {m: f"{crate}::{'::'.join(m) or ROOT}" for m in known}
    graph: Graph = {name[m]: {} for m in known}
    for module in sorted(known):
        text = code[module]
        children = set(re.findall(r"\bmod\s+(\w+)\s*;", text))
        uses = [(u.start(), u.group(1)) for u in re.finditer(r"\buse\s+([^;]+);", text)]
        paths = [(at, p) for at, tree in uses for p in expand_use(tree)]
        outside = re.sub(r"\buse\s+[^;]+;", lambda u: " " * len(u.group(0)), text)
        heads = "|".join(["crate", "super", "self", *sorted(children)])
        for m in re.finditer(rf"(?<![\w:])((?:{heads})(?:\s*::\s*\w+)+)", outside):
            paths.append((m.start(), re.split(r"\s*::\s*", m.group(1))))
        for at, path in paths:
            target = resolve(module, path, children, known, reexports)
            if target is not None and target != module:
                line = text.count("\n", 0, at) + 1
                graph[name[module]].setdefault(name[target], line)
    return graph


def longest_module(path: tuple[str, ...], known: set[tuple[str, ...]]) -> tuple[str, ...]:
    while path and path not in known:
        path = path[:-1]
    return path


def resolve(
    module: tuple[str, ...],
    path: list[str],
    children: set[str],
    known: set[tuple[str, ...]],
    reexports: Mapping[str, tuple[str, ...] | None],
) -> tuple[str, ...] | None:
    """The module of this crate that ``path`` (written in ``module``) names, or ``None`` (another
    crate, ``std``, a local name)."""
    if not path:
        return None
    base: tuple[str, ...]
    if path[0] == "crate":
        base, rest = (), path[1:]
    elif path[0] in ("super", "self"):
        base = module
        while path and path[0] in ("super", "self"):
            base = base[:-1] if path[0] == "super" else base
            path = path[1:]
        rest = path
    elif path[0] in children:
        base, rest = module, path
    else:
        return None
    target = longest_module((*base, *rest), known)
    if target == () and rest and rest[0] in reexports:
        return reexports[rest[0]]
    return target


def all_crates() -> dict[str, Graph]:
    return {c.name: module_graph(c / "src", c.name) for c in sorted(CRATES.iterdir()) if (c / "src").is_dir()}


@pytest.fixture(scope="module")
def graphs() -> dict[str, Graph]:
    return all_crates()


def found_cycles(graphs: Mapping[str, Graph]) -> dict[tuple[str, ...], str]:
    """Each cycle's sorted modules -> the cycle named step by step, with lines."""
    out = {}
    for graph in graphs.values():
        for cycle in cycles(graph):
            out[tuple(sorted(set(cycle)))] = describe(graph, cycle)
    return out


def write_crate(root: Path, files: Mapping[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_use_trees_expand_to_every_path() -> None:
    got = list(expand_use("crate::a::{b, c::{self, d as e}, *}"))
    assert got == [["crate", "a", "b"], ["crate", "a", "c"], ["crate", "a", "c", "d"], ["crate", "a"]]


def test_comments_strings_and_test_modules_are_not_code() -> None:
    code = 'let s = "crate::x"; // crate::y\n/* crate::z */ let c = \'"\'; crate::w::f();'
    assert re.findall(r"crate::\w+", blank(code)) == ["crate::w"]
    stripped, files = strip_test_modules(
        "a\n#[cfg(test)]\nmod tests {\n use crate::b;\n}\nc\n#[cfg(test)] mod t;"
    )
    assert "crate::b" not in stripped and stripped.count("\n") == 6 and files == {"t"}


def test_a_cycle_between_modules_is_found_and_named(tmp_path: Path) -> None:
    src = write_crate(
        tmp_path / "src",
        {
            "lib.rs": "mod a;\nmod b;\nmod c;\npub use a::Thing;\npub use std::fmt;\n",
            "a.rs": "//! Uses b.\nuse crate::b::{self, B};\npub struct Thing;\n",
            "b/mod.rs": "mod inner;\npub struct B;\nfn f() { crate::c::g(); crate::fmt::x(); }\nfn h() { inner::k(); }\n",
            "b/inner.rs": "use super::B;\n",
            "c.rs": "// crate::b is only mentioned\npub fn g() { let _ = crate::Thing; }\n"
            "#[cfg(test)]\nmod tests { use crate::b::B; }\n",
        },
    )
    graph = module_graph(src, "demo")
    assert graph["demo::a"] == {"demo::b": 2}
    assert graph["demo::b"] == {"demo::c": 3, "demo::b::inner": 4}  # a child named in code
    assert graph["demo::b::inner"] == {"demo::b": 1}
    assert graph["demo::c"] == {"demo::a": 2}  # through the root's re-export
    assert cycles(graph) == [["demo::a", "demo::b", "demo::c", "demo::a"]]
    assert (
        describe(graph, cycles(graph)[0])
        == "demo::a (line 2) -> demo::b (line 3) -> demo::c (line 2) -> demo::a"
    )


def test_a_child_naming_its_parent_is_no_cycle_until_the_parent_names_it_back(tmp_path: Path) -> None:
    files = {
        "lib.rs": "mod store;\n",
        "store.rs": "mod pool;\npub struct Store;\n",
        "store/pool.rs": "use super::Store;\n",
    }
    assert cycles(module_graph(write_crate(tmp_path / "one", files), "x")) == []
    files["store.rs"] = "mod pool;\npub use pool::Report;\npub struct Store;\n"
    assert cycles(module_graph(write_crate(tmp_path / "two", files), "x")) == [
        ["x::store", "x::store::pool", "x::store"]
    ]


def test_the_real_graph_is_the_crates(graphs: Mapping[str, Graph]) -> None:
    store = graphs["kvtier-store"]
    assert "kvtier-store::store::pool" in store
    assert "kvtier-store::store" in store["kvtier-store::store::pool"]  # impl super::Store
    assert "kvtier-store::hierarchy" in store["kvtier-store::store"]
    assert "kvtier-store::levels" in store["kvtier-store::levels::ssd"]


def test_no_module_cycles(graphs: Mapping[str, Graph]) -> None:
    found = {members: text for members, text in found_cycles(graphs).items() if members not in ALLOWED_CYCLES}
    assert not found, "module cycles (import downward only):\n" + "\n".join(found.values())


def test_allowed_cycles_are_still_cycles(graphs: Mapping[str, Graph]) -> None:
    stale = set(ALLOWED_CYCLES) - set(found_cycles(graphs))
    assert not stale, f"no longer a cycle, remove from ALLOWED_CYCLES: {sorted(stale)}"
