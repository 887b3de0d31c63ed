"""``docs/techniques.md`` stays true to the code (issue 18, item 6).

The page indexes every technique of the five papers in one table: paper §, technique, Rust file,
Python file, experiment, test. Every reference in it is checked here, without importing anything:

- Rust, Python and test cells hold backticked paths from the repository root, each optionally
  followed by ``::name`` (a function, class, field or test); the file must exist and the name must
  occur in it as a word. Rust paths are ``crates/<crate>/src/...rs``; Python paths are under
  ``python/kvtier/``; tests are ``tests/...py`` or a crate's ``tests/``/``src/`` file (Rust tests
  live inline too). ``—`` marks an empty cell; every row has a test and a Rust or Python file.
- Experiment cells hold ``kvtier sim reproduce <paper>`` (``python/kvtier/sim/reproduce/<paper>.py``
  names it), ``kvtier bench <name>`` (``python/kvtier/bench/<name>.py``), or a config under
  ``experiments/``.

Run as a script to list what is broken: ``.venv/bin/python tests/test_docs_techniques.py``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "techniques.md"
COLUMNS = ("paper §", "technique", "Rust", "Python", "experiment", "test")
PAPERS = ("ShadowServe", "Strata", "DualPath", "Unified pool", "SuperInfer")
EMPTY = "—"

#: What a path in each path column must look like.
PATH_SHAPES = {
    "Rust": re.compile(r"crates/[\w-]+/src/[\w/]+\.rs"),
    "Python": re.compile(r"python/kvtier/[\w/.-]+\.(py|yaml)"),
    "test": re.compile(r"tests/[\w/]+\.py|crates/[\w-]+/(tests|src)/[\w/]+\.rs"),
}
REPRODUCE = re.compile(r"kvtier sim reproduce (\w+)")
BENCH = re.compile(r"kvtier bench (\w+)")
EXPERIMENT_PATH = re.compile(r"experiments/[\w/.-]+\.yaml")


def table_rows(text: str) -> list[dict[str, str]]:
    """The rows of the table whose header is :data:`COLUMNS`, as column -> cell text."""
    lines = text.splitlines()
    header = "| " + " | ".join(COLUMNS) + " |"
    if header not in lines:
        raise AssertionError(f"no table with header {header!r}")
    rows = []
    for line in lines[lines.index(header) + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != len(COLUMNS):
            raise AssertionError(f"row has {len(cells)} cells, expected {len(COLUMNS)}: {line}")
        rows.append(dict(zip(COLUMNS, cells, strict=True)))
    return rows


def refs(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def check_path(ref: str, column: str, root: Path) -> str | None:
    """Why ``ref`` (``path`` or ``path::name``) is wrong for ``column``, or None."""
    path, _, name = ref.partition("::")
    if not PATH_SHAPES[column].fullmatch(path):
        return f"{column} reference `{ref}` is not a {column} path ({PATH_SHAPES[column].pattern})"
    file = root / path
    if not file.is_file():
        return f"`{path}` does not exist"
    if name and not re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", file.read_text(errors="replace")):
        return f"`{name}` does not occur in `{path}`"
    return None


def check_experiment(ref: str, root: Path) -> str | None:
    if m := REPRODUCE.fullmatch(ref):
        module = root / "python/kvtier/sim/reproduce" / f"{m[1]}.py"
        if not module.is_file() or f'"{m[1]}"' not in module.read_text():
            return f"`{ref}`: no reproduction named {m[1]!r} in python/kvtier/sim/reproduce/"
        return None
    if m := BENCH.fullmatch(ref):
        if not (root / "python/kvtier/bench" / f"{m[1]}.py").is_file():
            return f"`{ref}`: no benchmark python/kvtier/bench/{m[1]}.py"
        return None
    if not EXPERIMENT_PATH.fullmatch(ref):
        return f"experiment `{ref}` is neither a kvtier command nor a config under experiments/"
    if not (root / ref).is_file():
        return f"`{ref}` does not exist"
    return None


def problems(text: str, root: Path = REPO) -> list[str]:
    """Everything wrong with the table in ``text``, one line each, naming the row."""
    out = []
    for row in table_rows(text):
        where = f"[{row['paper §']}: {row['technique'][:50]}]"
        for column in ("Rust", "Python", "test"):
            cell = row[column]
            if cell != EMPTY and not refs(cell):
                out.append(f"{where} {column} cell has no `path`: {cell!r}")
            out += [f"{where} {p}" for r in refs(cell) if (p := check_path(r, column, root))]
        if row["Rust"] == EMPTY and row["Python"] == EMPTY:
            out.append(f"{where} neither a Rust nor a Python file")
        if not refs(row["test"]):
            out.append(f"{where} no test")
        if not refs(row["experiment"]) and row["experiment"] != EMPTY:
            out.append(f"{where} experiment cell has no `reference`: {row['experiment']!r}")
        out += [f"{where} {p}" for r in refs(row["experiment"]) if (p := check_experiment(r, root))]
    return out


def test_every_path_and_name_in_the_table_exists() -> None:
    found = problems(DOC.read_text())
    assert not found, "docs/techniques.md is out of date:\n" + "\n".join(found)


def test_the_table_covers_every_paper_and_every_reproduction() -> None:
    rows = table_rows(DOC.read_text())
    for paper in PAPERS:
        assert any(r["paper §"].startswith(paper) for r in rows), f"no row for {paper}"
    reproduced = {m[1] for r in rows for ref in refs(r["experiment"]) if (m := REPRODUCE.fullmatch(ref))}
    modules = {p.stem for p in (REPO / "python/kvtier/sim/reproduce").glob("*.py")} - {"__init__"}
    assert modules <= reproduced, (
        f"reproductions missing from docs/techniques.md: {sorted(modules - reproduced)}"
    )


def test_the_checker_names_each_broken_reference(tmp_path: Path) -> None:
    (tmp_path / "crates/kvtier-x/src").mkdir(parents=True)
    (tmp_path / "crates/kvtier-x/src/lib.rs").write_text("pub fn algorithm1_counts() {}\n")
    (tmp_path / "python/kvtier/sim/reproduce").mkdir(parents=True)
    (tmp_path / "python/kvtier/sim/reproduce/strata.py").write_text('PAPER = "strata"\n')
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/test_x.py").write_text("def test_a() -> None: ...\n")
    head = "| " + " | ".join(COLUMNS) + " |\n|---|---|---|---|---|---|\n"
    good = "| Strata §1 | ok | `crates/kvtier-x/src/lib.rs::algorithm1_counts` | — | `kvtier sim reproduce strata` | `tests/test_x.py::test_a` |\n"
    assert problems(head + good, tmp_path) == []
    bad = [
        "| Strata §2 | gone | `crates/kvtier-x/src/gone.rs` | — | — | `tests/test_x.py` |\n",
        "| Strata §3 | renamed | `crates/kvtier-x/src/lib.rs::algorithm_one` | — | — | `tests/test_x.py` |\n",
        "| Strata §4 | word | `crates/kvtier-x/src/lib.rs::algorithm1` | — | — | `tests/test_x.py` |\n",
        "| Strata §5 | column | `tests/test_x.py` | — | — | `tests/test_x.py` |\n",
        "| Strata §6 | paper | — | — | `kvtier sim reproduce dualpath` | — |\n",
        "| Strata §7 | config | `crates/kvtier-x/src/lib.rs` | — | `experiments/x.yaml` | `tests/test_x.py::test_b` |\n",
    ]
    found = problems(head + "".join(bad), tmp_path)
    for needle in (
        "`crates/kvtier-x/src/gone.rs` does not exist",
        "`algorithm_one` does not occur in `crates/kvtier-x/src/lib.rs`",
        "`algorithm1` does not occur",
        "Rust reference `tests/test_x.py` is not a Rust path",
        "[Strata §6: paper] neither a Rust nor a Python file",
        "[Strata §6: paper] no test",
        "no reproduction named 'dualpath'",
        "`experiments/x.yaml` does not exist",
        "`test_b` does not occur in `tests/test_x.py`",
    ):
        assert any(needle in p for p in found), f"{needle!r} not reported in {found}"


def test_the_readme_links_the_index() -> None:
    assert "docs/techniques.md" in (REPO / "README.md").read_text()


if __name__ == "__main__":
    broken = problems(DOC.read_text())
    print("\n".join(broken) if broken else f"{DOC.relative_to(REPO)}: every reference exists")
    sys.exit(1 if broken else 0)
