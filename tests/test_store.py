from __future__ import annotations

import gc
import time

import numpy as np
import pytest

import kvtier
import kvtier.store
from kvtier.errors import BufferError, KvtierError, LeaseError, NamespaceError
from kvtier.keys import BlockKeys


def blocks_for(keys: BlockKeys, block_bytes: int) -> np.ndarray:
    """Deterministic content per key, so every loaded byte can be checked."""
    out = np.empty((len(keys), block_bytes), dtype=np.uint8)
    for i, k in enumerate(keys):
        out[i] = np.random.default_rng(k & (2**64 - 1)).integers(0, 256, block_bytes, dtype=np.uint8)
    return out


def test_put_lease_load_round_trip(small_store: kvtier.Store) -> None:
    keys = small_store.namespace.block_keys(range(40))  # 10 blocks
    objects = blocks_for(keys, small_store.block_bytes)
    report = small_store.put(keys, objects)
    assert report == kvtier.PutReport(stored=10, already_present=0, rejected=0, evicted=0)
    assert small_store.put(keys[:3], objects[:3]).already_present == 3
    with small_store.lease(keys) as lease:
        assert lease.hit_blocks == 10
        assert lease.tiers == ("dram",) * 10
        out = np.zeros_like(objects)
        assert small_store.load(lease, out) == kvtier.LoadReport(10, 0)
    assert np.array_equal(out, objects)
    small_store.check_integrity()


def test_prefaulted_store_round_trips(small_geometry: kvtier.Geometry) -> None:
    config = kvtier.StoreConfig(
        geometry=small_geometry, model_id="m", dram=kvtier.DramConfig(capacity_bytes=2**20, prefault=True)
    )
    store = kvtier.Store(config)
    keys = store.namespace.block_keys(range(8))
    objects = blocks_for(keys, store.block_bytes)
    store.put(keys, objects)
    with store.lease(keys) as lease:
        out = np.zeros_like(objects)
        assert store.load(lease, out).loaded_blocks == 2
    assert np.array_equal(out, objects)


def test_lookup_is_longest_consecutive_prefix(small_store: kvtier.Store) -> None:
    keys = small_store.namespace.block_keys(range(40))
    objects = blocks_for(keys, small_store.block_bytes)
    small_store.put(keys[:4], objects[:4])
    small_store.put(keys[5:], objects[5:])  # hole at block 4
    assert small_store.lookup(keys).hit_blocks == 4
    longer = small_store.namespace.block_keys(list(range(40)) + list(range(100, 108)))
    assert small_store.lookup(longer).hit_blocks == 4
    other_prompt = small_store.namespace.block_keys(range(1, 41))
    assert small_store.lookup(other_prompt).hit_blocks == 0
    stats = small_store.stats()
    assert stats.lookups == 3 and stats.hit_blocks == 8


def test_lookup_each_asks_about_every_key_past_a_hole(small_store: kvtier.Store) -> None:
    keys = small_store.namespace.block_keys(range(40))  # 10 blocks
    objects = blocks_for(keys, small_store.block_bytes)
    small_store.put(keys[:2], objects[:2])
    small_store.put(keys[5:7], objects[5:7])
    d = "dram"
    assert small_store.lookup_each(keys) == (d, d, None, None, None, d, d, None, None, None)
    assert small_store.lookup_each(keys[:0]) == ()
    assert small_store.stats().lookups == 2
    config = small_store.config
    other = kvtier.Store(kvtier.StoreConfig(geometry=config.geometry, model_id="other", dram=config.dram))
    with pytest.raises(NamespaceError):
        other.lookup_each(keys)


def test_load_a_prefix_of_the_lease(small_store: kvtier.Store) -> None:
    keys = small_store.namespace.block_keys(range(24))
    objects = blocks_for(keys, small_store.block_bytes)
    small_store.put(keys, objects)
    with small_store.lease(keys) as lease:
        out = np.zeros((2, small_store.block_bytes), np.uint8)
        small_store.load(lease, out)
        assert np.array_equal(out, objects[:2])
        per_block = [np.zeros(small_store.block_bytes, np.uint8) for _ in range(3)]
        assert small_store.load(lease, per_block).loaded_blocks == 3
        assert all(np.array_equal(a, b) for a, b in zip(per_block, objects[:3], strict=True))


