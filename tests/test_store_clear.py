"""`Store.clear()`: every block of the store's namespace leaves every tier (DRAM, the SSD pool with
its index log, a real Redis), other namespaces keep theirs, and a tier that cannot be cleared is
an error after the others were. What vLLM's connector reset and SGLang's storage clear call."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import kvtier
from kvtier.errors import StoreError
from kvtier.testing.redis import LocalRedis

GEOMETRY = kvtier.Geometry(2, 2, 8, "fp16", 4)  # 512-byte blocks
TOKENS = np.arange(48, dtype=np.uint32)  # 12 blocks


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[LocalRedis]:
    with LocalRedis(tmp_path / "redis") as server:
        yield server


def config(model: str, ssd: Path, url: str) -> kvtier.StoreConfig:
    ssd.mkdir(exist_ok=True)
    return kvtier.StoreConfig(
        geometry=GEOMETRY,
        model_id=model,
        dram=kvtier.DramConfig(capacity_bytes=64 * 4096),
        ssd=kvtier.SsdConfig(directory=str(ssd), capacity_bytes=1 << 20, probe_bytes=0, write_through=True),
        remote=kvtier.RemoteConfig(
            urls=[url], connect_timeout_s=0.5, io_timeout_s=2.0, reconnect_backoff_max_s=0.05
        ),
    )


def fill(store: kvtier.Store, seed: int) -> kvtier.BlockKeys:
    keys = store.namespace.block_keys(TOKENS)
    data = np.random.default_rng(seed).integers(0, 256, (len(keys), GEOMETRY.block_bytes), dtype=np.uint8)
    assert store.put(keys, data).stored == len(keys)
    return keys


def test_clear_drops_the_namespace_from_every_tier_and_only_it(tmp_path: Path, redis: LocalRedis) -> None:
    ours = kvtier.Store(config("weights-v1", tmp_path / "a", redis.url))
    theirs = kvtier.Store(config("other-model", tmp_path / "b", redis.url))
    keys, their_keys = fill(ours, 1), fill(theirs, 2)
    n = len(keys)
    assert redis.command("DBSIZE") == 2 * n
    assert ours.clear() == 3 * n  # each copy: DRAM, SSD (write-through), Redis
    assert ours.lookup(keys).hit_blocks == 0
    assert redis.command("DBSIZE") == n  # the other model's objects stay on the shared server
    assert theirs.lookup(their_keys).hit_blocks == n
    assert ours.clear() == 0
    ours.check_integrity()
    del ours
    gc.collect()  # the pool's directory lock goes with the store
    # A fresh process's store on the same SSD pool and server finds nothing: the SSD deletes
    # were synced to the pool's index log.
    again = kvtier.Store(config("weights-v1", tmp_path / "a", redis.url))
    assert again.lookup(keys).hit_blocks == 0
    metrics = again.ssd_metrics()
    assert metrics is not None and metrics["recovery"]["recovered_objects"] == 0


def test_a_server_that_is_down_is_an_error_after_the_local_tiers_were_cleared(
    tmp_path: Path, redis: LocalRedis
) -> None:
    store = kvtier.Store(config("weights-v1", tmp_path / "a", redis.url))
    keys = fill(store, 3)
    redis.stop()
    with pytest.raises(StoreError, match="remote tier could not clear the namespace"):
        store.clear()
    dram_ssd = {name: stats.objects for name, stats in store.tier_stats().items() if name != "remote"}
    assert dram_ssd == {"dram": 0, "ssd": 0}
    assert store.lookup(keys).hit_blocks == 0
