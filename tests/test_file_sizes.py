"""No product source file grows past 500 lines (STYLE.md: "a file past ~500 lines is a smell";
issue 18, item 6).

Product sources are ``python/kvtier/**/*.py`` and ``crates/*/src/**/*.rs`` (tests, benches and
docs are not counted). The files that were already longer when this guard landed are listed in
:data:`ALLOWED`, each capped at its length that day, so none of them can grow. The list only
shrinks: an entry whose file is gone or back under the limit fails too, naming the entry to
remove.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
LINES_MAX = 500


class Allowed(NamedTuple):
    lines_max: int  # the file's length when it was listed: it may shrink, never grow
    issue: int  # the issue that splits it
    reason: str


#: Files over :data:`LINES_MAX`, each capped at its length on the day the guard landed.
ALLOWED: Mapping[str, Allowed] = {
    "crates/kvtier-core/src/layout.rs": Allowed(612, 18, "gather/scatter plans and copies in one file"),
    "python/kvtier/sim/reproduce/superinfer.py": Allowed(520, 18, "every SuperInfer experiment in one file"),
}


def product_files(root: Path) -> list[Path]:
    python = (root / "python" / "kvtier").rglob("*.py")
    rust = (root / "crates").glob("*/src/**/*.rs")
    return sorted(p for p in (*python, *rust) if p.is_file())


def line_count(path: Path) -> int:
    return len(path.read_text(errors="replace").splitlines())


def too_long(root: Path, files: Iterable[Path], allowed: Mapping[str, Allowed]) -> list[str]:
    """Each file over its limit (:data:`LINES_MAX`, or its entry's cap), one line each."""
    out = []
    for path in files:
        name = path.relative_to(root).as_posix()
        lines, entry = line_count(path), allowed.get(name)
        if entry is None and lines > LINES_MAX:
            out.append(f"{name}: {lines} lines, over {LINES_MAX}: split it (STYLE.md, one concern per file)")
        elif entry is not None and lines > entry.lines_max:
            out.append(
                f"{name}: {lines} lines, over its cap of {entry.lines_max} (issue {entry.issue}): "
                "a listed file may shrink, never grow"
            )
    return out


def stale_entries(root: Path, allowed: Mapping[str, Allowed]) -> list[str]:
    """Entries whose file is gone or no longer over :data:`LINES_MAX`: the list only shrinks."""
    out = []
    for name, entry in allowed.items():
        path = root / name
        if not path.is_file():
            out.append(f"{name} is gone: remove it from ALLOWED")
        elif (lines := line_count(path)) <= LINES_MAX:
            out.append(f"{name} is {lines} lines, within {LINES_MAX}: remove it from ALLOWED")
        elif entry.lines_max <= LINES_MAX:
            out.append(f"{name}: a cap of {entry.lines_max} is no exception; remove it from ALLOWED")
    return out


def test_no_product_file_is_over_its_limit() -> None:
    found = too_long(REPO, product_files(REPO), ALLOWED)
    assert not found, "\n".join(found)


def test_the_allow_list_only_shrinks() -> None:
    found = stale_entries(REPO, ALLOWED)
    assert not found, "\n".join(found)


def test_the_scan_sees_both_languages() -> None:
    names = {p.relative_to(REPO).as_posix() for p in product_files(REPO)}
    assert {"python/kvtier/store.py", "python/kvtier/sched/base.py", "crates/kvtier-core/src/lib.rs"} <= names
    assert "crates/kvtier-pool/src/ssd/placement.rs" in names  # nested modules count
    assert not any(n.startswith(("tests/", "crates/kvtier-store/tests/")) for n in names)


def test_the_guard_flags_growth_new_big_files_and_stale_entries(tmp_path: Path) -> None:
    src = tmp_path / "python" / "kvtier"
    src.mkdir(parents=True)
    (src / "big.py").write_text("x = 1\n" * 501)
    (src / "listed.py").write_text("x = 1\n" * 600)
    (src / "shrunk.py").write_text("x = 1\n" * 400)
    (src / "ok.py").write_text("x = 1\n" * 500)
    allowed = {
        "python/kvtier/listed.py": Allowed(599, 18, "test"),
        "python/kvtier/shrunk.py": Allowed(700, 18, "test"),
        "python/kvtier/gone.py": Allowed(700, 18, "test"),
    }
    assert too_long(tmp_path, product_files(tmp_path), allowed) == [
        "python/kvtier/big.py: 501 lines, over 500: split it (STYLE.md, one concern per file)",
        "python/kvtier/listed.py: 600 lines, over its cap of 599 (issue 18): a listed file may shrink, never grow",
    ]
    assert stale_entries(tmp_path, allowed) == [
        "python/kvtier/shrunk.py is 400 lines, within 500: remove it from ALLOWED",
        "python/kvtier/gone.py is gone: remove it from ALLOWED",
    ]