def test_other_model_or_tenant_never_hits(small_geometry: kvtier.Geometry) -> None:
    a = kvtier.Store(
        kvtier.StoreConfig(
            geometry=small_geometry, model_id="model-a", dram=kvtier.DramConfig(capacity_bytes=2**20)
        )
    )
    keys = a.namespace.block_keys(range(40))
    a.put(keys, blocks_for(keys, a.block_bytes))
    for other in (
        kvtier.StoreConfig(geometry=small_geometry, model_id="model-b").namespace,
        kvtier.StoreConfig(geometry=small_geometry, model_id="model-a", cache_salt="tenant-2").namespace,
    ):
        foreign = other.block_keys(range(40))
        with pytest.raises(NamespaceError, match="namespace"):
            a.lookup(foreign)
        # Even forged into this namespace, the other chain's keys are not present.
        assert a.lookup(BlockKeys(a.namespace.hash, foreign.raw)).hit_blocks == 0


def test_corrupt_byte_is_a_counted_miss(small_store: kvtier.Store) -> None:
    keys = small_store.namespace.block_keys(range(40))
    objects = blocks_for(keys, small_store.block_bytes)
    small_store.put(keys, objects)
    assert small_store._corrupt_for_test(keys[3], 17)
    with small_store.lease(keys) as lease:
        out = np.zeros_like(objects)
        report = small_store.load(lease, out)
    assert report == kvtier.LoadReport(loaded_blocks=3, checksum_failures=1)
    assert np.array_equal(out[:3], objects[:3])
    assert small_store.stats().checksum_failures == 1
    assert small_store.lookup(keys).hit_blocks == 3  # the corrupt block is gone
    small_store.check_integrity()


def test_leased_blocks_survive_eviction_pressure(small_geometry: kvtier.Geometry) -> None:
    config = kvtier.StoreConfig(
        geometry=small_geometry, model_id="m", dram=kvtier.DramConfig(capacity_bytes=16 * 4096)
    )
    store = kvtier.Store(config)
    keys = store.namespace.block_keys(range(16))  # 4 blocks
    objects = blocks_for(keys, store.block_bytes)
    store.put(keys, objects)
    lease = store.lease(keys)
    for start in range(1000, 1000 + 40 * 64, 64):  # far more than capacity
        more = store.namespace.block_keys(range(start, start + 64))
        store.put(more, blocks_for(more, store.block_bytes))
        stats = store.stats()
        assert stats.used_bytes <= stats.capacity_bytes
    assert store.stats().evictions > 0
    out = np.zeros_like(objects)
    assert store.load(lease, out).loaded_blocks == 4
    assert np.array_equal(out, objects)
    lease.release()
    for start in range(9000, 9000 + 40 * 64, 64):
        more = store.namespace.block_keys(range(start, start + 64))
        store.put(more, blocks_for(more, store.block_bytes))
    assert store.lookup(keys).hit_blocks == 0  # released blocks may now be evicted
    store.check_integrity()


def test_full_of_leased_blocks_rejects_instead_of_growing(small_geometry: kvtier.Geometry) -> None:
    store = kvtier.Store(
        kvtier.StoreConfig(
            geometry=small_geometry, model_id="m", dram=kvtier.DramConfig(capacity_bytes=4 * 4096)
        )
    )
    keys = store.namespace.block_keys(range(16))
    store.put(keys, blocks_for(keys, store.block_bytes))
    with store.lease(keys):
        more = store.namespace.block_keys(range(500, 516))
        report = store.put(more, blocks_for(more, store.block_bytes))
        assert report.rejected == 4 and report.stored == 0
        assert store.stats().rejected_puts == 4
    assert store.stats().used_bytes <= store.stats().capacity_bytes


