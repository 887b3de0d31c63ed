"""Store.load_into_pool: leased blocks straight into an engine pool (one copy from DRAM), layer
by layer, every block verified; against the two-copy path (load + layout.scatter) as reference."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import kvtier
from kvtier.errors import BufferError, LayoutError, LeaseError
from kvtier.layout import PagedPool, alloc_pool, gather, scatter
from kvtier.store import LayerProgress

# 3 layers, 2 heads, dim 16, fp16, 8-token blocks: 512-byte segments, 3 KiB blocks.
GEOMETRY = kvtier.Geometry(3, 2, 16, "fp16", 8)
HYBRID = kvtier.Geometry(2, 2, 16, "fp16", 8, extra_groups=(kvtier.ExtraGroup("ssm", 40),))


def store_for(geometry: kvtier.Geometry, blocks: int = 64, **kw: object) -> kvtier.Store:
    dram = kw.pop("dram", kvtier.DramConfig(capacity_bytes=blocks * 2 * (geometry.block_bytes + 4096)))
    return kvtier.Store(
        kvtier.StoreConfig(geometry=geometry, model_id="into-pool", dram=dram, **kw)  # type: ignore[arg-type]
    )


def random_pool(geometry: kvtier.Geometry, n: int, seed: int) -> np.ndarray:
    pool = alloc_pool(geometry, n)
    pool[:] = np.random.default_rng(seed).integers(0, 256, pool.size, dtype=np.uint8)
    return pool


def stored(store: kvtier.Store, n: int, seed: int = 0) -> tuple[kvtier.BlockKeys, np.ndarray]:
    """`n` blocks of random bytes put under the keys of one prompt."""
    g = store.config.geometry
    objects = np.random.default_rng(seed).integers(0, 256, (n, g.block_bytes), dtype=np.uint8)
    keys = store.namespace.block_keys(np.arange(n * g.block_tokens, dtype=np.uint32) + 1000 * seed)
    assert store.put(keys, objects).stored == n
    return keys, objects


@pytest.mark.parametrize("geometry", [GEOMETRY, HYBRID], ids=["plain", "hybrid"])
def test_layer_first_pool_gets_what_load_and_scatter_give(geometry: kvtier.Geometry) -> None:
    store = store_for(geometry)
    keys, objects = stored(store, 10)
    ids = np.array([7, 0, 12, 3, 19, 5, 1, 8, 15, 2])
    expected = random_pool(geometry, 20, 1)
    got = expected.copy()
    scatter(geometry, objects, ids, expected)
    progress = LayerProgress()
    with store.lease(keys) as lease:
        report = store.load_into_pool(lease, PagedPool.layer_first(geometry, got), ids, progress=progress)
    assert report == kvtier.store.PoolLoadReport(10, (), 0)
    assert np.array_equal(got, expected)  # blocks not in the table untouched, the rest exact
    assert progress.done_layers == geometry.num_layers
    assert np.array_equal(gather(geometry, got, ids), objects)


def test_per_layer_regions_like_vllm_tensors() -> None:
    """vLLM's shape: one array per layer (CPU) or two (CUDA), each its own allocation."""
    n, store = 12, store_for(GEOMETRY)
    keys, objects = stored(store, 5, seed=3)
    seg = GEOMETRY.segment_bytes
    cpu = [[np.zeros((n, 2 * seg), np.uint8)] for _ in range(3)]  # K and V interleaved per layer
    cuda = [[np.zeros((n, seg), np.uint8), np.zeros((n, seg), np.uint8)] for _ in range(3)]
    ids = [11, 4, 0, 9, 6]
    for layers in (cpu, cuda):
        with store.lease(keys) as lease:
            assert store.load_into_pool(lease, PagedPool(layers), ids).loaded_blocks == 5
        flat = [r for layer in layers for r in layer]
        for i, b in enumerate(ids):
            assert np.array_equal(np.concatenate([r[b] for r in flat]), objects[i])
        untouched = [b for b in range(n) if b not in ids]
        assert not any(r[untouched].any() for r in flat)


def test_part_of_a_lease_from_first() -> None:
    store = store_for(GEOMETRY)
    keys, objects = stored(store, 8)
    pool = alloc_pool(GEOMETRY, 8)
    with store.lease(keys) as lease:
        report = store.load_into_pool(lease, PagedPool.layer_first(GEOMETRY, pool), [2, 3, 4], first=5)
    assert report.loaded_blocks == 3
    assert np.array_equal(gather(GEOMETRY, pool, [2, 3, 4]), objects[5:8])


