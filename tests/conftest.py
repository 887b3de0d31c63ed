from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from threadpoolctl import threadpool_limits

import kvtier

try:
    from hypothesis import settings
except ImportError:  # the engine environment (tests/vllm, tests/sglang_hicache) has no Hypothesis
    pass
else:
    # Tests check correctness, never wall-clock time: no Hypothesis example has a deadline (its
    # 200 ms default failed tests/sim/test_cost.py on this 2-core machine under load). A test's own
    # settings(...) still set its example counts.
    settings.register_profile("kvtier", deadline=None)
    settings.load_profile("kvtier")


@pytest.fixture(scope="session", autouse=True)
def _one_blas_thread() -> Iterator[None]:
    """One BLAS thread for the whole session: OpenBLAS's spinning threads slow down 10x or more when
    other processes share the cores; one thread costs little on the engine's small batches."""
    with threadpool_limits(limits=1, user_api="blas"):
        yield


@pytest.fixture(scope="session")
def smollm2() -> tuple[Any, Any]:
    """The real SmolLM2-135M-Instruct and its tokenizer (``kvtier.engine.load``), loaded once."""
    from kvtier.engine import load

    return load()


@pytest.fixture
def small_geometry() -> kvtier.Geometry:
    """2 layers, 2 KV heads, head dim 8, fp16, 4-token blocks: 512-byte blocks."""
    return kvtier.Geometry(2, 2, 8, "fp16", 4)


@pytest.fixture
def small_store(small_geometry: kvtier.Geometry) -> kvtier.Store:
    config = kvtier.StoreConfig(
        geometry=small_geometry, model_id="test-model", dram=kvtier.DramConfig(capacity_bytes=64 * 4096)
    )
    return kvtier.Store(config)
