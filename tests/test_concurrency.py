"""8 threads doing random put/lookup/lease/load/release never read torn or foreign bytes."""

from __future__ import annotations

import threading

import numpy as np

import kvtier


def content(key: int, block_bytes: int) -> np.ndarray:
    words = np.arange((block_bytes + 7) // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    words ^= np.uint64(key & (2**64 - 1))
    return words.view(np.uint8)[:block_bytes]


def test_eight_threads_no_torn_or_foreign_bytes() -> None:
    geometry = kvtier.Geometry(4, 2, 64, "fp16", 16)  # 16 KiB blocks
    store = kvtier.Store(
        kvtier.StoreConfig(
            geometry=geometry, model_id="conc", dram_capacity_bytes=48 * 20 * 2**10, copy_threads=2
        )
    )
    prompts = [np.random.default_rng(p).integers(0, 50_000, 16 * 12) for p in range(10)]
    all_keys = [store.namespace.block_keys(p) for p in prompts]
    errors: list[str] = []
    loaded_blocks = [0]

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(150):
            keys = all_keys[int(rng.integers(len(all_keys)))]
            op = rng.random()
            if op < 0.4:
                objects = np.stack([content(k, geometry.block_bytes) for k in keys])
                store.put(keys, objects)
            elif op < 0.55:
                store.lookup(keys)
            else:
                with store.lease(keys) as lease:
                    out = np.zeros((lease.hit_blocks, geometry.block_bytes), np.uint8)
                    report = store.load(lease, out)
                    for i in range(report.loaded_blocks):
                        if not np.array_equal(out[i], content(keys[i], geometry.block_bytes)):
                            errors.append(f"thread {seed}: block {i} torn or foreign")
                    loaded_blocks[0] += report.loaded_blocks

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    stats = store.stats()
    assert stats.used_bytes <= stats.capacity_bytes
    assert stats.evictions > 0, "the test must run under eviction pressure"
    assert loaded_blocks[0] > 0
    assert stats.checksum_failures == 0
    assert stats.leases_active == 0
    store.check_integrity()