def test_a_corrupt_block_is_named_counted_once_and_the_rest_is_exact() -> None:
    store = store_for(GEOMETRY)
    keys, objects = stored(store, 6)
    assert store._corrupt_for_test(keys[3], 1234)
    pool = alloc_pool(GEOMETRY, 6)
    ids = [5, 4, 3, 2, 1, 0]
    with store.lease(keys) as lease:
        report = store.load_into_pool(lease, PagedPool.layer_first(GEOMETRY, pool), ids)
        assert report == kvtier.store.PoolLoadReport(3, (3,), 1)
        again = store.load_into_pool(lease, PagedPool.layer_first(GEOMETRY, pool), ids)
        assert again.failed == (3,) and again.loaded_blocks == 3  # the same copy fails again
    got = gather(GEOMETRY, pool, ids)
    for i in (0, 1, 2, 4, 5):
        assert np.array_equal(got[i], objects[i])
    assert store.stats().checksum_failures == 1  # counted once, by the load that found it
    assert store.lookup(keys).hit_blocks == 3  # dropped: no later lease hands it out
    store.check_integrity()


def test_blocks_from_ssd_and_dram_in_one_load(tmp_path: Path) -> None:
    """Blocks evicted to SSD are read, verified and scattered in the same layerwise pass."""
    store = store_for(
        GEOMETRY,
        dram=kvtier.DramConfig(capacity_bytes=4 * (GEOMETRY.block_bytes + 4096)),
        ssd=kvtier.SsdConfig(directory=str(tmp_path), capacity_bytes="8MiB", probe_bytes=0),
    )
    keys, objects = stored(store, 10)
    pool = alloc_pool(GEOMETRY, 16)
    ids = np.arange(10)[::-1] + 3
    progress = LayerProgress()
    with store.lease(keys) as lease:
        assert {"dram", "ssd"} <= set(lease.tiers), lease.tiers
        report = store.load_into_pool(lease, PagedPool.layer_first(GEOMETRY, pool), ids, progress=progress)
    assert report.loaded_blocks == 10 and report.failed == ()
    assert np.array_equal(gather(GEOMETRY, pool, ids), objects)
    assert progress.done_layers == GEOMETRY.num_layers
    del store
    gc.collect()


def test_each_announced_layer_is_already_final() -> None:
    """A waiter that copies layer l as soon as progress says so sees its final bytes: the
    progress never runs ahead of the copies (many blocks, so later layers are still moving)."""
    g = kvtier.Geometry(8, 8, 128, "fp16", 16)  # 32 KiB segments, 512 KiB blocks
    n = 48
    store = store_for(g, blocks=n)
    keys, objects = stored(store, n)
    pool = alloc_pool(g, n)
    pp = PagedPool.layer_first(g, pool)
    ids = np.arange(n)
    progress = LayerProgress()
    seen: list[np.ndarray] = []

    def watch() -> None:
        for layer in range(g.num_layers):
            assert progress.wait(layer, timeout_s=60)
            seen.append(np.concatenate([r.copy() for r in pp.regions[2 * layer : 2 * layer + 2]], axis=1))

    t = threading.Thread(target=watch)
    t.start()
    with store.lease(keys) as lease:
        assert store.load_into_pool(lease, pp, ids, progress=progress).loaded_blocks == n
    progress.close()
    t.join()
    assert len(seen) == g.num_layers
    seg = g.segment_bytes
    for layer, snapshot in enumerate(seen):
        assert np.array_equal(snapshot, objects[:, 2 * layer * seg : (2 * layer + 2) * seg]), layer


def test_progress_waits_time_out_and_close_releases_them() -> None:
    progress = LayerProgress()
    assert not progress.wait(0, timeout_s=0.01)
    done = threading.Event()

    def waiter() -> None:
        progress.wait(5)
        done.set()

    t = threading.Thread(target=waiter)
    t.start()
    assert not done.wait(0.05)
    progress.close()
    t.join(10)
    assert done.is_set() and progress.closed
    assert progress.wait(99)  # a closed progress never blocks


