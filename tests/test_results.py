"""kvtier.results: a typed result's one way to JSON (``as_dict``) and back (``from_json``), the
error ``from_json`` gives for an untrusted document that does not hold the result, and the one
writer of JSON text (``json_text``: strict JSON, a non-finite float as null, read back as NaN)."""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NotRequired, TypedDict

import pytest

from kvtier.bench.sglang import BackendTimes, SglangBench, summary
from kvtier.errors import KvtierError
from kvtier.results import OMIT, Result, field_of, json_text, nan_for_null, to_json, write_json

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "kvtier"


@dataclass(frozen=True)
class Inner(Result):
    seconds: float
    count: int


@dataclass(frozen=True)
class Outer(Result):
    name: str
    ok: bool
    inner: Inner
    ratio: float | None
    extra: Inner | None = field(default=None, metadata=OMIT)
    why: str | None = field(default=None, metadata=OMIT)


@dataclass(frozen=True)
class Listed(Result):
    values: list[float]


def _through_json(result: Result) -> dict[str, object]:
    data = json.loads(json.dumps(to_json(result)))
    assert isinstance(data, dict)
    return data


@pytest.mark.parametrize(
    "result",
    [
        Outer("a", True, Inner(0.5, 3), None),
        Outer("b", False, Inner(1.0, 0), 2.5, extra=Inner(2.0, 7), why="because"),
    ],
)
def test_from_json_reads_back_what_as_dict_wrote(result: Outer) -> None:
    assert Outer.from_json(_through_json(result), "doc") == result


def test_a_null_field_is_kept_and_an_omitted_one_left_out() -> None:
    data = _through_json(Outer("a", True, Inner(0.5, 3), None))
    assert data["ratio"] is None and "extra" not in data and "why" not in data


def test_from_json_reads_an_integral_float_as_a_float() -> None:
    assert Inner.from_json({"seconds": 2, "count": 1}, "doc") == Inner(2.0, 1)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"name": 3}, r"doc: `name` is 3; expected str"),
        ({"ok": 1}, r"doc: `ok` is 1; expected bool"),
        ({"inner": {"seconds": 1.0}}, r"doc: inner: `count` is missing"),
        ({"inner": {"seconds": 1.0, "count": True}}, r"doc: inner: `count` is True; expected int"),
        ({"inner": [1, 2]}, r"doc: `inner` is .*; expected dict"),
        ({"ratio": "x"}, r"doc: `ratio` is 'x'; expected float"),
    ],
)
def test_from_json_names_the_ill_typed_field(change: dict[str, object], message: str) -> None:
    data = _through_json(Outer("a", True, Inner(0.5, 3), 1.0)) | change
    with pytest.raises(KvtierError, match=message):
        Outer.from_json(data, "doc")


def test_from_json_needs_a_nullable_field_that_is_not_omitted() -> None:
    data = _through_json(Outer("a", True, Inner(0.5, 3), 1.0))
    del data["ratio"]
    with pytest.raises(KvtierError, match=r"doc: `ratio` is missing"):
        Outer.from_json(data, "doc")


def test_from_json_refuses_a_field_type_it_cannot_check() -> None:
    with pytest.raises(TypeError, match=r"Listed.values"):
        Listed.from_json({"values": [1.0]}, "doc")


def _bench(mooncake: BackendTimes | None, unavailable: str | None) -> SglangBench:
    kv, file = BackendTimes(0.1, 0.2, 0.01, 3.0, 1.5), BackendTimes(0.4, 0.3, 0.05, 0.75, 1.0)
    return SglangBench(
        page_bytes=2**23, pages=4, bytes=2**25, repeats=3, memcpy_gb_per_s=10.0, exists_pages=2048,
        exists_tokens=128 * 1024, kvtier=kv, file=file,
        set_ratio_to_file_backend=4.0, get_ratio_to_file_backend=1.5, exists_ratio_to_file_backend=5.0,
        set_ratio_to_mooncake=None if mooncake is None else 2.0,
        get_ratio_to_mooncake=None if mooncake is None else 0.5,
        exists_ratio_to_mooncake=None if mooncake is None else 3.0,
        kvtier_set_fraction_of_memcpy=0.3, kvtier_get_fraction_of_memcpy=0.15,
        mooncake=mooncake, mooncake_unavailable=unavailable,
    )  # fmt: skip


