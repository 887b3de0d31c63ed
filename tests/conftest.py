from __future__ import annotations

import pytest

import kvtier


@pytest.fixture
def small_geometry() -> kvtier.Geometry:
    """2 layers, 2 KV heads, head dim 8, fp16, 4-token blocks: 512-byte blocks."""
    return kvtier.Geometry(2, 2, 8, "fp16", 4)


@pytest.fixture
def small_store(small_geometry: kvtier.Geometry) -> kvtier.Store:
    config = kvtier.StoreConfig(geometry=small_geometry, model_id="test-model", dram_capacity_bytes=64 * 4096)
    return kvtier.Store(config)