def test_a_progress_serves_one_load() -> None:
    """A LayerProgress only moves forward: given to a second load (or a closed one given to any
    load), its waits would return before that load's layers land, and attention would read the
    pool's stale bytes. Refused before any copy; a load refused for its own inputs leaves the
    progress to the next one."""
    store = store_for(GEOMETRY)
    keys_a, objects_a = stored(store, 2, seed=1)
    keys_b, _ = stored(store, 2, seed=2)
    pool = np.full(GEOMETRY.pool_bytes(4), 7, np.uint8)
    pp = PagedPool.layer_first(GEOMETRY, pool)
    progress = LayerProgress()
    with store.lease(keys_a) as lease:
        with pytest.raises(LayoutError, match="out of range"):
            store.load_into_pool(lease, pp, [0, 4], progress=progress)
        assert store.load_into_pool(lease, pp, [0, 1], progress=progress).loaded_blocks == 2
    assert progress.done_layers == GEOMETRY.num_layers
    closed = LayerProgress()
    closed.close()
    with store.lease(keys_b) as lease:
        for used in (progress, closed):
            with pytest.raises(BufferError, match=r"progress .*expected a fresh LayerProgress"):
                store.load_into_pool(lease, pp, [2, 3], progress=used)
    assert np.array_equal(gather(GEOMETRY, pool, [0, 1]), objects_a)
    assert (gather(GEOMETRY, pool, [2, 3]) == 7).all()


def test_bad_inputs_fail_before_any_copy() -> None:
    store = store_for(GEOMETRY)
    keys, _ = stored(store, 4)
    pool = np.full(GEOMETRY.pool_bytes(8), 7, np.uint8)
    pp = PagedPool.layer_first(GEOMETRY, pool)
    with store.lease(keys) as lease:
        with pytest.raises(LayoutError, match="appears twice"):
            store.load_into_pool(lease, pp, [1, 2, 1])
        with pytest.raises(LayoutError, match="out of range"):
            store.load_into_pool(lease, pp, [1, 8])
        with pytest.raises(LayoutError, match="negative"):
            store.load_into_pool(lease, pp, [-1])
        with pytest.raises(LeaseError, match="holds 4"):
            store.load_into_pool(lease, pp, [0, 1, 2], first=2)
        other = PagedPool.layer_first(HYBRID, alloc_pool(HYBRID, 8))
        with pytest.raises(BufferError, match="block_bytes"):
            store.load_into_pool(lease, other, [0])
        with pytest.raises(BufferError, match="PagedPool"):
            store.load_into_pool(lease, pool, [0])  # type: ignore[arg-type]
        assert (pool == 7).all()
    with pytest.raises(LeaseError, match="released"):
        store.load_into_pool(lease, pp, [0])


def test_bad_pools_are_refused_naming_the_region() -> None:
    seg = GEOMETRY.segment_bytes
    with pytest.raises(LayoutError, match="layer 1 region 0 has 5 blocks"):
        PagedPool([[np.zeros((4, seg), np.uint8)], [np.zeros((5, seg), np.uint8)]])
    with pytest.raises(BufferError, match="read-only"):
        ro = np.zeros((4, seg), np.uint8)
        ro.flags.writeable = False
        PagedPool([[ro]])
    with pytest.raises(BufferError, match="C-contiguous"):
        PagedPool([[np.zeros((4, 2 * seg), np.uint8)[:, ::2]]])
    with pytest.raises(LayoutError, match="no region"):
        PagedPool([[]])
    with pytest.raises(BufferError):
        PagedPool([[np.zeros((4, seg), dtype=object)]])
    shared = np.zeros((4, 2 * seg), np.uint8)
    store = store_for(GEOMETRY)
    keys, _ = stored(store, 1)
    overlapping = PagedPool([[np.zeros((4, 2 * seg), np.uint8)], [shared], [shared]])
    with store.lease(keys) as lease, pytest.raises(BufferError, match="share memory"):
        store.load_into_pool(lease, overlapping, [0])


def wrapping_layer_counts(pool: np.ndarray) -> PagedPool:
    """A pool whose layer counts add up to its number of regions only modulo 2**64."""
    pp = PagedPool.layer_first(GEOMETRY, pool)
    pp.layer_regions = [2**64 - 1, len(pp.regions) + 1]
    return pp


