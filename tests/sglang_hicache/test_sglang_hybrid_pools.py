"""How a hybrid model's host pools sit in kvtier (docs/sglang.md "Hybrid models"): each pool its
own namespace with the rank rules of its bytes, its share of the tiers, `clear()` over all of
them, pools kvtier cannot store refused and missed, and every v2 input checked before any page
moves. Against SGLang's own host pool classes."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hicache_helpers import fill, host_pool, hybrid_backend, hybrid_pools, mamba_pool, page_bytes, page_keys
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName
from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool, LogicalHostPool
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from test_sglang_hybrid import DRAM, load, query, store, tier_extra, xfer

from kvtier.errors import LayoutError
from kvtier.testing.redis import LocalRedis

KV, SWA, MAMBA = PoolName.KV, PoolName.SWA, PoolName.MAMBA


def shared(redis: LocalRedis) -> dict[str, Any]:
    return {**DRAM, "remote": {"urls": [redis.url]}}


def test_other_ranks_and_models_miss_and_state_is_per_rank_even_for_mla(redis: LocalRedis) -> None:
    # MHA: every pool of rank 0 is rank 0's shard. MLA: the KV and an MLA-class SWA pool are the
    # same on every rank (one copy, read by all); the Mamba state is per rank even then (SGLang
    # backs it up from every rank, `hybrid_cache_controller.py` 1739-1747).
    keys = page_keys("ranks", 6)
    pools = hybrid_pools("mha")
    store(hybrid_backend(pools, shared(redis), model="r-mha", tp_rank=0, tp_size=2), pools, keys, seed=20)
    assert (
        query(hybrid_backend(hybrid_pools("mha"), shared(redis), model="r-mha", tp_rank=0, tp_size=2), keys)[
            0
        ]
        == 6
    )
    for other in (
        {"model": "r-mha", "tp_rank": 1, "tp_size": 2},
        {"model": "r-other", "tp_rank": 0, "tp_size": 2},
    ):
        made = hybrid_backend(hybrid_pools("mha"), shared(redis), **other)
        assert query(made, keys) == (0, {}, []), other
        assert {n: set(p.store.lookup_each(p.keys(keys))) for n, p in made.pools.items()} == {
            n: {None} for n in ("kv", "swa", "mamba")
        }
    pools = hybrid_pools("mla")
    expected = store(
        hybrid_backend(pools, shared(redis), model="r-mla", tp_rank=0, tp_size=2), pools, keys, seed=21
    )
    rank1_pools = hybrid_pools("mla")
    rank1 = hybrid_backend(rank1_pools, shared(redis), model="r-mla", tp_rank=1, tp_size=2)
    assert load(rank1, rank1_pools, KV, keys) == [expected["kv", k] for k in keys]
    assert load(rank1, rank1_pools, SWA, keys[4:]) == [expected["swa", k] for k in keys[4:]]
    assert load(rank1, rank1_pools, MAMBA, keys[5:]) == [None]  # rank 0's state is not rank 1's
    assert query(rank1, keys) == (0, {"kv": 6, "swa": 6}, [])
    ids = {n: p.store.config.model_id for n, p in rank1.pools.items()}
    assert "|tp=mla|" in ids["kv"] and "|tp=mla|" in ids["swa"] and "|tp=2|" in ids["mamba"]
    assert {n: p.store.namespace.rank for n, p in rank1.pools.items()} == {"kv": 0, "swa": 0, "mamba": 1}


@pytest.mark.parametrize("tier", ["ssd", "redis"])
def test_clear_drops_every_pool_and_a_fresh_backend_finds_none(
    tier: str, tmp_path: Path, redis: LocalRedis
) -> None:
    extra = tier_extra(tier, tmp_path, redis)
    keys = page_keys(f"clear-{tier}", 6)
    pools = hybrid_pools()
    made = hybrid_backend(pools, extra, model=f"hy-clear-{tier}")
    store(made, pools, keys, seed=22)
    made.clear()
    assert query(made, keys) == (0, {}, [])
    made.close()
    fresh = hybrid_backend(hybrid_pools(), extra, model=f"hy-clear-{tier}")
    assert query(fresh, keys) == (0, {}, [])
    assert {n: set(p.store.lookup_each(p.keys(keys))) for n, p in fresh.pools.items()} == {
        n: {None} for n in ("kv", "swa", "mamba")
    }


def dsv4_swa_pool() -> Any:
    """DeepSeek V4's SWA host pool (a class kvtier does not store)."""
    with host_memory_budget_scope(1 << 30):
        buffers = [torch.zeros(8, 64, dtype=torch.uint8) for _ in range(2)]
        return DeepSeekV4PagedHostPool("swa", buffers, 64, 16, 4, layout="page_first", pin_memory=False)


