"""SGLang's `tp_lcm_size` (pages shared between TP sizes, as its Mooncake backend splits heads):
kvtier stores an MHA page_head pool's pages as head shards of `tp_lcm_size` virtual ranks, so a
TP=1 deployment's pages are read by each TP=2 rank as its own heads, and back, through Redis.
Byte-exact against SGLang's own host pools; a page some shard of which is missing is a miss."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from hicache_helpers import (
    PAGE,
    backend,
    fill,
    host_pool,
    hybrid_backend,
    hybrid_pools,
    page_bytes,
    page_keys,
)
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

from kvtier.errors import ConfigError, LayoutError
from kvtier.testing.redis import LocalRedis


def remote(server: LocalRedis) -> dict[str, Any]:
    return {
        "dram": {"capacity_bytes": "4MiB"},
        "remote": {"urls": [server.url], "connect_timeout_s": 0.5, "io_timeout_s": 2.0},
    }


def page_of(slots: torch.Tensor, i: int) -> int:
    return int(slots[i * PAGE]) // PAGE


def heads(pool: Any, slots: torch.Tensor, i: int, first: int, count: int) -> torch.Tensor:
    """Heads ``first..first+count`` of page ``i`` of ``slots`` (K and V, every token and layer)
    as bytes: random bytes hold NaNs, which no float comparison finds equal."""
    return pool.kv_buffer[:, page_of(slots, i), first : first + count].contiguous().view(torch.uint8)


def test_a_tp1_page_is_read_by_each_tp2_rank_as_its_heads_and_tp2_pages_by_tp1_whole(
    redis: LocalRedis,
) -> None:
    whole = host_pool(layout="page_head", heads=4)
    slots = fill(whole, 3, seed=31)
    keys = page_keys("split", 3)
    writer = backend(whole, remote(redis), model="split", tp_size=1, tp_lcm_size=2)
    assert writer.store.config.model_id == "sglang|split|tp=lcm2|layout=mha-page_head-bfloat16"
    assert writer.batch_set_v1(keys, slots) == [True] * 3
    assert writer.get_stats().kvtier["put_blocks"] == 6  # two head shards a page
    for rank in (0, 1):
        pool = host_pool(layout="page_head", heads=2)
        reader = backend(pool, remote(redis), model="split", tp_rank=rank, tp_size=2, tp_lcm_size=2)
        assert reader.batch_exists(keys) == 3
        into = pool.alloc(3 * PAGE)
        assert reader.batch_get_v1(keys, into) == [True] * 3
        for i in range(3):
            assert torch.equal(heads(pool, into, i, 0, 2), heads(whole, slots, i, 2 * rank, 2)), (rank, i)
    assert not torch.equal(heads(whole, slots, 0, 0, 2), heads(whole, slots, 0, 2, 2))

    # Back: each TP=2 rank stores its heads of new pages; TP=1 reads the pages whole.
    back = page_keys("back", 2)
    parts = []
    for rank in (0, 1):
        pool = host_pool(layout="page_head", heads=2)
        shard = fill(pool, 2, seed=40 + rank)
        ranked = backend(pool, remote(redis), model="split", tp_rank=rank, tp_size=2, tp_lcm_size=2)
        assert ranked.batch_set_v1(back, shard) == [True, True]
        parts.append((pool, shard))
    fresh = host_pool(layout="page_head", heads=4)
    reader = backend(fresh, remote(redis), model="split", tp_size=1, tp_lcm_size=2)
    into = fresh.alloc(2 * PAGE)
    assert reader.batch_get_v1(back, into) == [True, True]
    for i in range(2):
        for rank, (pool, shard) in enumerate(parts):
            assert torch.equal(heads(fresh, into, i, 2 * rank, 2), heads(pool, shard, i, 0, 2))

    # Only rank 0 stored these: TP=1 finds half of each page, which is no page.
    half = page_keys("half", 2)
    pool = host_pool(layout="page_head", heads=2)
    backend(pool, remote(redis), model="split", tp_rank=0, tp_size=2, tp_lcm_size=2).batch_set_v1(
        half, fill(pool, 2, seed=50)
    )
    assert reader.batch_exists(half) == 0
    assert reader.batch_get_v1(half, fresh.alloc(2 * PAGE)) == [False, False]
    assert reader.batch_get(half) == [None, None]


def test_tensor_pages_go_through_head_shards_exactly(redis: LocalRedis) -> None:
    whole = host_pool(layout="page_head", heads=4)
    slots = fill(whole, 2, seed=61)
    keys = page_keys("tensor", 2)
    pages = [whole.get_data_page(int(slots[i * PAGE]), flat=True).clone() for i in range(2)]
    writer = backend(whole, remote(redis), model="tensor", tp_size=1, tp_lcm_size=2)
    assert writer.batch_set(keys, pages)
    got = writer.batch_get(keys)
    assert all(
        g is not None and torch.equal(g.view(torch.uint8), p.view(torch.uint8))
        for g, p in zip(got, pages, strict=True)
    )
    pool = host_pool(layout="page_head", heads=2)
    rank1 = backend(pool, remote(redis), model="tensor", tp_rank=1, tp_size=2, tp_lcm_size=2)
    into = pool.alloc(2 * PAGE)
    assert rank1.batch_get_v1(keys, into) == [True, True]
    for i in range(2):
        assert torch.equal(heads(pool, into, i, 0, 2), heads(whole, slots, i, 2, 2))


def test_without_a_common_lcm_or_outside_page_head_pages_stay_per_tp_size(
    redis: LocalRedis, caplog: pytest.LogCaptureFixture
) -> None:
    whole = host_pool(layout="page_head", heads=4)
    slots = fill(whole, 2, seed=71)
    keys = page_keys("apart", 2)
    backend(whole, remote(redis), model="apart", tp_size=1).batch_set_v1(keys, slots)  # no tp_lcm_size
    pool = host_pool(layout="page_head", heads=2)
    assert (
        backend(pool, remote(redis), model="apart", tp_rank=0, tp_size=2, tp_lcm_size=2).batch_exists(keys)
        == 0
    )
    backend(whole, remote(redis), model="apart", tp_size=1, tp_lcm_size=4).batch_set_v1(keys, slots)
    assert (
        backend(pool, remote(redis), model="apart", tp_rank=0, tp_size=2, tp_lcm_size=2).batch_exists(keys)
        == 0
    )
    assert (
        backend(pool, remote(redis), model="apart", tp_rank=0, tp_size=2, tp_lcm_size=4).batch_exists(keys)
        == 2
    )

    # Another layout cannot be cut by heads: its pages stay whole, per TP size, and a warning says so.
    with caplog.at_level(logging.WARNING, logger="kvtier.sglang"):
        first = backend(
            host_pool(layout="page_first"), remote(redis), model="apart", tp_size=1, tp_lcm_size=2
        )
    assert first.store.config.model_id == "sglang|apart|tp=1|layout=mha-page_first-bfloat16"
    assert "tp_lcm_size=2" in caplog.text and "page_head" in caplog.text
    # MLA pages are the same on every rank: shared by every TP size already, no warning.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvtier.sglang"):
        mla = backend(host_pool("mla", "page_first"), remote(redis), model="apart", tp_size=1, tp_lcm_size=2)
    assert mla.store.config.model_id == "sglang|apart|tp=mla|layout=mla-page_first-bfloat16"
    assert caplog.text == ""


def test_heads_that_do_not_divide_and_a_bad_lcm_are_refused(redis: LocalRedis) -> None:
    with pytest.raises(LayoutError, match=r"2 heads\) cannot be cut into 4 head shards"):
        backend(host_pool(layout="page_head", heads=2), remote(redis), model="bad", tp_size=1, tp_lcm_size=4)
    with pytest.raises(ConfigError, match=r"tp_lcm_size=3 with tp_size=2; expected a multiple of tp_size"):
        backend(
            host_pool(layout="page_head"), remote(redis), model="bad", tp_rank=0, tp_size=2, tp_lcm_size=3
        )


def test_a_hybrid_models_kv_pool_is_cut_into_head_shards_and_its_other_pools_are_not(
    redis: LocalRedis,
) -> None:
    pools = hybrid_pools("mha", "page_head")
    made = hybrid_backend(pools, remote(redis), model="hy-split", tp_size=1, tp_lcm_size=2)
    ids = {name: pool.store.config.model_id for name, pool in made.pools.items()}
    assert ids["kv"] == "sglang|hy-split|tp=lcm2|layout=mha-page_head-bfloat16"
    assert ids["swa"] == "sglang|hy-split|tp=1|layout=mha-page_head-bfloat16|pool=swa"
    keys = page_keys("hy", 2)
    kv, swa = fill(pools[PoolName.KV], 2, seed=81), fill(pools[PoolName.SWA], 2, seed=82)
    transfers = [
        PoolTransfer(name=PoolName.KV, keys=keys, host_indices=kv),
        PoolTransfer(name=PoolName.SWA, keys=keys, host_indices=swa, hit_policy=PoolHitPolicy.TRAILING_PAGES),
    ]
    assert made.batch_set_v2(transfers) == {PoolName.KV: [True, True], PoolName.SWA: [True, True]}
    window = [PoolTransfer(name=PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    assert made.batch_exists_v2(keys, window).kv_hit_pages == 2
    # The KV pool's shards are read back by a TP=2 rank as its head; the SWA pages, not cut, by TP=1 alone.
    pool = host_pool(layout="page_head", heads=1)
    rank1 = backend(pool, remote(redis), model="hy-split", tp_rank=1, tp_size=2, tp_lcm_size=2)
    into = pool.alloc(2 * PAGE)
    assert rank1.batch_get_v1(keys, into) == [True, True]
    for i in range(2):
        assert torch.equal(heads(pool, into, i, 0, 1), heads(pools[PoolName.KV], kv, i, 1, 1))
    fresh = hybrid_pools("mha", "page_head")
    reader = hybrid_backend(fresh, remote(redis), model="hy-split", tp_size=1, tp_lcm_size=2)
    slots = {name: fresh[name].alloc(2 * PAGE) for name in (PoolName.KV, PoolName.SWA)}
    got = reader.batch_get_v2([PoolTransfer(name=n, keys=keys, host_indices=s) for n, s in slots.items()])
    assert got == {PoolName.KV: [True, True], PoolName.SWA: [True, True]}
    for name, stored in ((PoolName.KV, kv), (PoolName.SWA, swa)):
        for i in range(2):
            assert page_bytes(fresh[name], slots[name], i) == page_bytes(pools[name], stored, i)
