"""The dicts the Rust extension returns have exactly the keys and value types that ``_core.pyi``
declares for them (``TypedDict``s, read with :mod:`ast`: the stub is not importable), and its
report classes (``StoreStats``, ``TierStats``: made in Rust from one field list) exactly the
attributes, in order, so ``mypy --strict`` checks every reader of ``Store.stats()``,
``Store.ssd_metrics()`` and the rest against the truth."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvtier import _core
from kvtier.config import StoreConfig
from kvtier.geometry import Geometry
from kvtier.store import Store
from kvtier.testing.redis import LocalRedis

STUB = Path(_core.__file__).with_name("_core.pyi")
PLAIN = {"int": int, "float": float, "str": str, "bool": bool}
#: Classes of the stub whose annotated attributes are a Rust report's fields.
REPORTS = ("StoreStats", "TierStats")
GEOMETRY = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "fp16", "block_tokens": 4}


def _declared() -> dict[str, dict[str, str]]:
    """TypedDict name -> field -> annotation text, class and functional forms (a TypedDict's
    fields after those of the TypedDicts it derives from)."""
    out: dict[str, dict[str, str]] = {}
    for node in ast.parse(STUB.read_text()).body:
        bases = [ast.unparse(b) for b in node.bases] if isinstance(node, ast.ClassDef) else []
        typed_dict = bool(bases) and all(b == "TypedDict" or b in out for b in bases)
        if isinstance(node, ast.ClassDef) and (typed_dict or node.name in REPORTS):
            inherited = {k: v for b in bases if b in out for k, v in out[b].items()}
            out[node.name] = inherited | {
                s.target.id: ast.unparse(s.annotation)
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            }
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            call = node.value
            if ast.unparse(call.func) == "TypedDict" and isinstance(call.args[1], ast.Dict):
                out[ast.literal_eval(call.args[0])] = {
                    ast.literal_eval(k): ast.unparse(v)
                    for k, v in zip(call.args[1].keys, call.args[1].values, strict=True)
                    if k is not None
                }
    return out


DECLARED = _declared()


def _check(value: object, kind: str, where: str) -> None:
    if kind in DECLARED:
        assert isinstance(value, dict), where
        assert set(value) == set(DECLARED[kind]), f"{where}: {kind} keys differ from the runtime's"
        for key, sub in DECLARED[kind].items():
            _check(value[key], sub, f"{where}.{key}")
    elif kind.startswith("list["):
        assert isinstance(value, list), where
        for i, item in enumerate(value):
            _check(item, kind[5:-1], f"{where}[{i}]")
    else:
        expected = PLAIN[kind]
        ok = isinstance(value, int | float) if expected is float else isinstance(value, expected)
        assert ok and (expected is bool or not isinstance(value, bool)), f"{where} is {value!r}, not {kind}"


def test_every_stub_dict_is_checked_here() -> None:
    nested = {"SsdRecovery", "SsdDevice", "RemoteOp"}
    assert set(DECLARED) == {"GeometrySizes", "SsdMetrics", "RemoteMetrics", *REPORTS} | nested | {
        "TierStatsDict"
    }


def test_tier_stats_attributes_are_its_dict_keys() -> None:
    """The one field list the stub repeats (a class's attributes cannot come from a TypedDict)."""
    assert list(DECLARED["TierStats"]) == list(DECLARED["TierStatsDict"])
    assert set(DECLARED["TierStatsDict"]) < set(DECLARED["SsdMetrics"])


def _check_report(value: object, kind: str, where: str) -> None:
    """A report object: its class is the stub's, its fields the stub's attributes in order, each
    readable as an attribute with the declared type."""
    assert type(value).__name__ == kind, f"{where} is {type(value).__name__}"
    fields = value.as_dict()  # type: ignore[attr-defined]
    assert list(fields) == list(DECLARED[kind]), f"{where}: {kind} fields differ from the runtime's"
    _check(fields, kind, where)
    for name in fields:
        assert getattr(value, name) == fields[name]


def test_store_stats_and_tier_stats_match_the_stub(tmp_path: Path) -> None:
    ssd = {"directory": str(tmp_path), "capacity_bytes": 2**24, "probe_bytes": 0}
    store = Store(
        StoreConfig.from_dict({"geometry": GEOMETRY, "dram": {"capacity_bytes": 2**20}, "ssd": ssd})
    )
    _check_report(store.stats(), "StoreStats", "Store.stats()")
    tiers = store.tier_stats()
    assert list(tiers) == ["dram", "ssd"]
    for name, stats in tiers.items():
        _check_report(stats, "TierStats", f"Store.tier_stats()[{name!r}]")


def test_report_objects_are_frozen_values() -> None:
    store = Store(StoreConfig.from_dict({"geometry": GEOMETRY, "dram": {"capacity_bytes": 2**20}}))
    a, b = store.stats(), store.stats()
    assert a == b and a is not b and a != store.tier_stats()["dram"]
    assert repr(a).startswith("StoreStats(lookups=0, ")
    with pytest.raises(AttributeError, match="'StoreStats' object has no attribute 'lookup'"):
        _ = a.lookup  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        a.lookups = 1  # type: ignore[misc]
    a.as_dict()["lookups"] = 5  # a copy
    assert a.lookups == 0


def test_geometry_sizes_match_the_stub() -> None:
    _check(Geometry.llama3_8b()._handle.sizes(), "GeometrySizes", "sizes()")


def test_ssd_metrics_match_the_stub(tmp_path: Path) -> None:
    pool = _core.SsdPool({"directory": str(tmp_path), "capacity_bytes": 2**24, "probe_bytes": 0})
    try:
        metrics = pool.metrics()
        assert metrics["devices"]  # the device rows are checked too
        _check(metrics, "SsdMetrics", "SsdPool.metrics()")
    finally:
        pool.close()


def test_remote_metrics_match_the_stub(tmp_path: Path) -> None:
    with LocalRedis(tmp_path) as redis:
        pool = _core.RemotePool({"urls": [redis.url], "cluster": False}, bytes(16))
        _check(pool.metrics(), "RemoteMetrics", "RemotePool.metrics()")
