"""What keeps SGLang deployments apart in kvtier (docs/sglang.md, "Keys and namespace"): pages
whose bytes mean other KV must never be found under each other's keys, whatever SGLang's host
pool looks like."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from hicache_helpers import backend, fill, host_pool, page_bytes, page_keys, storage_config
from sglang.srt.mem_cache.storage import StorageBackendFactory

from kvtier.errors import ConfigError
from kvtier.testing.redis import LocalRedis


def shared(server: LocalRedis, **extra: Any) -> dict[str, Any]:
    """A Redis tier two deployments share (a fresh DRAM tier each), plus ``extra``."""
    return {"dram": {"capacity_bytes": "1MiB"}, "remote": {"urls": [server.url]}, **extra}


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_fp8_pages_name_their_format_and_e4m3_pages_never_load_as_e5m2(kind: str, redis: LocalRedis) -> None:
    # SGLang keeps fp8 KV of either format (e4m3, e5m2; e4m3fnuz on ROCm) as uint8 in its pools
    # (`store_dtype`): the pool alone cannot say which format its bytes are in.
    model = f"fp8-{kind}"
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        backend(host_pool(kind, dtype=torch.uint8), shared(redis), model=model)
    pool = host_pool(kind, dtype=torch.uint8)
    writer = backend(pool, shared(redis, kv_cache_dtype="fp8_e4m3"), model=model)
    keys = page_keys(f"f8{kind}", 3)
    slots = fill(pool, 3, seed=21)
    assert writer.batch_set_v1(keys, slots) == [True] * 3
    same_pool = host_pool(kind, dtype=torch.uint8)
    same = backend(same_pool, shared(redis, kv_cache_dtype="fp8_e4m3"), model=model)
    into = same_pool.alloc(3 * same_pool.page_size)
    assert same.batch_get_v1(keys, into) == [True] * 3
    assert [page_bytes(same_pool, into, i) for i in range(3)] == [
        page_bytes(pool, slots, i) for i in range(3)
    ]
    for other in ("fp8_e5m2", "fp8_e4m3fnuz"):
        reader = backend(host_pool(kind, dtype=torch.uint8), shared(redis, kv_cache_dtype=other), model=model)
        assert reader.batch_exists(keys) == 0, other


def test_a_kv_cache_dtype_the_pool_does_not_hold_is_refused(redis: LocalRedis) -> None:
    with pytest.raises(ConfigError, match=r"kv_cache_dtype.*bfloat16"):
        backend(host_pool(dtype=torch.bfloat16), shared(redis, kv_cache_dtype="fp8_e5m2"))
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        backend(host_pool(), shared(redis, kv_cache_dtype="fp8"))
    with pytest.raises(ConfigError, match=r"kv_cache_dtype.*float8_e4m3fn"):
        backend(host_pool(dtype=torch.float8_e4m3fn), shared(redis, kv_cache_dtype="fp8_e5m2"))
    # A pool typed as fp8 says its format itself; naming the same one is accepted.
    made = backend(host_pool(dtype=torch.float8_e4m3fn), shared(redis, kv_cache_dtype="fp8_e4m3"))
    assert made.pages.geometry.dtype == "fp8_e4m3"


def test_another_page_size_or_dtype_is_a_miss(redis: LocalRedis) -> None:
    # SGLang's page hashes are chained per page, so the same key string under another page size
    # names other tokens; and bf16 bytes are not fp16 KV. Both are in the namespace (geometry).
    pool = host_pool()
    keys = page_keys("ps", 2)
    writer = backend(pool, shared(redis), model="pages")
    assert writer.batch_set_v1(keys, fill(pool, 2, seed=31)) == [True, True]
    assert backend(host_pool(), shared(redis), model="pages").batch_exists(keys) == 2
    assert backend(host_pool(page=8), shared(redis), model="pages").batch_exists(keys) == 0
    assert backend(host_pool(dtype=torch.float16), shared(redis), model="pages").batch_exists(keys) == 0


def test_attention_dp_ranks_get_their_own_ssd_pools_and_share_a_remote_tier(
    tmp_path: Path, redis: LocalRedis
) -> None:
    # With DP attention SGLang runs one process per DP rank, each with tp_rank 0 of its attention
    # group and the same KV: the second rank's backend used to fail to open the first's SSD pool.
    extra = {**shared(redis), "ssd": {"directory": str(tmp_path), "capacity_bytes": "4MiB", "probe_bytes": 0}}
    ranks = []
    for dp in (0, 1):
        pool = host_pool()
        made = StorageBackendFactory.create_backend(
            "dynamic", dataclasses.replace(storage_config(extra), dp_rank=dp), pool
        )
        made.register_mem_pool_host(pool)
        ranks.append((made, pool))
    assert [Path(m.store.config.ssd.directory) for m, _ in ranks] == [
        tmp_path,
        tmp_path / "tp0of1-pp0of1-cp0of1-dp1",
    ]
    (writer, pool), (reader, _) = ranks
    keys = page_keys("dp", 2)
    writer.batch_set_v1(keys, fill(pool, 2, seed=41))
    assert reader.batch_exists(keys) == 2  # the same KV: one namespace, shared through Redis
