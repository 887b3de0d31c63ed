"""Hardening of the Python→Rust boundary (adversarial review): inputs that made Rust read or write
bytes it must not. Each test fails without its fix.

- Transfer jobs on two views of the same bytes: the engine's block claims know a pool by its base
  address, so a load into another view of an in-flight load's pool (an offset slice, or the same
  base with another block count, where block ``b`` lies at other bytes) was accepted and both
  jobs wrote the same bytes.
- Ids in a buffer of more than one dimension: ``_core`` read a 2-D token array (a batch of two
  prompts) as one prompt of their concatenation, and a 2-D block table as one list of ids; the
  Python wrappers check the shape, the binding did not.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvtier
from kvtier import _core, layout
from kvtier.errors import BufferError
from kvtier.transfer import TransferEngine, TransferError

GEOMETRY = kvtier.Geometry(4, 2, 64, "fp16", 16)  # 32 KiB blocks
SEG = GEOMETRY.segment_bytes


def make_store(blocks: int) -> kvtier.Store:
    object_bytes = (GEOMETRY.block_bytes + 64 + 4095) // 4096 * 4096
    config = kvtier.StoreConfig(
        geometry=GEOMETRY, model_id="boundary", dram=kvtier.DramConfig(capacity_bytes=blocks * object_bytes)
    )
    return kvtier.Store(config)


def stored_store() -> tuple[kvtier.Store, kvtier.keys.BlockKeys, np.ndarray]:
    store = make_store(8)
    keys = store.namespace.block_keys(range(4 * GEOMETRY.block_tokens))
    objects = np.random.default_rng(7).integers(0, 256, (len(keys), GEOMETRY.block_bytes), dtype=np.uint8)
    assert store.put(keys, objects).stored == len(keys)
    return store, keys, objects


def test_a_load_into_a_view_of_the_same_bytes_with_another_block_count_is_refused() -> None:
    """LayerFirst: in the 4-block pool, block 2's layer-0 K segment is bytes [2*SEG, 3*SEG); in the
    2-block pool at the same address those bytes are block 0's layer-0 V segment. The claims saw
    (base, 2) and (base, 0): both loads ran, writing the same bytes."""
    store, keys, objects = stored_store()
    engine = TransferEngine(store)
    four = layout.alloc_pool(GEOMETRY, 4)
    two = four[: GEOMETRY.pool_bytes(2)]
    load = engine.submit_load(keys[2:3], four, [2])
    with pytest.raises(BufferError, match=f"shares memory with the pool of load job {load}"):
        engine.submit_load(keys[:1], two, [0])
    with pytest.raises(BufferError, match=f"shares memory with the pool of load job {load}"):
        engine.submit_store(keys[:1], two, [1])  # a store would read bytes being written
    [done] = engine.wait([load])
    assert done.ok
    np.testing.assert_array_equal(layout.gather(GEOMETRY, four, [2])[0], objects[2])
    # Collected: the bytes are free again, for any view.
    [again] = engine.wait([engine.submit_load(keys[:1], two, [0])])
    assert again.ok


def test_a_load_into_an_offset_view_of_an_in_flight_pool_is_refused() -> None:
    store, keys, _ = stored_store()
    engine = TransferEngine(store)
    base = layout.alloc_pool(GEOMETRY, 5)
    whole = base[: GEOMETRY.pool_bytes(4)]
    shifted = base[SEG : SEG + GEOMETRY.pool_bytes(4)]  # block b here overlaps block b+1 there
    store_job = engine.submit_store(keys[:2], whole, [0, 1])
    with pytest.raises(BufferError, match=f"pool of store job {store_job}"):
        engine.submit_load(keys[2:3], shifted, [0])
    other = engine.submit_store(keys[2:3], shifted, [2])  # stores only read: they may share bytes
    assert all(j.ok for j in engine.wait([store_job, other]))


def test_the_same_pool_is_still_left_to_the_block_claims() -> None:
    """Equal pools are told apart block by block (TransferError naming the block), not refused."""
    store, keys, _ = stored_store()
    engine = TransferEngine(store)
    pool = layout.alloc_pool(GEOMETRY, 4)
    load = engine.submit_load(keys[:1], pool, [1])
    with pytest.raises(TransferError, match=f"pool block 1 is in use by load job {load}"):
        engine.submit_load(keys[1:2], pool, [1])
    same = engine.submit_load(keys[1:2], pool.view(np.uint16), [2])  # another array, same bytes
    assert all(j.ok for j in engine.wait([load, same]))


@pytest.mark.parametrize("shape", [(2, 16), (1, 32), ()])
def test_token_ids_in_a_buffer_of_other_than_one_dimension_are_refused(shape: tuple[int, ...]) -> None:
    ns = make_store(1).namespace.hash
    tokens = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    with pytest.raises(BufferError, match=r"tokens have shape \[.*\]; expected a 1-D sequence of ids"):
        _core.block_keys(ns, tokens, 16, b"")
    flat = np.arange(32, dtype=np.int32)
    assert len(_core.block_keys(ns, flat, 16, b"")) == 2 * 16
    assert len(_core.block_keys(ns, memoryview(flat), 16, b"")) == 2 * 16


def test_block_ids_in_a_buffer_of_other_than_one_dimension_are_refused() -> None:
    pool = layout.alloc_pool(GEOMETRY, 4)
    out = np.zeros((4, GEOMETRY.block_bytes), dtype=np.uint8)
    copier = _core.Copier(1)
    with pytest.raises(BufferError, match=r"block_ids have shape \[2, 2\]; expected a 1-D sequence of ids"):
        copier.copy(True, GEOMETRY._handle, pool, 4, np.arange(4, dtype=np.uint64).reshape(2, 2), out, False)
    copier.copy(True, GEOMETRY._handle, pool, 4, np.arange(4, dtype=np.uint64), out, False)