def test_sglang_bench_keeps_its_json_keys_and_reads_back() -> None:
    """The keys ``kvtier bench sglang --json`` printed before its result was typed."""
    without = _bench(None, "no wheel for this platform")
    data = _through_json(without)
    assert set(data) == {
        "page_bytes", "pages", "bytes", "repeats", "memcpy_gb_per_s", "exists_pages", "exists_tokens",
        "kvtier", "file", "mooncake_unavailable", "kvtier_set_fraction_of_memcpy",
        "kvtier_get_fraction_of_memcpy",
        *(f"{case}_ratio_to_{peer}" for case in ("set", "get", "exists") for peer in ("file_backend", "mooncake")),
    }  # fmt: skip
    assert data["kvtier"] == {
        "set_s": 0.1,
        "get_s": 0.2,
        "exists_s": 0.01,
        "set_gb_per_s": 3.0,
        "get_gb_per_s": 1.5,
    }
    assert data["set_ratio_to_mooncake"] is None
    assert SglangBench.from_json(data, "doc") == without
    with_mooncake = _bench(BackendTimes(0.2, 0.1, 0.03, 1.5, 3.0), None)
    assert SglangBench.from_json(_through_json(with_mooncake), "doc") == with_mooncake


def test_sglang_summary_shows_each_measured_backend() -> None:
    text = summary(_bench(BackendTimes(0.2, 0.1, 0.03, 1.5, 3.0), None))
    assert "mooncake ms" in text and "not measured" not in text
    assert "batch_set" in text and "400.00   4.00x" in text and "200.00   2.00x" in text
    text = summary(_bench(None, "no wheel"))
    assert "mooncake ms" not in text and "mooncake not measured: no wheel" in text


def strict_loads(text: str) -> object:
    """``text`` read as RFC 8259 JSON: Python's ``NaN``, ``Infinity`` and ``-Infinity`` refused,
    as JavaScript's ``JSON.parse``, Go and ``jq`` refuse them."""

    def refuse(constant: str) -> object:
        raise ValueError(f"{constant} is not JSON (RFC 8259)")

    return json.loads(text, parse_constant=refuse)


@dataclass(frozen=True)
class Figures(Result):
    mean_s: float
    p99_s: float
    ratio: float | None
    inner: Inner


def test_json_text_writes_a_non_finite_float_as_null_and_from_json_reads_it_as_nan(tmp_path: Path) -> None:
    result = Figures(math.nan, math.inf, 1.5, Inner(-math.inf, 2))
    data = strict_loads(json_text(result, sort_keys=True))
    assert data == {"mean_s": None, "p99_s": None, "ratio": 1.5, "inner": {"seconds": None, "count": 2}}
    assert isinstance(data, dict)
    back = Figures.from_json(data, "doc")
    assert math.isnan(back.mean_s) and math.isnan(back.p99_s) and math.isnan(back.inner.seconds)
    assert back.ratio == 1.5 and back.inner.count == 2
    write_json(tmp_path / "result.json", result)
    assert strict_loads((tmp_path / "result.json").read_text()) == data
    with pytest.raises(KvtierError, match=r"doc: `mean_s` is 'x'; expected float"):
        Figures.from_json({**data, "mean_s": "x"}, "doc")  # only null is NaN
    assert math.isnan(field_of({"x": None}, "x", float, "doc", null_is_nan=True))
    with pytest.raises(KvtierError, match=r"doc: `x` is None; expected float"):
        field_of({"x": None}, "x", float, "doc")  # a figure that is always defined: null refused
    with pytest.raises(KvtierError, match=r"doc: `x` is None; expected int"):
        field_of({"x": None}, "x", int, "doc")


def test_json_text_reaches_into_mappings_lists_and_tuples_and_keeps_finite_text_as_it_was() -> None:
    value = {"a": [1.0, math.nan, (math.inf, -0.0)], "b": {"c": -math.inf, "d": "NaN"}, "e": None}
    assert strict_loads(json_text(value)) == {
        "a": [1.0, None, [None, -0.0]],
        "b": {"c": None, "d": "NaN"},
        "e": None,
    }
    finite = {"z": [1, 2.5, (3, 1e300)], "a": {"x": True, "y": None, "s": "t"}}
    for options in ({}, {"indent": 2, "sort_keys": True}, {"indent": 1}):
        assert json_text(finite, **options) == json.dumps(finite, **options)
    with pytest.raises(TypeError, match="not JSON serializable"):
        json_text({"a": object()})  # what is still not JSON raises, never a text that is not


