"""`Store.clear()`: every block of the store's namespace leaves every tier (DRAM, the SSD pool with
its index log, a real Redis), other namespaces keep theirs, a tier that cannot be cleared is an
error after the others were, and a put in flight when it starts does not land after it (the clear
is a barrier within the process). What vLLM's connector reset and SGLang's storage clear call."""

from __future__ import annotations

import gc
import threading
import time
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


def config(model: str, ssd: Path, url: str, io_timeout_s: float = 2.0) -> kvtier.StoreConfig:
    ssd.mkdir(exist_ok=True)
    return kvtier.StoreConfig(
        geometry=GEOMETRY,
        model_id=model,
        dram=kvtier.DramConfig(capacity_bytes=64 * 4096),
        ssd=kvtier.SsdConfig(directory=str(ssd), capacity_bytes=1 << 20, probe_bytes=0, write_through=True),
        remote=kvtier.RemoteConfig(
            urls=[url], connect_timeout_s=0.5, io_timeout_s=io_timeout_s, reconnect_backoff_max_s=0.05
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


def blocked_clients(redis: LocalRedis) -> int:
    info = redis.command("INFO", "clients")
    text = info.decode() if isinstance(info, bytes) else str(info)
    return int(next(line for line in text.splitlines() if line.startswith("blocked_clients:")).split(":")[1])


def test_a_put_in_flight_when_the_clear_starts_does_not_land_after_it(
    tmp_path: Path, redis: LocalRedis
) -> None:
    """The put is held at its remote SET (the server pauses writes: `CLIENT PAUSE .. WRITE`), after
    its DRAM and SSD writes; the clear starts meanwhile. Without the barrier the clear returned
    while the SET waited (its SCAN is a read), and the SET then landed: old KV after the clear."""
    store = kvtier.Store(config("weights-v1", tmp_path / "a", redis.url, io_timeout_s=60.0))  # SET waits
    keys = store.namespace.block_keys(TOKENS)
    data = np.random.default_rng(4).integers(0, 256, (len(keys), GEOMETRY.block_bytes), dtype=np.uint8)
    assert redis.command("CLIENT", "PAUSE", "60000", "WRITE") == "OK"
    try:
        put = threading.Thread(target=store.put, args=(keys, data))
        put.start()
        deadline = time.monotonic() + 30.0
        while blocked_clients(redis) == 0:  # the put's SET waits on the server
            assert time.monotonic() < deadline, "the put never reached its SET"
            time.sleep(0.001)
        cleared: list[int] = []
        clear = threading.Thread(target=lambda: cleared.append(store.clear()))
        clear.start()
        # With the barrier the clear waits for the put and this wait runs out; without it the
        # clear returns here, before the SET lands. (Either way the result below is decided.)
        clear.join(timeout=1.0)
    finally:
        assert redis.command("CLIENT", "UNPAUSE") == "OK"
    put.join()
    clear.join()
    assert store.lookup(keys).hit_blocks == 0, "the put landed after the clear"
    assert redis.command("DBSIZE") == 0
    assert cleared == [3 * len(keys)]  # DRAM, SSD (write-through) and Redis: the put landed first
    store.check_integrity()
