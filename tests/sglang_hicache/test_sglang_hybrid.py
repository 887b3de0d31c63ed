"""kvtier's v2 calls for a hybrid model's host pools (SWA KV, Mamba state, draft KV beside the KV
pool), against SGLang's own host pool classes: every pool's pages round trip exactly on DRAM, SSD
and Redis, a prefix is restorable only where every pool holds what it needs, a missing or corrupt
page of any pool is a miss, pools never read each other's pages, and a pool kvtier cannot store
is refused and misses. docs/sglang.md "Hybrid models"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hicache_helpers import fill, host_pool, hybrid_backend, hybrid_pools, page_bytes, page_keys
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

from kvtier.errors import LayoutError
from kvtier.integrations.sglang.hybrid import PoolPresence, hit_verdict
from kvtier.remote import RemotePool
from kvtier.testing.redis import LocalRedis

KV, SWA, MAMBA, DRAFT = PoolName.KV, PoolName.SWA, PoolName.MAMBA, PoolName.DRAFT
ALL, TRAILING = PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES
DRAM = {"dram": {"capacity_bytes": "1MiB"}}


def tier_extra(tier: str, tmp_path: Path, redis: LocalRedis) -> dict[str, Any]:
    if tier == "ssd":
        ssd = {"directory": str(tmp_path), "capacity_bytes": "4MiB", "probe_bytes": 0, "write_through": True}
        return {**DRAM, "ssd": ssd}
    if tier == "redis":
        return {**DRAM, "remote": {"urls": [redis.url], "connect_timeout_s": 0.5, "io_timeout_s": 2.0}}
    return DRAM


def xfer(
    name: PoolName, keys: list[str], slots: Any = None, policy: PoolHitPolicy = TRAILING
) -> PoolTransfer:
    return PoolTransfer(name=name, keys=keys, host_indices=slots, hit_policy=policy)


def query(
    made: Any, keys: list[str], window: int = 2, **more: PoolHitPolicy
) -> tuple[int, dict[str, int], list[int]]:
    """SGLang's hit query of a hybrid model: the Mamba state (one page) and an SWA window, plus
    ``more`` pools by name and policy; (hit pages, each pool's own, every restorable length)."""
    transfers = [xfer(MAMBA, ["__placeholder__"]), xfer(SWA, ["__placeholder__"] * window)]
    transfers += [xfer(PoolName(name), ["__placeholder__"], policy=p) for name, p in more.items()]
    r = made.batch_exists_v2(keys, transfers)
    hits = {str(getattr(k, "value", k)): v for k, v in r.extra_pool_hit_pages.items()}
    return r.kv_hit_pages, hits, list(r.restorable_prefix_pages)


def store(made: Any, pools: dict[PoolName, Any], keys: list[str], seed: int) -> dict[tuple[str, str], bytes]:
    """The 6 KV pages of ``keys``, states taken at pages 3 and 6 and the SWA window (2 pages)
    ending at page 6, as SGLang's backups store them; returns every stored page's bytes."""
    kv, swa, states = fill(pools[KV], 6, seed), fill(pools[SWA], 2, seed + 1), fill(pools[MAMBA], 2, seed + 2)
    assert made.batch_set_v1(keys, kv) == [True] * 6
    done = made.batch_set_v2([xfer(SWA, keys[4:6], swa), xfer(MAMBA, [keys[2], keys[5]], states)])
    assert done == {SWA: [True, True], MAMBA: [True, True]}
    expected = {("kv", k): page_bytes(pools[KV], kv, j) for j, k in enumerate(keys)}
    expected |= {("swa", keys[4 + j]): page_bytes(pools[SWA], swa, j) for j in range(2)}
    expected |= {("mamba", k): page_bytes(pools[MAMBA], states, j) for j, k in enumerate([keys[2], keys[5]])}
    for pool, slots in ((KV, kv), (SWA, swa), (MAMBA, states)):
        pools[pool].free(slots)
    return expected


def load(made: Any, pools: dict[PoolName, Any], name: PoolName, keys: list[str]) -> list[bytes | None]:
    """``keys`` of pool ``name`` loaded into fresh pages (v1 for KV, v2 otherwise): bytes, or None."""
    pool = pools[name]
    slots = pool.alloc(len(keys) * pool.page_size)
    ok = made.batch_get_v1(keys, slots) if name == KV else made.batch_get_v2([xfer(name, keys, slots)])[name]
    out = [page_bytes(pool, slots, j) if done else None for j, done in enumerate(ok)]
    pool.free(slots)
    return out


@pytest.mark.parametrize(
    ("kv_pages", "pools", "restorable", "hits"),
    [
        (6, [("m", TRAILING, 1, "..T..T")], [3, 6], {"kv": 6, "m": 6}),
        (6, [("s", TRAILING, 2, ".TT.TT")], [3, 6], {"kv": 6, "s": 6}),
        (6, [("s", TRAILING, 2, "TT.T.T")], [1, 2], {"kv": 6, "s": 2}),  # a window at the start is short
        (6, [("m", TRAILING, 1, "..T..T"), ("s", TRAILING, 2, "....TT")], [6], {"kv": 6, "m": 6, "s": 6}),
        (6, [("i", ALL, 1, "TTT.TT"), ("m", TRAILING, 1, "..T..T")], [3], {"kv": 6, "i": 3, "m": 6}),
        (4, [("m", TRAILING, 1, "...")], [], {"kv": 4}),
        (0, [("m", TRAILING, 1, "")], [], {}),
    ],
)
def test_restorable_prefixes_follow_each_pools_hit_policy(
    kv_pages: int,
    pools: list[tuple[str, PoolHitPolicy, int, str]],
    restorable: list[int],
    hits: dict[str, int],
) -> None:
    presence = [
        PoolPresence(name, policy.value, window, tuple(c == "T" for c in flags.ljust(kv_pages, ".")))
        for name, policy, window, flags in pools
    ]
    verdict = hit_verdict(kv_pages, presence)
    assert list(verdict.restorable) == restorable
    assert verdict.hit_pages == (restorable[-1] if restorable else 0)
    assert verdict.pool_hit_pages == hits
    with pytest.raises(LayoutError, match="block_groups"):
        hit_verdict(2, [PoolPresence("c", "block_groups", 1, (True, True))])


@pytest.mark.parametrize("tier", ["dram", "ssd", "redis"])
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_every_pool_round_trips_exact_bytes(kind: str, tier: str, tmp_path: Path, redis: LocalRedis) -> None:
    extra = tier_extra(tier, tmp_path, redis)
    pools = hybrid_pools(kind)
    writer = hybrid_backend(pools, extra, model=f"hy-{kind}-{tier}")
    keys = page_keys(f"rt-{kind}", 6)
    expected = store(writer, pools, keys, seed=1)
    if tier != "dram":  # a fresh backend over fresh pools: every page from SSD or Redis
        writer.close()
        pools = hybrid_pools(kind)
    reader = writer if tier == "dram" else hybrid_backend(pools, extra, model=f"hy-{kind}-{tier}")
    assert query(reader, [*keys, "absent"]) == (6, {"kv": 6, "mamba": 6, "swa": 6}, [6])
    assert load(reader, pools, KV, keys) == [expected["kv", k] for k in keys]
    assert load(reader, pools, SWA, keys[4:]) == [expected["swa", k] for k in keys[4:]]
    for k in (keys[2], keys[5]):
        assert load(reader, pools, MAMBA, [k]) == [expected["mamba", k]]
    stats = reader.get_stats()
    if tier != "dram":
        assert (
            stats.kvtier_pools["mamba"]["loaded_blocks"] == 2
            and stats.kvtier_pools["swa"]["loaded_blocks"] == 2
        )
        assert stats.kvtier_pools["mamba"]["put_blocks"] == 0 and stats.kvtier["put_blocks"] == 0


def test_a_prefix_is_restorable_only_where_every_pool_holds_its_pages() -> None:
    pools = {**hybrid_pools(), DRAFT: host_pool(ratio=8.0)}  # DRAFT: a KV-derived pool, every page
    made = hybrid_backend(pools, DRAM, model="hy-prefix")
    keys = page_keys("pre", 6)
    store(made, pools, keys, seed=2)
    assert query(made, keys) == (6, {"kv": 6, "mamba": 6, "swa": 6}, [6])
    # Five pages: the KV is there, but no state was taken at page 5, and the SWA window ending
    # there (pages 4, 5) lacks page 4: nothing is restorable.
    assert query(made, keys[:5]) == (0, {"kv": 5, "mamba": 3}, [])
    # With a 1-page window and page 3's SWA page stored, page 3's state and window make 3 pages
    # restorable; the window alone would make 5 (page 5's SWA page is there, its state is not).
    swa3 = fill(pools[SWA], 1, seed=3)
    assert made.batch_set_v2([xfer(SWA, keys[2:3], swa3)]) == {SWA: [True]}
    assert query(made, keys[:5], window=1) == (3, {"kv": 5, "mamba": 3, "swa": 5}, [3])
    # A pool needed for every page (policy all_pages) ends the prefix at its first missing page.
    draft = fill(pools[DRAFT], 4, seed=4)
    assert made.batch_set_v2([xfer(DRAFT, keys[:4], draft, ALL)]) == {DRAFT: [True] * 4}
    assert query(made, keys, window=1, draft=ALL) == (3, {"kv": 6, "mamba": 6, "swa": 6, "draft": 4}, [3])
    # KV missing from page 2 on: nothing of the other pools counts past it.
    assert query(made, [*keys[:2], "gap", *keys[3:]]) == (0, {"kv": 2}, [])


@pytest.mark.parametrize("pool", [SWA, MAMBA])
@pytest.mark.parametrize("tier", ["dram", "redis"])
def test_a_corrupt_page_of_any_pool_is_a_miss_never_wrong_bytes(
    pool: PoolName, tier: str, redis: LocalRedis
) -> None:
    pools = hybrid_pools()
    extra = tier_extra(tier, Path(), redis)
    writer = hybrid_backend(pools, extra, model=f"hy-bad-{pool.value}-{tier}")
    keys = page_keys(f"bad-{pool.value}-{tier}", 6)
    expected = store(writer, pools, keys, seed=5)
    made = writer.pools[pool.value]
    key = made.keys([keys[5]])[0]
    if tier == "dram":
        assert made.store._corrupt_for_test(key, 40)
        reader = writer
    else:  # flip one payload bit on the server; a fresh backend reads it from there
        server = RemotePool(made.store.config.remote, made.store.namespace.hash)
        good = redis.command("GET", server.key_name(key))
        assert isinstance(good, bytes)
        assert (
            redis.command("SET", server.key_name(key), good[:200] + bytes([good[200] ^ 1]) + good[201:])
            == "OK"
        )
        pools = hybrid_pools()
        reader = hybrid_backend(pools, extra, model=f"hy-bad-{pool.value}-{tier}")
    assert query(reader, keys)[0] == 6  # a hit query reads no payload
    # SWA: the window's first page loads, the corrupt one is never reported loaded.
    want = [expected["swa", keys[4]], None] if pool == SWA else [None]
    assert load(reader, pools, pool, keys[4:] if pool == SWA else keys[5:]) == want
    assert reader.get_stats().kvtier_pools[pool.value]["checksum_failures"] == 1
    made = reader.pools[pool.value]
    assert made.store.lookup_each(made.keys([keys[5]])) == (None,)  # the corrupt copy was dropped
    others = {"mamba": 6} if pool == SWA else {"mamba": 3, "swa": 6}
    assert query(reader, keys) == (0, {"kv": 6, **others}, [])
    assert load(reader, pools, MAMBA, [keys[2]]) == [expected["mamba", keys[2]]]


def test_pools_never_read_each_others_pages() -> None:
    # SWA and draft pools shaped exactly like the KV pool: the same page hash string names three
    # pages of three pools, each its own bytes, and one pool's page is never another's hit.
    pools = {KV: host_pool(ratio=8.0), SWA: host_pool(ratio=8.0), DRAFT: host_pool(ratio=8.0)}
    made = hybrid_backend(pools, DRAM, model="hy-apart")
    keys = page_keys("same", 2)
    slots = {name: fill(pool, 2, seed=10 + i) for i, (name, pool) in enumerate(pools.items())}
    assert made.batch_set_v1(keys, slots[KV]) == [True, True]
    assert made.batch_set_v2([xfer(SWA, keys[:1], slots[SWA][:4])]) == {SWA: [True]}
    assert made.batch_set_v2([xfer(DRAFT, keys, slots[DRAFT], ALL)]) == {DRAFT: [True, True]}
    for name, pool in pools.items():
        stored = 1 if name == SWA else 2
        want = [page_bytes(pool, slots[name], j) for j in range(stored)]
        assert load(made, pools, name, keys)[:stored] == want, name
    assert load(made, pools, SWA, keys[1:]) == [None]  # stored for KV and DRAFT only
    # Two pages need the SWA window of pages 0 and 1; page 1 is KV's and DRAFT's only.
    r = made.batch_exists_v2(keys, [xfer(SWA, ["__placeholder__"] * 2)])
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (1, [1])
    model_ids = {name: p.store.config.model_id for name, p in made.pools.items()}
    assert model_ids["kv"].endswith("layout=mha-page_first-bfloat16")
    assert (
        model_ids["swa"] == model_ids["kv"] + "|pool=swa"
        and model_ids["draft"] == model_ids["kv"] + "|pool=draft"
    )
