"""kvtier as SGLang's HiCache storage backend, against the real sglang package: the dynamic factory,
SGLang's own host KV pools (every MHA and MLA layout), both interfaces, DRAM, SSD and Redis tiers,
corruption, namespaces, config errors and input checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hicache_helpers import (
    POOLS,
    backend,
    fill,
    host_pool,
    page_bytes,
    page_keys,
    storage_config,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.observability.metrics_collector import StorageMetrics

from kvtier.errors import BufferError, ConfigError, LayoutError
from kvtier.integrations.sglang import KvtierHiCacheStorage
from kvtier.remote import RemotePool
from kvtier.testing.redis import LocalRedis

DRAM = {"dram": {"capacity_bytes": "4MiB"}}


def ssd(directory: Path) -> dict[str, Any]:
    # Pages written through to SSD as they are stored, and read back from there by a fresh store.
    return {
        **DRAM,
        "ssd": {
            "directory": str(directory),
            "capacity_bytes": "4MiB",
            "probe_bytes": 0,
            "write_through": True,
        },
    }


def remote(server: LocalRedis) -> dict[str, Any]:
    return {
        **DRAM,
        "remote": {"urls": [server.url], "connect_timeout_s": 0.5, "io_timeout_s": 2.0},
    }


def tier_extra(tier: str, tmp_path: Path, redis: LocalRedis) -> dict[str, Any]:
    return {"dram": DRAM, "ssd": ssd(tmp_path), "redis": remote(redis)}[tier]


def reader_for(tier: str, writer: Any, pool: Any, extra: dict[str, Any], model: str) -> Any:
    """The backend that reads back: the writer itself for DRAM; for SSD and Redis a fresh backend
    (empty DRAM), so every page comes from that tier."""
    if tier == "dram":
        return writer
    writer.close()  # SSD: the pool has one owner at a time; the index log is replayed on open
    return backend(pool, extra, model=model)


def test_the_dynamic_factory_builds_it_from_sglang_flags() -> None:
    pool = host_pool()
    made = StorageBackendFactory.create_backend("dynamic", storage_config(DRAM), pool)
    assert isinstance(made, KvtierHiCacheStorage) and isinstance(made, HiCacheStorage)
    made.register_mem_pool_host(pool)
    assert made.store.config.dram.capacity_bytes == 4 * 2**20
    assert made.store.config.dram.prefault is True  # a serving process commits its DRAM tier
    assert made.store.config.model_id == "sglang|org/test-model|tp=1|layout=mha-page_first-bfloat16"


@pytest.mark.parametrize("tier", ["dram", "ssd", "redis"])
@pytest.mark.parametrize(("kind", "layout"), POOLS)
def test_zero_copy_round_trip(kind: str, layout: str, tier: str, tmp_path: Path, redis: LocalRedis) -> None:
    pool = host_pool(kind, layout)
    extra = tier_extra(tier, tmp_path, redis)
    model = f"v1-{kind}-{layout}-{tier}"
    writer = backend(pool, extra, model=model)
    slots = fill(pool, 6, seed=1)
    expected = [page_bytes(pool, slots, i) for i in range(6)]
    keys = page_keys("p", 6)
    assert writer.batch_set_v1(keys, slots) == [True] * 6
    reader = reader_for(tier, writer, pool, extra, model)
    assert reader.batch_exists([*keys, "absent"]) == 6
    into = pool.alloc(6 * pool.page_size)
    assert reader.batch_get_v1(keys, into) == [True] * 6
    assert [page_bytes(pool, into, i) for i in range(6)] == expected
    if tier != "dram":
        stats = reader.get_stats().kvtier
        assert stats["loaded_blocks"] == 6 and stats["put_blocks"] == 0  # nothing came from DRAM


@pytest.mark.parametrize("tier", ["dram", "ssd", "redis"])
@pytest.mark.parametrize(("kind", "layout"), [("mha", "layer_first"), ("mla", "page_first")])
def test_tensor_round_trip_and_both_interfaces_agree(
    kind: str, layout: str, tier: str, tmp_path: Path, redis: LocalRedis
) -> None:
    pool = host_pool(kind, layout)
    extra = tier_extra(tier, tmp_path, redis)
    model = f"v0-{kind}-{layout}-{tier}"
    writer = backend(pool, extra, model=model)
    slots = fill(pool, 4, seed=2)
    expected = [page_bytes(pool, slots, i) for i in range(4)]
    pages = [pool.get_data_page(int(slots[i * pool.page_size]), flat=True) for i in range(4)]
    assert writer.batch_set(page_keys("t", 4), pages)
    assert writer.set("single", pages[0])
    assert writer.batch_set_v1(page_keys("z", 4), slots) == [True] * 4
    reader = reader_for(tier, writer, pool, extra, model)
    got = reader.batch_get(page_keys("t", 4), [pool.get_dummy_flat_data_page() for _ in range(4)])
    assert [bytes(g.view(torch.uint8).numpy()) for g in got] == expected
    one = reader.get("single", pool.get_dummy_flat_data_page())
    assert one is not None and bytes(one.view(torch.uint8).numpy()) == expected[0]
    assert reader.exists("single") and not reader.exists("never-stored")
    # Set through one interface, get through the other: the same bytes.
    into = pool.alloc(4 * pool.page_size)
    assert reader.batch_get_v1(page_keys("t", 4), into) == [True] * 4
    assert [page_bytes(pool, into, i) for i in range(4)] == expected
    from_v1 = reader.batch_get(page_keys("z", 4))
    assert [bytes(g.view(torch.uint8).numpy()) for g in from_v1] == expected


def test_a_prefix_is_one_lookup_and_stops_at_the_first_missing_page() -> None:
    pool = host_pool()
    made = backend(pool, DRAM)
    slots = fill(pool, 8, seed=3)
    keys = page_keys("x", 8)
    assert made.batch_set_v1(keys[:3] + keys[4:], torch.cat([slots[:12], slots[16:]])) == [True] * 7
    before = made.get_stats().kvtier["lookups"]
    assert made.batch_exists(keys) == 3
    assert made.get_stats().kvtier["lookups"] == before + 1
    into = pool.alloc(8 * pool.page_size)
    assert made.batch_get_v1(keys, into) == [True] * 3 + [False] * 5
    assert made.batch_get(keys)[3:] == [None] * 5


def test_a_corrupt_page_in_dram_is_a_miss_never_wrong_bytes() -> None:
    pool = host_pool("mha", "page_first_direct")
    made = backend(pool, DRAM)
    slots = fill(pool, 5, seed=4)
    expected = [page_bytes(pool, slots, i) for i in range(5)]
    keys = page_keys("c", 5)
    made.batch_set_v1(keys, slots)
    assert made.store._corrupt_for_test(made.keys(keys)[2], 100)
    into = pool.alloc(5 * pool.page_size)
    done = made.batch_get_v1(keys, into)
    assert done[:2] == [True, True] and not done[2]
    for i, ok in enumerate(done):
        if ok:
            assert page_bytes(pool, into, i) == expected[i]
    assert made.get_stats().kvtier["checksum_failures"] == 1
    assert made.batch_exists(keys) == 2  # the corrupt copy was dropped
    assert made.batch_get(keys)[2] is None


def test_a_corrupt_page_on_the_server_is_a_miss_never_wrong_bytes(redis: LocalRedis) -> None:
    pool = host_pool()
    writer = backend(pool, remote(redis), model="corrupt-remote")
    slots = fill(pool, 4, seed=5)
    expected = [page_bytes(pool, slots, i) for i in range(4)]
    keys = page_keys("r", 4)
    writer.batch_set_v1(keys, slots)
    server = RemotePool(writer.store.config.remote, writer.store.namespace.hash)
    name = server.key_name(writer.keys(keys)[1])
    good = redis.command("GET", name)
    assert isinstance(good, bytes)
    assert redis.command("SET", name, good[:300] + bytes([good[300] ^ 0x01]) + good[301:]) == "OK"
    reader = backend(pool, remote(redis), model="corrupt-remote")
    into = pool.alloc(4 * pool.page_size)
    done = reader.batch_get_v1(keys, into)
    assert done[0] and not done[1]
    assert page_bytes(pool, into, 0) == expected[0]
    assert reader.get_stats().kvtier["checksum_failures"] == 1
    got = reader.batch_get(keys)
    assert got[1] is None and bytes(got[0].view(torch.uint8).numpy()) == expected[0]


def test_wrong_rank_model_or_layout_is_a_miss_and_mla_is_shared_by_ranks(redis: LocalRedis) -> None:
    pool = host_pool()
    keys = page_keys("n", 3)
    writer = backend(pool, remote(redis), model="shared", tp_rank=0, tp_size=2)
    writer.batch_set_v1(keys, fill(pool, 3, seed=6))
    assert backend(host_pool(), remote(redis), model="shared", tp_rank=0, tp_size=2).batch_exists(keys) == 3
    other_rank = backend(host_pool(), remote(redis), model="shared", tp_rank=1, tp_size=2)
    assert other_rank.batch_exists(keys) == 0
    assert other_rank.batch_get_v1(keys, other_rank.mem_pool_host.alloc(12)) == [False] * 3
    assert backend(host_pool(), remote(redis), model="other", tp_rank=0, tp_size=2).batch_exists(keys) == 0
    assert backend(host_pool(), remote(redis), model="shared", tp_rank=0, tp_size=1).batch_exists(keys) == 0
    layer_first = backend(
        host_pool("mha", "layer_first"), remote(redis), model="shared", tp_rank=0, tp_size=2
    )
    assert layer_first.batch_exists(keys) == 0
    # MLA: the latent KV is the same on every rank, so rank 1 reads what rank 0 wrote.
    mla = host_pool("mla", "page_first")
    slots = fill(mla, 3, seed=7)
    expected = [page_bytes(mla, slots, i) for i in range(3)]
    backend(mla, remote(redis), model="mla", tp_rank=0, tp_size=2).batch_set_v1(keys, slots)
    rank1_pool = host_pool("mla", "page_first")
    rank1 = backend(rank1_pool, remote(redis), model="mla", tp_rank=1, tp_size=2)
    into = rank1_pool.alloc(12)
    assert rank1.batch_get_v1(keys, into) == [True] * 3
    assert [page_bytes(rank1_pool, into, i) for i in range(3)] == expected


def test_mla_with_several_ranks_and_no_shared_tier_is_refused_at_start(tmp_path: Path) -> None:
    # SGLang writes MLA pages from rank 0 only; without a tier the ranks share, rank 1 would
    # miss every page, so the backend refuses the configuration when SGLang registers its pool.
    for extra in ({"dram": {"capacity_bytes": "1MiB"}}, ssd(tmp_path)):
        with pytest.raises(ConfigError, match=r"`remote\.urls`"):
            backend(host_pool("mla", "page_first"), extra, model="mla", tp_rank=1, tp_size=2)
    single = backend(host_pool("mla", "page_first"), ssd(tmp_path), model="mla", tp_rank=0, tp_size=1)
    assert single.batch_exists(page_keys("m", 1)) == 0


def test_ranks_get_their_own_ssd_subdirectory(tmp_path: Path) -> None:
    ranks = [backend(host_pool(), ssd(tmp_path), tp_rank=r, tp_size=2) for r in range(2)]
    assert [Path(b.store.config.ssd.directory).name for b in ranks if b.store.config.ssd] == [
        "tp0of2-pp0of1-cp0of1",
        "tp1of2-pp0of1-cp0of1",
    ]


def test_ranks_serve_metrics_on_their_own_ports(tmp_path: Path) -> None:
    # Each rank's process holds its own store, so each needs its own endpoint: port + process index.
    from kvtier.integrations.sglang.config import BackendSettings, Parallelism
    from kvtier.testing.redis import free_port

    for _ in range(5):  # the picked ports may be taken before the stores bind them
        port = free_port()
        try:
            ranks = [backend(host_pool(), {"metrics_port": port}, tp_rank=r, tp_size=2) for r in range(2)]
            break
        except ConfigError as e:
            if "cannot serve metrics" not in str(e):
                raise
    assert [b.store.config.metrics_port for b in ranks] == [port, port + 1]
    settings = BackendSettings.from_extra_config({"metrics_port": 9000})
    pp = Parallelism(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2)
    assert pp.process_index == 3
    assert settings.store_config(ranks[0].pages.geometry, "m", pp, "tag").metrics_port == 9003


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"dram_capacity": 1}, "dram_capacity"),
        ({"dram": {"capacity_bytes": "lots"}}, r"dram\.capacity_bytes"),
        ({"geometry": "llama-3-8b"}, "`geometry`; SGLang decides it"),
        ({"rank": 1}, "`rank`"),
        ({"eviction": "mru"}, "eviction"),
        ({"model_id": ""}, "model_id"),
        ({"config_file": 3}, "config_file"),
        ({"config_file": "/nonexistent/kvtier.yaml"}, "cannot read kvtier config_file"),
    ],
)
def test_bad_config_is_a_config_error_naming_the_key_at_construction(
    extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra), None)


def test_config_from_a_yaml_file_with_inline_overrides(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_text("store:\n  dram:\n    capacity_bytes: 2MiB\n  eviction: s3fifo\n")
    made = backend(host_pool(), {"config_file": str(path), "eviction": "lru"})
    assert made.store.config.dram.capacity_bytes == 2 * 2**20 and made.store.config.eviction == "lru"
    bad = tmp_path / "bad.yaml"
    bad.write_text("geometry: llama-3-8b\n")
    with pytest.raises(ConfigError, match="sets `geometry`"):
        backend(host_pool(), {"config_file": str(bad)})
    with pytest.raises(ConfigError, match="no model name"):
        backend(host_pool(), DRAM, model=None)


def test_inputs_are_checked_before_they_reach_the_store() -> None:
    pool = host_pool()
    made = backend(pool, DRAM)
    slots = fill(pool, 2, seed=8)
    keys = page_keys("i", 2)
    with pytest.raises(LayoutError, match="expected \\(8,\\)"):
        made.batch_set_v1(keys, slots[:7])
    with pytest.raises(LayoutError, match="integer slots"):
        made.batch_set_v1(keys, slots.float())
    with pytest.raises(LayoutError, match="whole, aligned pages"):
        made.batch_get_v1(keys, slots + 1)
    with pytest.raises(LayoutError, match="past the pool"):
        made.batch_get_v1(keys, slots + pool.size)
    page = pool.get_data_page(int(slots[0]), flat=True)
    with pytest.raises(BufferError, match="expected one page"):
        made.set("k", page.float())
    with pytest.raises(BufferError, match="expected one page"):
        made.set("k", page[:-1].clone())
    with pytest.raises(BufferError, match="contiguous"):
        made.set("k", torch.stack([page, page], 1)[:, 0])
    with pytest.raises(LayoutError, match="page hash string"):
        made.batch_exists(["ok", 3])
    assert made.get_stats().kvtier["put_blocks"] == 0  # nothing reached the store


def test_a_quant_codec_is_taken_at_construction_and_checked_against_the_pools_dtype(tmp_path: Path) -> None:
    # The construction-time check used to run on a bf16 stand-in geometry, so any `quant` config
    # was refused before SGLang's pool (fp16 or not) was known.
    extra = {**DRAM, "ssd": {"directory": str(tmp_path), "capacity_bytes": "4MiB", "codec": "quant"}}
    made = StorageBackendFactory.create_backend("dynamic", storage_config(extra), None)
    with pytest.raises(ConfigError, match=r"ssd\.codec.*fp16"):
        made.register_mem_pool_host(host_pool(dtype=torch.bfloat16))
    fp16 = host_pool(dtype=torch.float16, layers=24)  # enough 16-bin layers to halve the bytes
    made.register_mem_pool_host(fp16)
    assert made.store.config.ssd is not None and made.store.config.ssd.codec == "quant"


def test_a_pool_kvtier_cannot_read_is_refused_at_register() -> None:
    pool = host_pool()
    made = StorageBackendFactory.create_backend("dynamic", storage_config(DRAM), pool)
    pool.layout = "page_unified"
    with pytest.raises(LayoutError, match="page_unified"):
        made.register_mem_pool_host(pool)


def test_get_stats_is_sglang_storage_metrics_with_kvtier_counters() -> None:
    pool = host_pool()
    made = backend(pool, DRAM, metrics=True)
    slots = fill(pool, 3, seed=9)
    made.batch_set_v1(page_keys("s", 3), slots)
    made.batch_get_v1(page_keys("s", 3), pool.alloc(12))
    stats = made.get_stats()
    assert isinstance(stats, StorageMetrics)
    assert stats.backup_pgs == [3] and stats.prefetch_pgs == [3]
    assert stats.kvtier["put_blocks"] == 3 and stats.kvtier["loaded_blocks"] == 3
    assert list(stats.kvtier) == list(made.store.stats().as_dict())  # every StoreStats field, in order
    assert made.get_stats().backup_pgs == []  # SGLang's lists are per interval


def test_a_page_that_fails_in_the_call_is_a_miss_with_every_page_after_it_in_v0() -> None:
    # batch_exists counts the corrupt page (a lookup does not read payloads); the tensor call
    # that then reads it answers None from there on, never a target it did not fill.
    pool = host_pool()
    made = backend(pool, DRAM)
    slots = fill(pool, 4, seed=12)
    expected = [page_bytes(pool, slots, i) for i in range(4)]
    keys = page_keys("v0c", 4)
    made.batch_set_v1(keys, slots)
    assert made.store._corrupt_for_test(made.keys(keys)[1], 50)
    assert made.batch_exists(keys) == 4
    got = made.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in range(4)])
    assert got[1:] == [None, None, None]
    assert got[0] is not None and bytes(got[0].view(torch.uint8).numpy()) == expected[0]
    assert made.get_stats().kvtier["checksum_failures"] == 1
    assert made.batch_exists(keys) == 1  # the corrupt copy was dropped


def test_clear_drops_every_page_for_every_rank_and_only_this_namespace(redis: LocalRedis) -> None:
    # clear() is Store.clear(): the namespace's pages leave DRAM and the shared Redis, so a rank
    # sharing them (MLA: rank 0 writes, the others read through Redis) finds none either, through
    # either interface; another model's pages on the same server stay; pages stored afterwards
    # (the new weights' KV) are found by every rank.
    pool = host_pool("mla", "page_first")
    writer = backend(pool, remote(redis), model="gen", tp_rank=0, tp_size=2)
    reader_pool = host_pool("mla", "page_first")
    reader = backend(reader_pool, remote(redis), model="gen", tp_rank=1, tp_size=2)
    other_pool = host_pool("mla", "page_first")
    other = backend(other_pool, remote(redis), model="other")
    keys = page_keys("g", 3)
    assert writer.batch_set_v1(keys, fill(pool, 3, seed=13)) == [True] * 3
    assert other.batch_set_v1(keys, fill(other_pool, 3, seed=15)) == [True] * 3
    assert reader.batch_exists(keys) == 3
    writer.clear()
    assert writer.batch_exists(keys) == 0 and not writer.exists(keys[0])
    assert reader.batch_exists(keys) == 0
    assert writer.batch_get(keys) == [None] * 3
    assert writer.batch_get_v1(keys, pool.alloc(12)) == [False] * 3
    assert other.batch_exists(keys) == 3
    slots = fill(pool, 3, seed=14)
    expected = [page_bytes(pool, slots, i) for i in range(3)]
    assert writer.batch_set_v1(keys, slots) == [True] * 3
    into = reader_pool.alloc(12)
    assert reader.batch_get_v1(keys, into) == [True] * 3
    assert [page_bytes(reader_pool, into, i) for i in range(3)] == expected