class TestBadInput:
    def test_wrong_object_bytes(self, small_store: kvtier.Store) -> None:
        keys = small_store.namespace.block_keys(range(8))
        with pytest.raises(BufferError, match="expected 2 x 512"):
            small_store.put(keys, np.zeros((2, 100), np.uint8))

    def test_wrong_count(self, small_store: kvtier.Store) -> None:
        keys = small_store.namespace.block_keys(range(8))
        with pytest.raises(BufferError, match="expected 2 blocks"):
            small_store.put(keys, np.zeros((3, small_store.block_bytes), np.uint8))

    def test_wrong_dtype_size_combination_is_caught_by_bytes(self, small_store: kvtier.Store) -> None:
        keys = small_store.namespace.block_keys(range(4))
        with pytest.raises(BufferError, match="bytes"):
            small_store.put(keys, np.zeros((1, small_store.block_bytes), np.float32))

    def test_non_contiguous_and_read_only(self, small_store: kvtier.Store) -> None:
        keys = small_store.namespace.block_keys(range(8))
        small_store.put(keys, np.zeros((2, small_store.block_bytes), np.uint8))
        wide = np.zeros((2, 2 * small_store.block_bytes), np.uint8)
        with pytest.raises(BufferError, match="C-contiguous"):
            small_store.put(keys, wide[:, ::2])
        out = np.zeros((2, small_store.block_bytes), np.uint8)
        out.flags.writeable = False
        with small_store.lease(keys) as lease, pytest.raises(BufferError, match="read-only"):
            small_store.load(lease, out)

    def test_load_more_than_leased(self, small_store: kvtier.Store) -> None:
        keys = small_store.namespace.block_keys(range(8))
        small_store.put(keys[:1], np.zeros((1, small_store.block_bytes), np.uint8))
        with small_store.lease(keys) as lease, pytest.raises(LeaseError, match="holds 1"):
            small_store.load(lease, np.zeros((2, small_store.block_bytes), np.uint8))

    def test_released_lease(self, small_store: kvtier.Store) -> None:
        keys = small_store.namespace.block_keys(range(4))
        small_store.put(keys, np.zeros((1, small_store.block_bytes), np.uint8))
        lease = small_store.lease(keys)
        lease.release()
        with pytest.raises(LeaseError, match="released"):
            small_store.load(lease, np.zeros((1, small_store.block_bytes), np.uint8))
        with pytest.raises(LeaseError, match="ended"):  # the Rust store knows it is gone too
            small_store._core.load(lease.id, np.zeros((1, small_store.block_bytes), np.uint8), 1)
        small_store._core.release(lease.id)  # releasing is idempotent
        lease.release()
        with pytest.raises(LeaseError, match="never granted"):
            small_store._core.release(lease.id + 1000)
        assert small_store.stats().leases_active == 0

    def test_keys_not_block_keys(self, small_store: kvtier.Store) -> None:
        with pytest.raises(TypeError, match="BlockKeys"):
            small_store.lookup([1, 2, 3])  # type: ignore[arg-type]

    def test_errors_are_kvtier_errors(self, small_store: kvtier.Store) -> None:
        keys = small_store.namespace.block_keys(range(4))
        with pytest.raises(KvtierError):
            small_store.put(keys, np.zeros(3, np.uint8))

    def test_zero_dim_array_is_a_buffer_error(self, small_store: kvtier.Store) -> None:
        keys = small_store.namespace.block_keys(range(4))
        small_store.put(keys, np.zeros((1, small_store.block_bytes), np.uint8))
        with pytest.raises(BufferError, match="out"), small_store.lease(keys) as lease:
            small_store.load(lease, np.zeros((), np.uint8))
        with pytest.raises(BufferError, match="objects"):
            small_store.put(keys, np.zeros((), np.uint8))

    def test_not_an_array_or_sequence_is_a_buffer_error(self, small_store: kvtier.Store) -> None:
        keys = small_store.namespace.block_keys(range(4))
        small_store.put(keys, np.zeros((1, small_store.block_bytes), np.uint8))
        with pytest.raises(BufferError, match="out"), small_store.lease(keys) as lease:
            small_store.load(lease, 7)  # type: ignore[arg-type]


def test_tuple_and_other_sequences_of_blocks(small_store: kvtier.Store) -> None:
    keys = small_store.namespace.block_keys(range(12))
    objects = blocks_for(keys, small_store.block_bytes)
    assert small_store.put(keys, tuple(objects)).stored == 3
    with small_store.lease(keys) as lease:
        out = tuple(np.zeros(small_store.block_bytes, np.uint8) for _ in range(3))
        assert small_store.load(lease, out).loaded_blocks == 3
        assert all(np.array_equal(a, b) for a, b in zip(out, objects, strict=True))
        assert small_store.load(lease, []).loaded_blocks == 0  # an empty list loads nothing


