"""The dicts the Rust extension returns have exactly the keys and value types that ``_core.pyi``
declares for them (``TypedDict``s, read with :mod:`ast`: the stub is not importable), so
``mypy --strict`` checks every reader of ``Store.ssd_metrics()`` and the rest against the truth."""

from __future__ import annotations

import ast
from pathlib import Path

from kvtier import _core
from kvtier.geometry import Geometry
from kvtier.testing.redis import LocalRedis

STUB = Path(_core.__file__).with_name("_core.pyi")
PLAIN = {"int": int, "float": float, "str": str, "bool": bool}


def _declared() -> dict[str, dict[str, str]]:
    """TypedDict name -> field -> annotation text, class and functional forms."""
    out: dict[str, dict[str, str]] = {}
    for node in ast.parse(STUB.read_text()).body:
        if isinstance(node, ast.ClassDef) and any(ast.unparse(b) == "TypedDict" for b in node.bases):
            out[node.name] = {
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
    assert set(DECLARED) == {"GeometrySizes", "SsdMetrics", "RemoteMetrics"} | nested


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
