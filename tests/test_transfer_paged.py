"""kvtier.TransferEngine jobs whose pool is a kvtier.layout.PagedPool (one store call each, on the
store workers): bytes, layerwise waits, per-block outcomes, codec'd tiers, cancel and bounds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvtier
from kvtier import layout
from kvtier.errors import LayoutError
from kvtier.layout import PagedPool
from kvtier.transfer import TransferConfig, TransferEngine, TransferError

GEOMETRY = kvtier.Geometry(4, 2, 64, "fp16", 16)  # 32 KiB blocks


def objects_for(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.uniform(-2, 2, (n, GEOMETRY.block_bytes // 2)).astype(np.float16).view(np.uint8)


def per_layer_pool(num_blocks: int) -> tuple[list[np.ndarray], PagedPool]:
    """vLLM-cpu-like: one array per layer, a block's K and V of that layer in one row."""
    layers = [
        np.zeros((num_blocks, 2 * GEOMETRY.segment_bytes), np.uint8) for _ in range(GEOMETRY.num_layers)
    ]
    return layers, PagedPool([[a] for a in layers])


def make_store(directory: Path | None = None, codec: str = "raw", backend: str | None = None) -> kvtier.Store:
    object_bytes = (GEOMETRY.block_bytes + 64 + 4095) // 4096 * 4096
    ssd = None
    if directory is not None:  # DRAM holds one block; every block is written through to SSD
        ssd = kvtier.SsdConfig(
            directory=str(directory),
            capacity_bytes=40 * object_bytes,
            probe_bytes=0,
            write_through=True,
            promote_on_hit=False,
            codec=codec,
            codec_backend=backend,
        )
    dram = kvtier.DramConfig(capacity_bytes=object_bytes if directory is not None else 32 * object_bytes)
    config = kvtier.StoreConfig(geometry=GEOMETRY, model_id="paged", dram=dram, ssd=ssd)
    return kvtier.Store(config)


@pytest.mark.parametrize("tier", ["dram", "ssd-zstd"])
def test_paged_store_then_load_layer_by_layer(tier: str, tmp_path: Path) -> None:
    store = make_store(
        tmp_path if tier != "dram" else None, *(("lossless", "zstd") if tier != "dram" else ())
    )
    n = 6
    keys = store.namespace.block_keys(range(16 * n))
    objects = objects_for(n, 1)
    src = layout.alloc_pool(GEOMETRY, n + 1)
    layout.scatter(GEOMETRY, objects, list(range(1, n + 1)), src)
    engine = TransferEngine(store)
    [stored] = engine.wait(engine.submit_store(keys, PagedPool.layer_first(GEOMETRY, src), range(1, n + 1)))
    assert stored.ok and stored.kind == "store", stored.failed
    layers, pool = per_layer_pool(n + 2)
    ids = [7, 0, 5, 2, 3, 1]
    job = engine.submit_load(keys, pool, ids)
    seg = GEOMETRY.segment_bytes
    for layer in range(GEOMETRY.num_layers):
        engine.wait_layer(job, layer)
        for i, b in enumerate(ids):  # K and V of this layer are in place, whatever comes later
            want = objects[i, 2 * layer * seg : (2 * layer + 2) * seg]
            assert np.array_equal(layers[layer][b], want), (layer, i)
    [done] = engine.wait(job)
    assert done.ok and done.elapsed_s > 0
    assert store.stats().leases_active == 0


def test_a_paged_load_needs_the_geometrys_layers() -> None:
    """wait_layer(job, l) counts the geometry's layers and a paged load announces the pool's: a
    pool grouped otherwise (here K and V as layers of their own) let wait_layer return before
    the geometry's layer had landed, so attention read stale bytes. Refused at submission; such a
    pool still stores, and the pools kvtier builds (per-layer regions, layer_first with the extra
    groups in the last layer) load layer by layer."""
    store = make_store()
    keys = store.namespace.block_keys(range(16 * 4))
    objects = objects_for(4, 5)
    store.put(keys, objects)
    engine = TransferEngine(store)
    src = layout.alloc_pool(GEOMETRY, 4)
    layout.scatter(GEOMETRY, objects, range(4), src)
    base = PagedPool.layer_first(GEOMETRY, src)
    split = PagedPool([[r] for r in base.regions])  # 2 * num_layers "layers"
    merged = PagedPool([base.regions[:2], base.regions[2:5], base.regions[5:]])  # 1 ends mid layer 2
    for pool, found in ((split, 0), (merged, 1)):
        with pytest.raises(LayoutError, match=f"pool layer {found} ends at byte"):
            engine.submit_load(keys, pool, range(4))
    assert engine.jobs() == 0 and store.stats().leases_active == 0
    [stored] = engine.wait(engine.submit_store(keys, split, range(4)))
    assert stored.ok
    hybrid = kvtier.Geometry(2, 2, 16, "fp16", 8, extra_groups=(kvtier.ExtraGroup("ssm", 40),))
    hstore = kvtier.Store(kvtier.StoreConfig(geometry=hybrid, model_id="paged-hybrid"))
    hkeys = hstore.namespace.block_keys(range(8 * 2))
    hobjects = np.arange(2 * hybrid.block_bytes, dtype=np.uint32).astype(np.uint8).reshape(2, -1)
    hstore.put(hkeys, hobjects)
    hpool = layout.alloc_pool(hybrid, 2)
    hengine = TransferEngine(hstore)
    [done] = hengine.wait(hengine.submit_load(hkeys, PagedPool.layer_first(hybrid, hpool), [1, 0]))
    assert done.ok and np.array_equal(layout.gather(hybrid, hpool, [1, 0]), hobjects)


def test_paged_load_outcomes_per_block() -> None:
    store = make_store()
    keys = store.namespace.block_keys(range(16 * 6))
    objects = objects_for(6, 2)
    store.put(keys[:5], objects[:5])  # block 5 misses
    assert store._core.corrupt_for_test(keys[1].to_bytes(16, "little"), 10)
    engine = TransferEngine(store)
    layers, pool = per_layer_pool(8)
    [done] = engine.wait(engine.submit_load(keys, pool, [0, 1, 2, 2, -1, 6]))
    assert done.outcomes == ("done", "read_failed", "done", "duplicate_block", "bad_block_id", "miss")
    assert np.array_equal(layers[0][2], objects[2, : 2 * GEOMETRY.segment_bytes])
    assert store.stats().checksum_failures == 1 and store.stats().leases_active == 0


def test_paged_cancel_and_bounds() -> None:
    store = make_store()
    keys = store.namespace.block_keys(range(16 * 4))
    store.put(keys, objects_for(4, 3))
    config = TransferConfig(jobs_in_flight_max=2, store_workers=1)
    engine = TransferEngine(store, config)
    _, pool = per_layer_pool(8)
    a = engine.submit_load(keys, pool, [0, 1, 2, 3])
    b = engine.submit_store(keys, pool, [4, 5, 6, 7])  # other blocks: a store from a's would race it
    with pytest.raises(TransferError, match="jobs_in_flight_max"):
        engine.submit_load(keys, pool, [4, 5, 6, 7])
    stopped = engine.cancel(b)
    done = engine.wait([a, b])
    assert done[0].ok
    assert done[1].cancelled == stopped
    assert set(done[1].outcomes) <= {"cancelled", "done"}
    assert engine.jobs() == 0 and store.stats().leases_active == 0