def test_expired_lease_releases_after_more_than_leases_max_expiries(small_geometry: kvtier.Geometry) -> None:
    config = kvtier.StoreConfig(
        geometry=small_geometry,
        model_id="m",
        dram=kvtier.DramConfig(capacity_bytes=2**16),
        lease_ttl_s=0.02,
        leases_max=2,
    )
    store = kvtier.Store(config)
    keys = store.namespace.block_keys(range(8))
    store.put(keys, blocks_for(keys, store.block_bytes))
    first = store.lease(keys)
    later = []
    for _ in range(4):  # each expires before the next is granted: 5 expiries > leases_max
        time.sleep(0.05)
        later.append(store.lease(keys))
    time.sleep(0.05)
    assert store.stats().leases_expired == 5
    first.release()  # was LeaseError (unknown) once the expired-id memory was trimmed
    with first:  # leaving the block releases again: harmless
        pass
    for lease in later:
        lease.release()
    assert store.stats().leases_active == 0
    store.check_integrity()


def test_lease_exit_never_masks_the_body_exception(small_store: kvtier.Store) -> None:
    keys = small_store.namespace.block_keys(range(4))

    def failing_release() -> None:
        raise LeaseError("release failed")

    with pytest.raises(ValueError, match="body") as info, small_store.lease(keys) as lease:
        lease.release = failing_release  # type: ignore[method-assign]
        raise ValueError("body")
    assert any("release failed" in note for note in getattr(info.value, "__notes__", []))
    with pytest.raises(LeaseError, match="release failed"), small_store.lease(keys) as lease:
        lease.release = failing_release  # type: ignore[method-assign]
    small_store._core.release(lease.id)


def test_garbage_collected_lease_is_released(small_store: kvtier.Store) -> None:
    keys = small_store.namespace.block_keys(range(8))
    small_store.put(keys, blocks_for(keys, small_store.block_bytes))
    lease = small_store.lease(keys)
    assert small_store.stats().leases_active == 1
    del lease
    gc.collect()
    assert small_store.stats().leases_active == 0
    small_store.check_integrity()
    # A lease in a reference cycle is released when the cycle is collected.
    cyclic = small_store.lease(keys)
    cyclic.cycle = cyclic  # type: ignore[attr-defined]
    del cyclic
    gc.collect()
    assert small_store.stats().leases_active == 0
    # An explicitly released lease is not released again when collected.
    lease = small_store.lease(keys)
    lease.release()
    del lease
    gc.collect()
    small_store.check_integrity()


def test_lease_finalizer_swallows_errors() -> None:
    class GoneStore:
        def release(self, lease_id: int) -> None:
            raise LeaseError(f"store gone; cannot release {lease_id}")

    kvtier.store._release_quietly(GoneStore(), 7)  # type: ignore[arg-type]


def test_corrupt_block_is_counted_once_across_loads(small_store: kvtier.Store) -> None:
    keys = small_store.namespace.block_keys(range(20))
    objects = blocks_for(keys, small_store.block_bytes)
    small_store.put(keys, objects)
    assert small_store._corrupt_for_test(keys[2], 5)
    with small_store.lease(keys) as lease, small_store.lease(keys) as other:
        for held in (lease, lease, other):
            out = np.zeros_like(objects)
            # Every load of the corrupt copy stops there and says why ...
            assert small_store.load(held, out) == kvtier.LoadReport(loaded_blocks=2, checksum_failures=1)
            assert np.array_equal(out[:2], objects[:2])
    # ... but the store counts the one corrupt copy once.
    assert small_store.stats().checksum_failures == 1
    small_store.check_integrity()


def test_corrupting_a_leased_block_is_refused(small_store: kvtier.Store) -> None:
    # Flipping a bit of a block a lease may be loading would race with the load's read.
    keys = small_store.namespace.block_keys(range(8))
    objects = blocks_for(keys, small_store.block_bytes)
    small_store.put(keys, objects)
    with small_store.lease(keys) as lease:
        assert not small_store._corrupt_for_test(keys[0], 0)
        out = np.zeros_like(objects)
        assert small_store.load(lease, out) == kvtier.LoadReport(2, 0)
    assert np.array_equal(out, objects)
    assert small_store._corrupt_for_test(keys[0], 0)