class _Summary(TypedDict):
    mean: float
    p99: float


class _Run(TypedDict):
    ttft_s: _Summary
    slo_s: float | None
    windows: NotRequired[list[list[float]]]
    links: dict[str, dict[str, float]]
    policy: dict[str, object]


def test_nan_for_null_reads_back_the_floats_of_a_typed_dict_and_leaves_the_rest() -> None:
    run: _Run = {
        "ttft_s": {"mean": math.nan, "p99": 2.0},
        "slo_s": None,
        "windows": [[0.0, math.nan]],
        "links": {"e0": {"in": math.inf}},
        "policy": {"name": "lru", "x": None},
    }
    back = nan_for_null(strict_loads(json_text(run)), _Run)
    assert isinstance(back, dict)
    assert back["slo_s"] is None and back["policy"] == {"name": "lru", "x": None}
    assert math.isnan(back["ttft_s"]["mean"]) and back["ttft_s"]["p99"] == 2.0
    assert math.isnan(back["windows"][0][1]) and math.isnan(back["links"]["e0"]["in"])
    assert nan_for_null({"ttft_s": "odd", "extra": None}, _Run) == {"ttft_s": "odd", "extra": None}


#: (file under python/kvtier, function) -> whether its call passes allow_nan=False, and why it
#: writes JSON itself rather than through json_text. The list only shrinks: an entry that no
#: longer matches a call fails too.
OWN_JSON_WRITERS: dict[tuple[str, str], tuple[bool, str]] = {
    ("results.py", "json_text"): (True, "the one writer"),
    ("bench/peers_worker.py", "<module>"): (
        True,
        "prints the RESULT line in the peers' environment, where kvtier is not importable",
    ),
    ("integrations/vllm/config.py", "model_variant"): (
        False,
        "the canonical text of a digest (mixed into block keys), never written out: its bytes stay",
    ),
}
_WRITERS = {"dump", "dumps", "JSONEncoder"}


def json_writer_calls(source: str) -> Iterator[tuple[str, ast.Call]]:
    """``(enclosing function or "<module>", call)`` for every call of ``json.dump``,
    ``json.dumps`` or ``json.JSONEncoder`` in ``source``, under any name ``json`` or they are
    imported as."""
    tree = ast.parse(source)
    modules, functions = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name == "json"}
        elif isinstance(node, ast.ImportFrom) and node.module == "json":
            functions |= {a.asname or a.name for a in node.names if a.name in _WRITERS}

    def visit(node: ast.AST, where: str) -> Iterator[tuple[str, ast.Call]]:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            where = node.name
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr in _WRITERS and isinstance(f.value, ast.Name)
                    and f.value.id in modules) or (isinstance(f, ast.Name) and f.id in functions):  # fmt: skip
                yield where, node
        for child in ast.iter_child_nodes(node):
            yield from visit(child, where)

    yield from visit(tree, "<module>")


def test_json_writer_calls_finds_every_spelling() -> None:
    source = (
        "import json\nimport json as j\nfrom json import dumps as d\n"
        "def f():\n    json.dump(1, x)\n    j.dumps(1)\n    d(1)\n    json.JSONEncoder().encode(1)\n"
        "json.loads('1')\n"
    )
    assert [where for where, _ in json_writer_calls(source)] == ["f"] * 4


def test_every_json_kvtier_writes_goes_through_json_text() -> None:
    """A new ``--json`` output or result file written with ``json.dumps`` would write NaN for an
    undefined figure (not JSON); it must use :func:`kvtier.results.json_text`."""
    found: dict[tuple[str, str], list[ast.Call]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for where, call in json_writer_calls(path.read_text()):
            found.setdefault((path.relative_to(PACKAGE).as_posix(), where), []).append(call)
    unlisted = sorted(set(found) - set(OWN_JSON_WRITERS))
    assert not unlisted, f"JSON written with json.dump(s), not kvtier.results.json_text: {unlisted}"
    stale = sorted(set(OWN_JSON_WRITERS) - set(found))
    assert not stale, f"OWN_JSON_WRITERS entries that match no call any more (remove them): {stale}"
    for key, calls in found.items():
        strict = [any(k.arg == "allow_nan" and isinstance(k.value, ast.Constant) and k.value.value is False
                      for k in c.keywords) for c in calls]  # fmt: skip
        assert all(s == OWN_JSON_WRITERS[key][0] for s in strict), f"{key}: allow_nan=False expected {strict}"
