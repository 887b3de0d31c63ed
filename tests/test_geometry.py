from __future__ import annotations

from typing import Any

import pytest

import kvtier
from kvtier.errors import ConfigError, GeometryError, KvtierError
from kvtier.geometry import ExtraGroup, Geometry, preset


def test_llama3_8b_sizes() -> None:
    g = Geometry.llama3_8b()
    assert g.segment_bytes == 16 * 8 * 128 * 2
    assert g.block_bytes == 2 * 2**20
    assert g.bytes_per_token == 128 * 2**10
    assert g.pool_bytes(10) == 10 * g.block_bytes


def test_extra_groups_add_bytes() -> None:
    g = Geometry(2, 1, 4, "fp32", 8, (ExtraGroup("mamba", 100),))
    assert g.kv_block_bytes == 2 * 2 * 8 * 4 * 4
    assert g.block_bytes == g.kv_block_bytes + 800


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"num_kv_heads": -1}, "num_kv_heads"),
        ({"head_dim": 2.5}, "head_dim"),
        ({"block_tokens": True}, "block_tokens"),
        ({"dtype": "int4"}, "int4"),
        ({"num_layers": 1024, "num_kv_heads": 1024, "head_dim": 16384}, "too large"),
    ],
)
def test_bad_geometry_names_the_field(kwargs: dict[str, object], needle: str) -> None:
    base: dict[str, object] = {
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 8,
        "dtype": "fp16",
        "block_tokens": 4,
    }
    base.update(kwargs)
    with pytest.raises(GeometryError, match=needle) as info:
        Geometry(**base)  # type: ignore[arg-type]
    assert isinstance(info.value, KvtierError)


def test_duplicate_extra_group_rejected() -> None:
    with pytest.raises(GeometryError, match="twice"):
        Geometry(1, 1, 1, "fp16", 1, (ExtraGroup("a", 1), ExtraGroup("a", 2)))


def test_dtype_aliases_normalise() -> None:
    assert Geometry(1, 1, 1, "bfloat16", 1).dtype == "bf16"
    assert Geometry(1, 1, 1, "float8_e4m3fn", 1).dtype_bytes == 1


def test_from_dict_and_presets() -> None:
    g = Geometry.from_dict({"preset": "llama-3-8b", "block_tokens": 32})
    assert g.block_tokens == 32 and g.num_layers == 32
    assert Geometry.from_dict(g.to_dict()) == g
    with pytest.raises(ConfigError, match="unknown geometry key"):
        Geometry.from_dict({"num_layer": 2})
    with pytest.raises(ConfigError, match="expected one of"):
        preset("gpt-5")


def test_an_unknown_geometry_key_names_the_key_it_resembles() -> None:
    with pytest.raises(ConfigError, match=r"\['block_token'\] \(did you mean 'block_tokens'\?\)"):
        Geometry.from_dict({"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_token": 4})
    # YAML keys need not be strings: named, never a TypeError from sorting them.
    with pytest.raises(
        ConfigError, match=r"unknown geometry key\(s\) \['layers', 2\] \(did you mean 'num_layers'\?\)"
    ):
        Geometry.from_dict({"preset": "llama-3-8b", 2: 1, "layers": 3})


def test_geometry_is_frozen_and_hashable() -> None:
    g = kvtier.Geometry(2, 2, 8)
    with pytest.raises(AttributeError):
        g.num_layers = 3  # type: ignore[misc]
    assert len({g, kvtier.Geometry(2, 2, 8)}) == 1


def test_the_engine_reads_block_tokens_from_its_pool_geometry(smollm2: tuple[Any, Any]) -> None:
    """Issue 18 step 5: the Geometry owns ``block_tokens``; the engine's parts keep no copy of it."""
    from kvtier.engine import Engine, EngineConfig
    from kvtier.engine.view import build_view
    from kvtier.sched import make_policy

    engine = Engine(
        smollm2[0], make_policy("fcfs"), EngineConfig(num_blocks=8, block_tokens=8, swap_blocks=2)
    )
    view = build_view(engine)
    parts = {"engine": engine, "loads": engine.loads, "host_swap": engine.host_swap, "cost": view.cost}
    copies = [
        f"{name}.{attr}" for name, part in parts.items() for attr in vars(part) if "block_tokens" in attr
    ]
    assert not copies, copies
    assert engine.pool.geometry.block_tokens == view.block_tokens == 8
    assert view.kv_bytes_per_token * 8 == engine.pool.geometry.block_bytes
