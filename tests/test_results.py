"""kvtier.results: a typed result's one way to JSON (``as_dict``) and back (``from_json``), and the
error ``from_json`` gives for an untrusted document that does not hold the result."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from kvtier.bench.sglang import BackendTimes, SglangBench, summary
from kvtier.errors import KvtierError
from kvtier.results import OMIT, Result, to_json


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
