"""``kvtier bench store``: DRAM-tier put/get of 2 MiB objects against one contiguous memcpy of the
same bytes; the same blocks into a paged pool with one copy (``load_into_pool``, called directly and
as a ``TransferEngine`` paged job) and with two (load, then scatter), and back out of it
(``put_from_pool``); and hash + lookup of a 128K-token prompt whose blocks are all present.

The pool holds twice the blocks the bench moves. The pool rows run twice: with an ordered block
table (the first ``n`` blocks, reversed: the ``pool_*`` keys) and with a random one (a seeded
choice of ``n`` of the ``2n`` blocks in random order, what an engine's pool hands out after a while:
the ``*_random_*`` keys)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.bench.timing import best_seconds, gib_per_s, memcpy_seconds, touched
from kvtier.config import DramConfig, StoreConfig
from kvtier.errors import KvtierError
from kvtier.geometry import Geometry
from kvtier.layout import PagedPool, gather, scatter
from kvtier.progress import progress
from kvtier.results import Result
from kvtier.store import Store
from kvtier.transfer import TransferConfig, TransferEngine


@dataclass(frozen=True)
class StoreBench(Result):
    """What ``kvtier bench store`` reports (GiB/s and ms are best of ``repeats``)."""

    object_bytes: int
    objects: int
    bytes: int
    copy_threads: int
    repeats: int
    memcpy_gib_per_s: float
    put_gib_per_s: float
    get_gib_per_s: float
    put_ratio_to_memcpy: float
    get_ratio_to_memcpy: float
    put_vs_memcpy: float
    load_vs_memcpy: float
    pool_load_gib_per_s: float
    pool_load_ratio_to_get: float
    engine_pool_load_gib_per_s: float
    engine_pool_load_ratio_to_get: float
    load_then_scatter_gib_per_s: float
    pool_put_gib_per_s: float
    pool_put_ratio_to_put: float
    pool_load_random_gib_per_s: float
    pool_load_random_ratio_to_get: float
    engine_pool_load_random_gib_per_s: float
    engine_pool_load_random_ratio_to_get: float
    pool_put_random_gib_per_s: float
    pool_put_random_ratio_to_put: float
    lookup_tokens: int
    lookup_128k_tokens_ms: float
    lookup_hash_ms: float
    lookup_index_ms: float
    lookup_hash_from_list_ms: float
    evictions: int
    checksum_failures: int
    bench: str = "store"


def run(
    total_bytes: int = 2**30,
    repeats: int = 5,
    lookup_tokens: int = 131072,
    threads: int = 0,
    show: bool = True,
) -> StoreBench:
    geometry = Geometry.llama3_8b()  # 16-token blocks of 2 MiB
    n = total_bytes // geometry.block_bytes
    if n < 1:
        raise KvtierError(
            f"total_bytes is {total_bytes}; expected at least one {geometry.block_bytes}-byte object"
        )
    nbytes = n * geometry.block_bytes
    steps = iter(progress(range(4), 4, "bench store", enabled=show))
    next(steps)
    memcpy_s = memcpy_seconds(nbytes, repeats)

    next(steps)
    # Room for two full rounds of objects, so repeated puts run in the steady state with eviction.
    config = StoreConfig(
        geometry=geometry,
        model_id="bench",
        dram=DramConfig(capacity_bytes=int(2.2 * nbytes), prefault=True),
        copy_threads=threads,
    )
    store = Store(config)
    objects = touched(nbytes, 7).reshape(n, geometry.block_bytes)
    out = touched(nbytes, 0).reshape(n, geometry.block_bytes)
    rng = np.random.default_rng(0)

    def put_round() -> None:
        tokens = rng.integers(0, 128_000, n * geometry.block_tokens)
        keys = store.namespace.block_keys(tokens)
        t0 = time.perf_counter()
        report = store.put(keys, objects)
        timings.append(time.perf_counter() - t0)
        if report.stored != n:
            raise KvtierError(f"bench put stored {report.stored} of {n} objects: {report}")
        last_keys.append(keys)

    timings: list[float] = []
    last_keys: list[Any] = []
    for _ in range(repeats + 1):  # the first round faults the arena's pages in
        put_round()
    put_s = min(timings[1:])
    keys = last_keys[-1]

    next(steps)

    def load_all() -> None:
        with store.lease(keys) as lease:
            if lease.hit_blocks != n:
                raise KvtierError(f"bench lease hit {lease.hit_blocks} of {n} blocks")
            report = store.load(lease, out)
            if report.loaded_blocks != n:
                raise KvtierError(f"bench load loaded {report.loaded_blocks} of {n} blocks")

    get_s = best_seconds(load_all, repeats)
    if not np.array_equal(out[n - 1], objects[n - 1]):
        raise KvtierError("bench load returned wrong bytes")

    # The paged-pool path: the same leased blocks into a LayerFirst pool of 2n blocks, one copy
    # (load_into_pool) against two (load into objects, then layout.scatter); then back out of it.
    pool = touched(geometry.pool_bytes(2 * n), 1)
    paged = PagedPool.layer_first(geometry, pool)
    staging = out  # free again: the load's bytes were checked above
    engine = TransferEngine(store, TransferConfig(chunk_blocks=1, buffer_chunks=1))
    ordered = np.arange(n)[::-1].copy()
    random_table = np.random.default_rng(5).permutation(2 * n)[:n]
    tables = {"ordered": ordered, "random": random_table}
    loads = {
        name: _pool_loads(store, engine, keys, objects, pool, paged, ids, repeats)
        for name, ids in tables.items()
    }

    def load_then_scatter() -> None:
        with store.lease(keys) as lease:
            store.load(lease, staging)
        scatter(geometry, staging, ordered, pool)

    scatter_s = best_seconds(load_then_scatter, repeats)
    # Puts last: each stores n new objects, evicting the leased ones.
    puts = {
        name: _pool_put(store, objects, out, pool, paged, ids, rng, repeats) for name, ids in tables.items()
    }

    next(steps)
    hash_ms, lookup_ms, list_hash_ms = _lookup_128k(lookup_tokens, repeats)
    for _ in steps:
        pass
    stats = store.stats()
    return StoreBench(
        object_bytes=geometry.block_bytes,
        objects=n,
        bytes=nbytes,
        copy_threads=threads,
        repeats=repeats,
        memcpy_gib_per_s=gib_per_s(nbytes, memcpy_s),
        put_gib_per_s=gib_per_s(nbytes, put_s),
        get_gib_per_s=gib_per_s(nbytes, get_s),
        put_ratio_to_memcpy=memcpy_s / put_s,
        get_ratio_to_memcpy=memcpy_s / get_s,
        put_vs_memcpy=memcpy_s / put_s,  # issue 19's names for the two ratios above
        load_vs_memcpy=memcpy_s / get_s,
        pool_load_gib_per_s=gib_per_s(nbytes, loads["ordered"][0]),
        pool_load_ratio_to_get=get_s / loads["ordered"][0],
        engine_pool_load_gib_per_s=gib_per_s(nbytes, loads["ordered"][1]),
        engine_pool_load_ratio_to_get=get_s / loads["ordered"][1],
        load_then_scatter_gib_per_s=gib_per_s(nbytes, scatter_s),
        pool_put_gib_per_s=gib_per_s(nbytes, puts["ordered"]),
        pool_put_ratio_to_put=put_s / puts["ordered"],
        pool_load_random_gib_per_s=gib_per_s(nbytes, loads["random"][0]),
        pool_load_random_ratio_to_get=get_s / loads["random"][0],
        engine_pool_load_random_gib_per_s=gib_per_s(nbytes, loads["random"][1]),
        engine_pool_load_random_ratio_to_get=get_s / loads["random"][1],
        pool_put_random_gib_per_s=gib_per_s(nbytes, puts["random"]),
        pool_put_random_ratio_to_put=put_s / puts["random"],
        lookup_tokens=lookup_tokens,
        lookup_128k_tokens_ms=hash_ms + lookup_ms,
        lookup_hash_ms=hash_ms,
        lookup_index_ms=lookup_ms,
        lookup_hash_from_list_ms=list_hash_ms,
        evictions=stats.evictions,
        checksum_failures=stats.checksum_failures,
    )


def _pool_loads(
    store: Store,
    engine: TransferEngine,
    keys: Any,
    objects: npt.NDArray[np.uint8],
    pool: npt.NDArray[np.uint8],
    paged: PagedPool,
    block_ids: npt.NDArray[np.int64],
    repeats: int,
) -> tuple[float, float]:
    """Best seconds of ``load_into_pool`` and of the same load as a ``TransferEngine`` paged job
    (the vLLM connector's load) with block table ``block_ids``, each checked in the pool."""
    geometry = store.config.geometry
    n = len(block_ids)
    check = np.asarray([0, n // 2, n - 1])

    def loaded_right(what: str) -> None:
        if not np.array_equal(gather(geometry, pool, block_ids[check]), objects[check]):
            raise KvtierError(f"bench {what} returned wrong bytes")

    def load_into_pool() -> None:
        with store.lease(keys) as lease:
            report = store.load_into_pool(lease, paged, block_ids)
            if report.loaded_blocks != n:
                raise KvtierError(f"bench load_into_pool loaded {report.loaded_blocks} of {n} blocks")

    def engine_job() -> None:
        [job] = engine.wait(engine.submit_load(keys, paged, block_ids))
        if not job.ok:
            raise KvtierError(f"bench engine paged load failed: {job.failed[:3]}")

    pool[:] = 0
    load_s = best_seconds(load_into_pool, repeats)
    loaded_right("load_into_pool")
    pool[:] = 0
    engine_s = best_seconds(engine_job, repeats)
    loaded_right("engine paged load")
    return load_s, engine_s


def _pool_put(
    store: Store,
    objects: npt.NDArray[np.uint8],
    scratch: npt.NDArray[np.uint8],
    pool: npt.NDArray[np.uint8],
    paged: PagedPool,
    block_ids: npt.NDArray[np.int64],
    rng: np.random.Generator,
    repeats: int,
) -> float:
    """Best seconds of ``put_from_pool`` (the connector's save) of pool blocks ``block_ids``, set
    to ``objects`` first; the last put checked by loading every block back into ``scratch``."""
    geometry = store.config.geometry
    n = len(block_ids)
    scatter(geometry, objects, block_ids, pool)
    timings: list[float] = []
    for _ in range(repeats):
        keys = store.namespace.block_keys(rng.integers(0, 128_000, n * geometry.block_tokens))
        t0 = time.perf_counter()
        report = store.put_from_pool(keys, paged, block_ids)
        timings.append(time.perf_counter() - t0)
        if report.stored != n:
            raise KvtierError(f"bench put_from_pool stored {report.stored} of {n} objects: {report}")
    with store.lease(keys) as lease:
        if store.load(lease, scratch).loaded_blocks != n:
            raise KvtierError("bench put_from_pool: a stored block did not load back")
    if not np.array_equal(scratch, objects):
        raise KvtierError("bench put_from_pool stored wrong bytes")
    return min(timings)


def _lookup_128k(tokens: int, repeats: int) -> tuple[float, float, float]:
    """Hash + lookup of a ``tokens``-long prompt, all blocks present; and the hash of the same
    prompt given as a Python ``list`` (as engines hold token ids), in milliseconds.

    Lookup cost does not depend on block size, so this store uses a small geometry (4 KiB blocks)
    to hold 8192 blocks in 32 MiB instead of 16 GiB.
    """
    geometry = Geometry(1, 1, 64, "fp16", 16)
    n = tokens // geometry.block_tokens
    store = Store(
        StoreConfig(
            geometry=geometry,
            model_id="bench-lookup",
            dram=DramConfig(capacity_bytes=n * 3 * geometry.block_bytes),
        )
    )
    prompt = np.random.default_rng(1).integers(0, 128_000, tokens)
    keys = store.namespace.block_keys(prompt)
    store.put(keys, np.zeros((n, geometry.block_bytes), dtype=np.uint8))
    hash_s = best_seconds(lambda: store.namespace.block_keys(prompt), repeats * 4)
    lookup_s = best_seconds(lambda: store.lookup(keys), repeats * 4)
    as_list = prompt.tolist()
    if store.namespace.block_keys(as_list) != keys:
        raise KvtierError("lookup bench: a list of the same tokens hashed to other keys")
    list_s = best_seconds(lambda: store.namespace.block_keys(as_list), repeats * 4)
    if store.lookup(keys).hit_blocks != n:
        raise KvtierError("lookup bench: not every block is present")
    return hash_s * 1e3, lookup_s * 1e3, list_s * 1e3


def summary(r: StoreBench) -> str:
    return "\n".join(
        [
            f"store bench: {r.objects} objects of {r.object_bytes / 2**20:.0f} MiB "
            f"({r.bytes / 2**30:.2f} GiB), DRAM tier",
            f"  memcpy (limit)  {r.memcpy_gib_per_s:7.2f} GiB/s",
            f"  put             {r.put_gib_per_s:7.2f} GiB/s  ratio to memcpy {r.put_ratio_to_memcpy:.2f}",
            f"  get             {r.get_gib_per_s:7.2f} GiB/s  ratio to memcpy {r.get_ratio_to_memcpy:.2f}",
            f"  into a pool     {r.pool_load_gib_per_s:7.2f} GiB/s  ratio to get {r.pool_load_ratio_to_get:.2f}"
            f"  (load + scatter: {r.load_then_scatter_gib_per_s:.2f} GiB/s)",
            f"  engine job      {r.engine_pool_load_gib_per_s:7.2f} GiB/s  ratio to get "
            f"{r.engine_pool_load_ratio_to_get:.2f}  (the same load as a TransferEngine paged job)",
            f"  put from a pool {r.pool_put_gib_per_s:7.2f} GiB/s  ratio to put {r.pool_put_ratio_to_put:.2f}",
            f"  random block table: into a pool {r.pool_load_random_gib_per_s:.2f} GiB/s (ratio to get "
            f"{r.pool_load_random_ratio_to_get:.2f}), engine job {r.engine_pool_load_random_gib_per_s:.2f} "
            f"GiB/s ({r.engine_pool_load_random_ratio_to_get:.2f}), put from a pool "
            f"{r.pool_put_random_gib_per_s:.2f} GiB/s (ratio to put {r.pool_put_random_ratio_to_put:.2f})",
            f"  lookup {r.lookup_tokens} tokens: {r.lookup_128k_tokens_ms:.3f} ms "
            f"(hash {r.lookup_hash_ms:.3f} ms + index {r.lookup_index_ms:.3f} ms; "
            f"hash from a list {r.lookup_hash_from_list_ms:.3f} ms)",
        ]
    )