def test_layer_counts_that_wrap_around_are_refused_before_any_copy() -> None:
    """A pool crosses into Rust as whatever its attributes say: layer counts whose sum wraps past
    2**64 to the number of regions must be refused like any other bad count, not panic in the
    copy."""
    store = store_for(GEOMETRY)
    keys, _ = stored(store, 2)
    pool = np.full(GEOMETRY.pool_bytes(4), 7, np.uint8)
    pp = wrapping_layer_counts(pool)
    with store.lease(keys) as lease, pytest.raises(LayoutError, match="regions"):
        store.load_into_pool(lease, pp, [0, 1])
    with pytest.raises(LayoutError, match="regions"):
        store.put_from_pool(keys, pp, [0, 1])
    assert (pool == 7).all() and store.stats().put_blocks == 2


def test_an_engine_refuses_wrapping_layer_counts_at_submission() -> None:
    """Run in a child: a job submitted with such a pool panicked on the store worker, and the job,
    its waiters and the engine's drop hung (a regression fails here by the child's timeout)."""
    code = (
        "import os, numpy as np, pytest\n"
        "from kvtier.errors import LayoutError\n"
        "from kvtier.transfer import TransferEngine\n"
        "from test_load_into_pool import GEOMETRY, stored, store_for, wrapping_layer_counts\n"
        "store = store_for(GEOMETRY)\n"
        "keys, _ = stored(store, 2)\n"
        "pool = np.full(GEOMETRY.pool_bytes(4), 7, np.uint8)\n"
        "engine = TransferEngine(store)\n"
        "for submit in (engine.submit_load, engine.submit_store):\n"
        "    with pytest.raises(LayoutError, match='regions'):\n"
        "        submit(keys, wrapping_layer_counts(pool), [0, 1])\n"
        "assert engine.jobs() == 0 and (pool == 7).all()\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert child.returncode == 0, child.stderr[-2000:]


def test_pool_attributes_of_the_wrong_type_are_named() -> None:
    store = store_for(GEOMETRY)
    keys, _ = stored(store, 1)
    for name, value in [("layer_regions", [-1, 7]), ("num_blocks", 4.0), ("regions", "ab")]:
        pp = PagedPool.layer_first(GEOMETRY, alloc_pool(GEOMETRY, 4))
        setattr(pp, name, value)
        with store.lease(keys) as lease, pytest.raises(BufferError, match=f"pool `{name}`"):
            store.load_into_pool(lease, pp, [0])


@pytest.mark.parametrize("geometry", [GEOMETRY, HYBRID], ids=["plain", "hybrid"])
def test_put_from_pool_stores_what_gather_and_put_store(geometry: kvtier.Geometry) -> None:
    store = store_for(geometry)
    pool = random_pool(geometry, 16, 4)
    ids = np.array([9, 2, 2, 15, 0])  # ids may repeat
    keys = store.namespace.block_keys(np.arange(5 * geometry.block_tokens, dtype=np.uint32))
    report = store.put_from_pool(keys, PagedPool.layer_first(geometry, pool), ids)
    assert report == kvtier.PutReport(stored=5, already_present=0, rejected=0, evicted=0)
    assert store.put_from_pool(keys[:2], PagedPool.layer_first(geometry, pool), ids[:2]).already_present == 2
    out = np.zeros((5, geometry.block_bytes), np.uint8)
    with store.lease(keys) as lease:
        assert store.load(lease, out).loaded_blocks == 5  # checksums written on the way verify
    assert np.array_equal(out, gather(geometry, pool, ids))
    assert store.stats().put_blocks == 5
    store.check_integrity()


def test_put_from_per_layer_regions_and_eviction() -> None:
    n = 8
    seg = GEOMETRY.segment_bytes
    rng = np.random.default_rng(5)
    layers = [[rng.integers(0, 256, (n, 2 * seg), dtype=np.uint8)] for _ in range(3)]
    store = store_for(GEOMETRY, dram=kvtier.DramConfig(capacity_bytes=4 * 4096))  # 4 objects of one page each
    keys = store.namespace.block_keys(np.arange(n * GEOMETRY.block_tokens, dtype=np.uint32))
    assert store.put_from_pool(keys[:4], PagedPool(layers), np.arange(4)).stored == 4
    report = store.put_from_pool(keys[4:], PagedPool(layers), np.arange(4, 8))
    assert (report.stored, report.evicted) == (4, 4)
    out = np.zeros((4, GEOMETRY.block_bytes), np.uint8)
    with store.lease(keys[4:]) as lease:
        assert store.load(lease, out).loaded_blocks == 4
    for i, b in enumerate(range(4, 8)):
        assert np.array_equal(out[i], np.concatenate([layer[0][b] for layer in layers]))
    store.check_integrity()


def test_put_from_pool_with_an_ssd_tier_below(tmp_path: Path) -> None:
    store = store_for(
        GEOMETRY,
        dram=kvtier.DramConfig(capacity_bytes=4 * (GEOMETRY.block_bytes + 4096)),
        ssd=kvtier.SsdConfig(directory=str(tmp_path), capacity_bytes="8MiB", probe_bytes=0),
    )
    pool = random_pool(GEOMETRY, 12, 6)
    keys = store.namespace.block_keys(np.arange(12 * GEOMETRY.block_tokens, dtype=np.uint32))
    assert store.put_from_pool(keys, PagedPool.layer_first(GEOMETRY, pool), np.arange(12)).stored == 12
    back = alloc_pool(GEOMETRY, 12)
    with store.lease(keys) as lease:
        assert lease.hit_blocks == 12 and "ssd" in lease.tiers
        assert store.load_into_pool(lease, PagedPool.layer_first(GEOMETRY, back), np.arange(12)).failed == ()
    assert np.array_equal(back, pool)
    del store
    gc.collect()


def test_reused_staging_never_leaks_an_earlier_loads_bytes(tmp_path: Path) -> None:
    """Lower-tier loads stage through buffers the store keeps between calls. A second load whose
    block fails verification must leave that pool block as it was, not fill it with the bytes the
    first load left in the buffer; every other block is exact."""
    store = store_for(
        GEOMETRY,
        dram=kvtier.DramConfig(capacity_bytes=1 * (GEOMETRY.block_bytes + 4096)),
        ssd=kvtier.SsdConfig(
            directory=str(tmp_path),
            capacity_bytes="8MiB",
            probe_bytes=0,
            write_through=True,
            promote_on_hit=False,
        ),
    )
    keys_a, objects_a = stored(store, 6, seed=1)
    keys_b, objects_b = stored(store, 6, seed=2)
    ids = np.arange(6)
    pool = alloc_pool(GEOMETRY, 6)
    with store.lease(keys_a) as lease:
        assert "dram" not in lease.tiers[:5], lease.tiers
        assert store.load_into_pool(lease, PagedPool.layer_first(GEOMETRY, pool), ids).failed == ()
    assert np.array_equal(gather(GEOMETRY, pool, ids), objects_a)
    assert store._corrupt_for_test(keys_b[2], 100)
    sentinel = np.full(GEOMETRY.block_bytes, 0x5A, dtype=np.uint8)
    scatter(GEOMETRY, sentinel[None, :], np.array([2]), pool)
    with store.lease(keys_b) as lease:
        report = store.load_into_pool(lease, PagedPool.layer_first(GEOMETRY, pool), ids)
    assert report.failed == (2,) and report.loaded_blocks == 2 and report.checksum_failures == 1
    got = gather(GEOMETRY, pool, ids)
    assert np.array_equal(got[2], sentinel), "a failed block's pool bytes changed"
    for i in (0, 1, 3, 4, 5):
        assert np.array_equal(got[i], objects_b[i])
    del store
    gc.collect()


def test_put_from_pool_refuses_bad_tables() -> None:
    store = store_for(GEOMETRY)
    pp = PagedPool.layer_first(GEOMETRY, alloc_pool(GEOMETRY, 4))
    keys = store.namespace.block_keys(np.arange(2 * GEOMETRY.block_tokens, dtype=np.uint32))
    with pytest.raises(LayoutError, match="out of range"):
        store.put_from_pool(keys, pp, [0, 4])
    with pytest.raises(BufferError, match="one block per key"):
        store.put_from_pool(keys, pp, [0])
    other = PagedPool.layer_first(HYBRID, alloc_pool(HYBRID, 4))
    with pytest.raises(BufferError, match="block_bytes"):
        store.put_from_pool(keys, other, [0, 1])
    assert store.stats().put_blocks == 0
