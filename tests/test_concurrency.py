"""8 threads doing random put/lookup/lease/load/release never read torn or foreign bytes."""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable

import numpy as np

import kvtier


def content(key: int, block_bytes: int) -> np.ndarray:
    words = np.arange((block_bytes + 7) // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    words ^= np.uint64(key & (2**64 - 1))
    return words.view(np.uint8)[:block_bytes]


def run_threads(worker: Callable[[int], None], n: int) -> list[str]:
    """Runs ``worker(0..n)`` on ``n`` threads; returns every exception a worker raised, formatted.

    An exception in a thread is otherwise only printed by ``threading.excepthook`` and the test
    would pass; here anything a worker raises (assertion, store error, bug) is collected.
    """
    errors: list[str] = []
    lock = threading.Lock()

    def guarded(seed: int) -> None:
        try:
            worker(seed)
        except BaseException:  # everything a worker raises must reach the test
            with lock:
                errors.append(f"thread {seed}:\n{traceback.format_exc()}")

    threads = [threading.Thread(target=guarded, args=(s,)) for s in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_worker_exceptions_fail_the_test() -> None:
    def worker(seed: int) -> None:
        if seed == 2:
            raise KeyError("boom")
        if seed == 3:
            raise AssertionError("bad bytes")

    errors = run_threads(worker, 4)
    assert len(errors) == 2
    assert any("KeyError: 'boom'" in e for e in errors)
    assert any("AssertionError: bad bytes" in e for e in errors)


def test_eight_threads_no_torn_or_foreign_bytes() -> None:
    geometry = kvtier.Geometry(4, 2, 64, "fp16", 16)  # 16 KiB blocks
    store = kvtier.Store(
        kvtier.StoreConfig(
            geometry=geometry,
            model_id="conc",
            dram=kvtier.DramConfig(capacity_bytes=48 * 20 * 2**10),
            copy_threads=2,
        )
    )
    prompts = [np.random.default_rng(p).integers(0, 50_000, 16 * 12) for p in range(10)]
    all_keys = [store.namespace.block_keys(p) for p in prompts]
    loaded_blocks = [0] * 8

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
                        assert np.array_equal(out[i], content(keys[i], geometry.block_bytes)), (
                            f"block {i} torn or foreign"
                        )
                    loaded_blocks[seed] += report.loaded_blocks

    errors = run_threads(worker, 8)
    assert not errors, "\n".join(errors[:3])
    stats = store.stats()
    assert stats.used_bytes <= stats.capacity_bytes
    assert stats.evictions > 0, "the test must run under eviction pressure"
    assert sum(loaded_blocks) > 0
    assert stats.checksum_failures == 0
    assert stats.leases_active == 0
    store.check_integrity()
