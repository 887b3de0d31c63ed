"""The one tier vocabulary (issue 18 step 5): :class:`kvtier.tiers.Tier` and its string mappings,
and no tier spelled as a string in the control plane's code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvtier import _core
from kvtier.errors import ConfigError
from kvtier.tiers import _STORE_NAMES, NO_TOKENS, PerTier, Tier

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "kvtier"
TIER_WORDS = frozenset({"device", "host", "dram", "ssd", "remote"})
#: Where a tier word is a user-facing name that is not a tier of the hierarchy: store config
#: sections and CLI setups (engine/cli.py, engine/replay.py), an example config in a docstring.
USER_FACING = ("engine/cli.py", "engine/replay.py")


def test_labels_and_store_names_map_to_one_enum() -> None:
    assert [t.label for t in Tier] == ["device", "host", "ssd", "remote"]
    assert [Tier.parse(t.label) for t in Tier] == list(Tier)
    assert [Tier.from_store(n) for n in ("dram", "ssd", "remote")] == [Tier.HOST, Tier.SSD, Tier.REMOTE]
    with pytest.raises(ConfigError, match="unknown store tier 'host'"):
        Tier.from_store("host")  # the store calls host memory "dram"; "host" is the config label
    with pytest.raises(ConfigError, match="unknown tier 'dram'"):
        Tier.parse("dram")


def test_every_store_tier_name_from_rust_maps_once() -> None:
    assert list(_STORE_NAMES) == list(_core.STORE_TIERS) == ["dram", "ssd", "remote"]
    assert [Tier.from_store(n) for n in _core.STORE_TIERS] == sorted(_STORE_NAMES.values())


def test_per_tier_tuples_are_indexed_by_tier() -> None:
    counts = (10, 20, 30, 40)
    assert [counts[t] for t in Tier] == [10, 20, 30, 40]
    assert sum(counts[Tier.HOST :]) == 90


def _tier_strings(path: Path) -> list[tuple[int, str]]:
    """Tier words used as values in code: compared with, used as a dict key or subscript, or
    returned. Docstrings and error messages (f-strings) are prose and do not count."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        operands: list[ast.expr] = []
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.Dict):
            operands = [k for k in node.keys if k is not None]
        elif isinstance(node, ast.Subscript):
            operands = [node.slice]
        elif isinstance(node, ast.Return) and node.value is not None:
            operands = [node.value]
        elif isinstance(node, ast.Tuple):
            operands = list(node.elts)
        elif isinstance(node, ast.keyword) and node.arg in ("target", "tier"):
            operands = [node.value]
        for op in operands:
            if isinstance(op, ast.Constant) and op.value in TIER_WORDS:
                found.append((op.lineno, op.value))
    return found


@pytest.mark.parametrize("package", ["radix", "sched", "sim", "engine"])
def test_no_tier_is_spelled_as_a_string(package: str) -> None:
    offenders = [
        f"{path.relative_to(PACKAGE)}:{line}: {word!r}"
        for path in sorted((PACKAGE / package).rglob("*.py"))
        if str(path.relative_to(PACKAGE)) not in USER_FACING
        for line, word in _tier_strings(path)
    ]
    assert not offenders, "spell tiers with kvtier.tiers.Tier:\n" + "\n".join(offenders)


def test_per_tier_fields_are_the_tiers_in_order() -> None:
    counts = PerTier(device=1, host=2, ssd=3, remote=4)
    assert PerTier._fields == tuple(t.label for t in Tier)
    assert [counts[t] for t in Tier] == [getattr(counts, t.label) for t in Tier] == [1, 2, 3, 4]
    assert counts[Tier.HOST :] == (2, 3, 4) and sum(counts) == 10
    assert NO_TOKENS == (0, 0, 0, 0)


@pytest.mark.parametrize("package", ["radix", "sched", "sim", "engine"])
def test_no_positional_tier_tuple_type(package: str) -> None:
    """Per-tier counts are a PerTier (named by tier), never a bare 4-tuple indexed by position."""
    not_tiers = {"sim/models.py"}  # (attention params, KV bytes, qk dim, v dim) of MLA
    offenders = [
        f"{path.relative_to(PACKAGE)}:{n}"
        for path in sorted((PACKAGE / package).rglob("*.py"))
        if str(path.relative_to(PACKAGE)) not in not_tiers
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "tuple[int, int, int, int]" in line
    ]
    assert not offenders, "use kvtier.tiers.PerTier:\n" + "\n".join(offenders)
