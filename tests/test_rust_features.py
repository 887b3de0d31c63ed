"""Scaffolding in the Rust crates is behind cargo features (issue 18, item 6): test hooks
(``fn *_for_test``, the remote ``testing`` harness) behind ``test-hooks``, bench baselines (the SSD
``baseline`` module, the transfer engine's ``sequential`` load, the remote tier's raw client and
the extension's ``raw_*`` methods) behind ``bench-baselines``. A shipped build without them does
not compile them; ``make lint`` builds the library crates that way.

An item counts as gated when one of the attribute lines right above it (doc comments and other
attributes may sit between) is a ``#[cfg(...)]`` naming the feature.
"""

from __future__ import annotations

import re
from pathlib import Path

CRATES = Path(__file__).resolve().parents[1] / "crates"

#: Item pattern -> the feature that must gate it.
RULES: dict[str, re.Pattern[str]] = {
    "test-hooks": re.compile(r"^\s*(pub(\(crate\))? )?(fn \w+_for_test\b|mod testing;)"),
    "bench-baselines": re.compile(
        r"^\s*(pub(\(crate\))? )?(mod (baseline|baselines|sequential);"
        r"|fn load_sequential\b|fn client\(&self\))"
        # The `RemotePool` methods (the free functions they call live in the gated `baselines`).
        r"|^\s*fn raw_(set|get|del)\((&self|$)"
    ),
}


def ungated(source: str) -> list[tuple[int, str]]:
    """(line number, feature) of each scaffolding item in ``source`` its feature does not gate."""
    lines = source.splitlines()
    out: list[tuple[int, str]] = []
    for i, line in enumerate(lines):
        for feature, pattern in RULES.items():
            if not pattern.match(line):
                continue
            j, gated = i - 1, False
            while j >= 0 and lines[j].lstrip().startswith(("#[", "///", "//")):
                gated |= lines[j].lstrip().startswith("#[cfg(") and f'"{feature}"' in lines[j]
                j -= 1
            if not gated:
                out.append((i + 1, feature))
    return out


def test_an_ungated_hook_or_baseline_is_found() -> None:
    source = (
        "pub mod baseline;\n"
        '#[cfg(feature = "bench-baselines")]\n/// doc\nmod sequential;\n'
        "    fn corrupt_for_test(&self) -> bool {\n"
        '    #[cfg(feature = "bench-baselines")]\n    fn inject_for_test() {}\n'
        "    fn raw_get(\n"
        "pub fn raw_get(\n"
    )
    assert ungated(source) == [
        (1, "bench-baselines"),
        (5, "test-hooks"),
        (7, "test-hooks"),
        (8, "bench-baselines"),
    ]


def test_scaffolding_in_the_crates_is_behind_its_feature() -> None:
    found = {
        f"{path.relative_to(CRATES)}:{line} needs {feature}"
        for path in sorted(CRATES.glob("*/src/**/*.rs"))
        for line, feature in ungated(path.read_text())
    }
    assert not found, sorted(found)
