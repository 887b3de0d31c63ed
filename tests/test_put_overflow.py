"""Puts larger than DRAM (issue 19, item 4): with a lower tier below, the put streams through
(write-through, or eviction with demotion as it goes) and reports what is really stored where;
with DRAM alone it keeps what fits and says so. ``rejected`` means held by no tier."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import kvtier
from kvtier.testing.redis import LocalRedis

GEOMETRY = kvtier.Geometry(2, 2, 16, "fp16", 8)  # 2 KiB blocks: one 4 KiB DRAM page each
DRAM_BLOCKS = 3
N = 12


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[LocalRedis]:
    with LocalRedis(tmp_path / "redis") as server:
        yield server


def make(**kw: object) -> kvtier.Store:
    return kvtier.Store(
        kvtier.StoreConfig(
            geometry=GEOMETRY,
            model_id="overflow",
            dram=kvtier.DramConfig(capacity_bytes=DRAM_BLOCKS * 4096),
            **kw,  # type: ignore[arg-type]
        )
    )


def batch(store: kvtier.Store, seed: int = 0) -> tuple[kvtier.BlockKeys, np.ndarray]:
    keys = store.namespace.block_keys(np.arange(N * GEOMETRY.block_tokens, dtype=np.uint32) + 10_000 * seed)
    objects = np.random.default_rng(seed).integers(0, 256, (N, GEOMETRY.block_bytes), dtype=np.uint8)
    return keys, objects


def load_all(store: kvtier.Store, keys: kvtier.BlockKeys) -> np.ndarray:
    out = np.zeros((len(keys), GEOMETRY.block_bytes), dtype=np.uint8)
    with store.lease(keys) as lease:
        assert lease.hit_blocks == len(keys), lease.tiers
        assert store.load(lease, out).loaded_blocks == len(keys)
    return out


def test_dram_alone_keeps_what_fits_and_says_so() -> None:
    store = make()
    keys, objects = batch(store)
    r = store.put(keys, objects)
    assert (r.stored, r.already_present, r.rejected) == (DRAM_BLOCKS, 0, N - DRAM_BLOCKS)
    assert r.written == kvtier.TierWrites(dram=DRAM_BLOCKS)
    assert store.lookup(keys).hit_blocks == DRAM_BLOCKS  # the prefix that fit, nothing claimed beyond
    assert store.stats().rejected_puts == N - DRAM_BLOCKS


@pytest.mark.parametrize("write_through", [True, False], ids=["write-through", "demotion"])
def test_ssd_below_takes_everything_dram_cannot(tmp_path: Path, write_through: bool) -> None:
    store = make(
        ssd=kvtier.SsdConfig(
            directory=str(tmp_path), capacity_bytes="4MiB", probe_bytes=0, write_through=write_through
        ),
    )
    keys, objects = batch(store)
    r = store.put(keys, objects)
    assert (r.stored, r.already_present, r.rejected) == (N, 0, 0), r
    assert r.written.ssd >= N - DRAM_BLOCKS and r.written.remote == 0, r.written
    assert np.array_equal(load_all(store, keys), objects)
    again = store.put(keys, objects)  # blocks only on SSD are copied into DRAM again; none refused
    assert again.rejected == 0 and again.stored == again.written.dram, again
    assert np.array_equal(load_all(store, keys), objects)
    del store
    gc.collect()


def test_remote_write_through_takes_everything_dram_cannot(redis: LocalRedis) -> None:
    store = make(remote=kvtier.RemoteConfig(urls=[redis.url]))
    keys, objects = batch(store)
    r = store.put(keys, objects)
    assert (r.stored, r.already_present, r.rejected) == (N, 0, 0), r
    assert r.written.remote == N and r.written.dram == DRAM_BLOCKS, r.written
    fresh = make(
        remote=kvtier.RemoteConfig(urls=[redis.url])
    )  # another process's view: all of it on the server
    assert np.array_equal(load_all(fresh, keys), objects)


def test_a_refusal_is_reported_when_the_server_is_down(tmp_path: Path) -> None:
    """Remote write-through to a server that is not there: the blocks DRAM had no room for are
    in no tier, and the report says so (no claimed write)."""
    from kvtier.testing.redis import free_port

    store = make(remote=kvtier.RemoteConfig(urls=[f"redis://127.0.0.1:{free_port()}"], connect_timeout_s=0.2))
    keys, objects = batch(store)
    r = store.put(keys, objects)
    assert (r.stored, r.rejected) == (DRAM_BLOCKS, N - DRAM_BLOCKS), r
    assert r.written.remote == 0
