"""Hardening of the Python→Rust boundary (adversarial review): inputs that made Rust read or write
bytes it must not. Each test fails without its fix.

- Transfer jobs on two views of the same bytes: the engine's block claims know a pool by its base
  address, so a load into another view of an in-flight load's pool (an offset slice, or the same
  base with another block count, where block ``b`` lies at other bytes) was accepted and both
  jobs wrote the same bytes.
- Ids in a buffer of more than one dimension: ``_core`` read a 2-D token array (a batch of two
  prompts) as one prompt of their concatenation, and a 2-D block table as one list of ids; the
  Python wrappers check the shape, the binding did not.
- Quant encoding of data that is not fp16: ``codec.encode`` viewed any array as bytes, so a
  float32 array of a layer's K and V (twice the fp16 byte count) was quantized as two layers of
  meaningless fp16 values; ``_core.codec_encode_quant`` took any plain numbers too.
- A duplex engine's device pool and host swap space were both named "pool": overlapping ones were
  refused as "pool and pool share memory", and a block buffer inside either as "out and pool".
"""

from __future__ import annotations

import numpy as np
import pytest

import kvtier
from kvtier import _core, codec, layout
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
    with pytest.raises(
        TransferError, match=f"the load job's pool shares memory with the pool of load job {load}"
    ):
        engine.submit_load(keys[:1], two, [0])
    with pytest.raises(
        TransferError, match=f"the store job's pool shares memory with the pool of load job {load}"
    ):
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
    with pytest.raises(TransferError, match=f"pool of store job {store_job} .*laid out otherwise"):
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


QUANT = kvtier.Geometry(2, 2, 64, "fp16", 16)
BINS = codec.BinRule(early_layers=0, early_bins=16, late_bins=16)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.uint64, np.bool_])
def test_quant_refuses_data_that_is_not_fp16(dtype: type) -> None:
    # One layer's K and V as fp16 upcast to float32: read as fp16, its low halves are denormals,
    # never NaN, so the float32 array was quantized as two layers of garbage without an error.
    layer = np.random.default_rng(3).uniform(-2, 2, QUANT.segment_bytes).astype(np.float16).astype(np.float32)
    data = layer.astype(dtype)
    data = data[: 2 * QUANT.segment_bytes // data.itemsize]  # a whole number of fp16 layers' bytes
    with pytest.raises(codec.CodecError, match=f"data has dtype {np.dtype(dtype)}; quant encodes fp16 KV"):
        codec.encode(data, "quant", geometry=QUANT)
    with pytest.raises(BufferError, match=r"data has items of type .*; expected float16"):
        _core.codec_encode_quant(data, 0, 16, 2, 64, [8], [8], "none")
    fp16 = layer.astype(np.float16)  # exact: the values came from fp16
    payload = codec.encode(fp16, "quant", geometry=QUANT, key_bins=BINS, value_bins=BINS)
    for view in (fp16.view(np.uint8), fp16.view(np.uint16), memoryview(fp16.view(np.uint8))):
        assert codec.encode(view, "quant", geometry=QUANT, key_bins=BINS, value_bins=BINS) == payload
    assert _core.codec_encode_quant(fp16, 0, 16, 2, 64, [16], [16], "deflate") == payload


def test_a_duplex_engines_pools_are_named_apart_when_they_share_memory() -> None:
    memory = layout.alloc_pool(QUANT, 4)
    device, host = memory[: QUANT.pool_bytes(2)], memory[QUANT.pool_bytes(1) : QUANT.pool_bytes(3)]
    with pytest.raises(BufferError, match="device and host share memory"):
        _core.DuplexEngine(QUANT._handle, device, host, 4, 4)
    device, host = memory[: QUANT.pool_bytes(2)], memory[QUANT.pool_bytes(2) :]
    engine = _core.DuplexEngine(QUANT._handle, device, host, 4, 4)
    with pytest.raises(BufferError, match="out and host share memory"):
        engine.read_block(0, host[: QUANT.block_bytes])
    with pytest.raises(BufferError, match="data and device share memory"):
        engine.write_block(0, device[QUANT.block_bytes : 2 * QUANT.block_bytes])