def test_a_pool_kvtier_cannot_store_is_refused_and_every_query_needing_it_misses(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pools = {KV: host_pool(ratio=8.0), SWA: dsv4_swa_pool(), MAMBA: mamba_pool()}
    with caplog.at_level(logging.WARNING, logger="kvtier.sglang"):
        made = hybrid_backend(pools, DRAM, model="refuse")
    assert set(made.refused_pools) == {"swa"} and "DeepSeekV4PagedHostPool" in made.refused_pools["swa"]
    assert "does not store SGLang's 'swa' host pool" in caplog.text
    keys = page_keys("refused", 3)
    assert made.batch_set_v1(keys, fill(pools[KV], 3, seed=23)) == [True] * 3
    states = fill(pools[MAMBA], 1, seed=24)
    slots = pools[SWA].alloc(2 * pools[SWA].page_size)
    done = made.batch_set_v2([xfer(MAMBA, keys[2:], states), xfer(SWA, keys[1:], slots)])
    assert done == {MAMBA: [True], SWA: [False, False]}
    assert made.batch_get_v2([xfer(SWA, keys[1:], slots)]) == {SWA: [False, False]}
    assert query(made, keys) == (0, {"kv": 3, "mamba": 3}, [])
    mamba_only = made.batch_exists_v2(keys, [xfer(MAMBA, ["__placeholder__"])])
    assert (mamba_only.kv_hit_pages, mamba_only.restorable_prefix_pages) == (3, [3])
    # A pool registered after the pools were laid out over the tiers is refused too.
    made.register_mem_host_pool_v2(host_pool(ratio=8.0), PoolName.DRAFT)
    assert "laid out" in made.refused_pools["draft"] and "draft" not in made.pools
    # DeepSeek V4's KV anchor holds no pages at all: refused when SGLang registers it.
    with pytest.raises(LayoutError, match="LogicalHostPool"):
        made.register_mem_pool_host(LogicalHostPool(64, 4, layout="page_first"))


def test_v2_inputs_are_checked_before_any_page_moves() -> None:
    pools = hybrid_pools()
    made = hybrid_backend(pools, DRAM, model="inputs")
    keys = page_keys("in", 2)
    swa, states = fill(pools[SWA], 2, seed=25), fill(pools[MAMBA], 2, seed=26)
    good = xfer(MAMBA, keys, states)
    for bad, message in [
        (xfer(SWA, keys, swa[:7]), r"expected \(8,\)"),
        (xfer(SWA, keys, swa + 1), "whole, aligned pages"),
        (xfer(SWA, keys, None), "NoneType"),
        (xfer(MAMBA, keys, states.float()), "integer slots"),
        (xfer(MAMBA, keys, states + pools[MAMBA].size), "past the pool"),
        (xfer(MAMBA, [keys[0], 7], states), r"keys\[1\]"),  # type: ignore[list-item]
    ]:
        for call in (made.batch_set_v2, made.batch_get_v2):
            with pytest.raises(LayoutError, match=message):
                call([good, bad])
    with pytest.raises(LayoutError, match="list of PoolTransfer"):
        made.batch_set_v2(good)
    made.batch_set_v1(keys, fill(pools[KV], 2, seed=27))
    with pytest.raises(LayoutError, match="block_groups"):
        made.batch_exists_v2(keys, [xfer(MAMBA, ["__placeholder__"], policy=PoolHitPolicy.BLOCK_GROUPS)])
    with pytest.raises(LayoutError, match="registered first"):
        made.register_mem_host_pool_v2(host_pool(ratio=8.0), KV)
    assert all(p.store.stats().put_blocks == 0 for n, p in made.pools.items() if n != "kv")


def test_the_pools_share_the_configured_tiers(tmp_path: Path) -> None:
    ssd = {"directory": str(tmp_path), "capacity_bytes": "8MiB", "probe_bytes": 0, "codec": "lossless"}
    pools = hybrid_pools()
    made = hybrid_backend(pools, {"dram": {"capacity_bytes": "2MiB"}, "ssd": ssd}, model="split", tp_size=2)
    configs = {n: p.store.config for n, p in made.pools.items()}
    host_bytes = {n: p.pages.num_pages * p.pages.page_bytes for n, p in made.pools.items()}
    total = sum(host_bytes.values())
    for name, config in configs.items():  # in proportion to the host pools' bytes
        assert config.dram.capacity_bytes == 2 * 2**20 * host_bytes[name] // total, name
        assert config.ssd is not None and config.ssd.capacity_bytes == 8 * 2**20 * host_bytes[name] // total
    # What the SSD pools hold: each its share, not more (an SSD pool keeps the size it was created
    # with, so none may be created before the shares are known).
    ssd_bytes = {n: p.store.tier_stats()["ssd"].capacity_bytes for n, p in made.pools.items()}
    assert sum(ssd_bytes.values()) <= 8 * 2**20
    assert all(ssd_bytes[n] >= c.ssd.capacity_bytes - 8192 for n, c in configs.items() if c.ssd), ssd_bytes
    rank_dir = tmp_path / "tp0of2-pp0of1-cp0of1"
    assert {n: Path(c.ssd.directory) for n, c in configs.items() if c.ssd} == {
        "kv": rank_dir,
        "swa": rank_dir / "pool-swa",
        "mamba": rank_dir / "pool-mamba",
    }
    assert {c.ssd.codec for c in configs.values() if c.ssd} == {"lossless"}  # every pool's SSD encodes alike
    assert configs["mamba"].model_id.endswith(
        "|layout=mamba-page_first-temporal=float32[2, 1, 2, 4, 8]+conv0=bfloat16[2, 1, 6, 3]+side0=int32[6]|pool=mamba"
    )
    keys = page_keys("split", 6)
    expected = store(made, pools, keys, seed=28)
    assert load(made, pools, MAMBA, keys[5:]) == [expected["mamba", keys[5]]]


@pytest.mark.parametrize(
    ("layout", "side_state", "conv_only"),
    [
        ("page_first", True, False),
        ("page_first_direct", True, False),
        ("page_first", False, False),
        ("page_first", True, True),
    ],
)
def test_every_state_pool_shape_round_trips(layout: str, side_state: bool, conv_only: bool) -> None:
    pools = {KV: host_pool(ratio=8.0), MAMBA: mamba_pool(layout, side_state=side_state, conv_only=conv_only)}
    made = hybrid_backend(pools, DRAM, model=f"state-{layout}-{side_state}-{conv_only}")
    keys = page_keys("st", 3)
    states = fill(pools[MAMBA], 3, seed=29)
    expected = [page_bytes(pools[MAMBA], states, j) for j in range(3)]
    assert made.pools["mamba"].pages.page_bytes == pools[MAMBA].size_per_token == len(expected[0])
    assert made.batch_set_v2([xfer(MAMBA, keys, states)]) == {MAMBA: [True] * 3}
    assert load(made, pools, MAMBA, keys) == expected
    # Each stored object is exactly SGLang's flat page of the slot (`get_data_page`).
    state = made.pools["mamba"]
    raw = np.zeros((3, state.pages.page_bytes), dtype=np.uint8)
    with state.store.lease(state.keys(keys)) as lease:
        assert state.store.load(lease, raw).loaded_blocks == 3
    assert [bytes(row) for row in raw] == expected
