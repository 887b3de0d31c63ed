from __future__ import annotations

from pathlib import Path

import pytest

import kvtier
from kvtier.config import parse_size
from kvtier.errors import ConfigError


def test_from_dict_with_preset_and_sizes() -> None:
    config = kvtier.StoreConfig.from_dict(
        {"geometry": "llama-3-8b", "model_id": "m", "dram_capacity_bytes": "512MiB", "eviction": "lru"}
    )
    assert config.dram_capacity_bytes == 512 * 2**20
    assert config.geometry.block_bytes == 2 * 2**20
    assert kvtier.StoreConfig.from_dict(config.to_dict()) == config


def test_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "store.yaml"
    path.write_text(
        "store:\n"
        "  model_id: demo\n"
        "  cache_salt: tenant-a\n"
        "  dram_capacity_bytes: 1GiB\n"
        "  geometry: {num_layers: 2, num_kv_heads: 2, head_dim: 8, dtype: fp16, block_tokens: 4}\n"
    )
    config = kvtier.StoreConfig.from_yaml(path)
    assert config.cache_salt == "tenant-a"
    assert config.geometry == kvtier.Geometry(2, 2, 8, "fp16", 4)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"geometry": "llama-3-8b", "dram_capacity": "1GiB"}, "unknown store config key"),
        ({"model_id": "m"}, "no `geometry`"),
        ({"geometry": "llama-3-8b", "dram_capacity_bytes": 0}, "at least one block"),
        ({"geometry": "llama-3-8b", "dram_capacity_bytes": "-5GiB"}, "size in bytes"),
        ({"geometry": "llama-3-8b", "dram_capacity_bytes": "4 parsecs"}, "size in bytes"),
        ({"geometry": "llama-3-8b", "eviction": "random"}, "expected one of"),
        ({"geometry": "llama-3-8b", "lease_ttl_s": 0}, "positive"),
        ({"geometry": "llama-3-8b", "copy_threads": -1}, "copy_threads"),
        ({"geometry": "llama-3-8b", "model_id": ""}, "model_id"),
        ({"geometry": "llama-3-8b", "dram_prefault": "yes"}, "dram_prefault"),
        ({"geometry": {"num_layers": 2}}, "missing"),
    ],
)
def test_bad_config_names_the_problem(data: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        kvtier.StoreConfig.from_dict(data)


def test_bad_yaml(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("store: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        kvtier.StoreConfig.from_yaml(path)
    with pytest.raises(ConfigError, match="cannot read"):
        kvtier.StoreConfig.from_yaml(tmp_path / "missing.yaml")


def test_parse_size() -> None:
    assert parse_size("4GiB", "x") == 4 * 2**30
    assert parse_size("1.5 GB", "x") == 1_500_000_000
    assert parse_size(123, "x") == 123
    with pytest.raises(ConfigError, match="`x`"):
        parse_size(True, "x")


def test_config_is_frozen() -> None:
    config = kvtier.StoreConfig(geometry=kvtier.Geometry(1, 1, 8))
    with pytest.raises(AttributeError):
        config.eviction = "s3fifo"  # type: ignore[misc]
