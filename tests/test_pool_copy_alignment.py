"""The paged-pool path at every alignment: pieces long enough for the streaming copy (≥ 4 KiB)
whose lengths are not multiples of 16 and whose addresses fall at every offset mod 32, so the
copy's head, its 16-byte streaming step and its tails all run (``crates/kvtier-core/src/copy.rs``).
Bytes around each piece stay untouched, a tampered object still fails verification, and pools of
the wrong size are refused before anything is copied."""

from __future__ import annotations

import numpy as np
import pytest

import kvtier
from kvtier.config import DramConfig
from kvtier.errors import BufferError
from kvtier.layout import PagedPool, gather

# 2 layers, 1 head, dim 129, fp16, 17-token blocks: 4386-byte segments (4386 % 32 == 2), so the
# pieces of consecutive blocks start at every even offset mod 32.
ODD = kvtier.Geometry(2, 1, 129, "fp16", 17)


def odd_store(blocks: int = 32) -> kvtier.Store:
    cap = blocks * 2 * (ODD.block_bytes + 4096)
    return kvtier.Store(
        kvtier.StoreConfig(geometry=ODD, model_id="align", dram=DramConfig(capacity_bytes=cap))
    )


def shifted_pool(n: int, shift: int, fill: int) -> tuple[np.ndarray, np.ndarray]:
    """A LayerFirst pool of ``n`` blocks starting ``shift`` bytes into a larger array (with
    ``fill`` bytes before and after it): ``(backing, pool)``."""
    backing = np.full(ODD.pool_bytes(n) + 64, fill, np.uint8)
    return backing, backing[shift : shift + ODD.pool_bytes(n)]


@pytest.mark.parametrize("shift", [0, 1, 8, 16, 17, 31])
def test_load_into_pool_and_put_from_pool_at_every_alignment(shift: int) -> None:
    store = odd_store()
    n, blocks = 16, 9
    rng = np.random.default_rng(shift)
    objects = rng.integers(0, 256, (blocks, ODD.block_bytes), dtype=np.uint8)
    keys = store.namespace.block_keys(np.arange(blocks * ODD.block_tokens, dtype=np.uint32))
    assert store.put(keys, objects).stored == blocks
    backing, pool = shifted_pool(n, shift, 0xA5)
    ids = np.array([15, 3, 4, 0, 9, 8, 1, 12, 6])  # out of order, some adjacent, up and down
    with store.lease(keys) as lease:
        assert store.load_into_pool(lease, PagedPool.layer_first(ODD, pool), ids).loaded_blocks == blocks
    assert np.array_equal(gather(ODD, pool, ids), objects)
    others = [b for b in range(n) if b not in ids]
    assert (gather(ODD, pool, others) == 0xA5).all()  # blocks not in the table untouched
    assert (backing[:shift] == 0xA5).all() and (backing[shift + pool.size :] == 0xA5).all()

    # And back: the pool's blocks stored under new keys, read back through the verified load.
    again = store.namespace.block_keys(np.arange(blocks * ODD.block_tokens, dtype=np.uint32) + 7)
    assert store.put_from_pool(again, PagedPool.layer_first(ODD, pool), ids[::-1]).stored == blocks
    out = np.zeros((blocks, ODD.block_bytes), np.uint8)
    with store.lease(again) as lease:
        assert store.load(lease, out).loaded_blocks == blocks
    assert np.array_equal(out, objects[::-1])
    store.check_integrity()


def test_put_from_pool_in_runs_of_consecutive_blocks_keeps_each_object_whole() -> None:
    """A put copies runs of consecutive pool blocks region by region (``dram/payloads.rs``):
    each object must still get exactly its own block's bytes and checksum."""
    store = odd_store(64)
    _, pool = shifted_pool(16, 7, 0)
    pool[:] = np.random.default_rng(11).integers(0, 256, pool.size, dtype=np.uint8)
    ids = np.array([10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 5, 13, 12])  # descending runs, a repeat
    keys = store.namespace.block_keys(np.arange(ids.size * ODD.block_tokens, dtype=np.uint32))
    assert store.put_from_pool(keys, PagedPool.layer_first(ODD, pool), ids).stored == ids.size
    out = np.zeros((ids.size, ODD.block_bytes), np.uint8)
    with store.lease(keys) as lease:
        assert store.load(lease, out).loaded_blocks == ids.size  # every checksum verifies
    assert np.array_equal(out, gather(ODD, pool, ids))
    assert store.stats().checksum_failures == 0
    store.check_integrity()


def test_a_tampered_object_is_refused_at_an_odd_alignment() -> None:
    store = odd_store()
    objects = np.random.default_rng(9).integers(0, 256, (5, ODD.block_bytes), dtype=np.uint8)
    keys = store.namespace.block_keys(np.arange(5 * ODD.block_tokens, dtype=np.uint32))
    assert store.put(keys, objects).stored == 5
    # The object's last byte: in the tail of its last piece, copied below the streaming steps.
    assert store._corrupt_for_test(keys[2], ODD.block_bytes - 1)
    _, pool = shifted_pool(8, 3, 0)
    ids = [7, 6, 5, 4, 3]
    with store.lease(keys) as lease:
        report = store.load_into_pool(lease, PagedPool.layer_first(ODD, pool), ids)
    assert report == kvtier.store.PoolLoadReport(2, (2,), 1)
    got = gather(ODD, pool, ids)
    for i in (0, 1, 3, 4):
        assert np.array_equal(got[i], objects[i])
    assert store.lookup(keys).hit_blocks == 2  # the tampered object is gone, not served again
    store.check_integrity()


def test_pools_of_the_wrong_size_are_refused_before_any_copy() -> None:
    _, pool = shifted_pool(4, 5, 0)
    with pytest.raises(BufferError, match="positive multiple"):
        PagedPool.layer_first(ODD, pool[:-1])
    with pytest.raises(BufferError, match="positive multiple"):
        PagedPool.layer_first(ODD, pool[: ODD.pool_bytes(1) - 16])
    seg = ODD.segment_bytes
    short = [[np.zeros((4, seg), np.uint8), np.zeros((4, seg - 16), np.uint8)] for _ in range(2)]
    store = odd_store()
    keys = store.namespace.block_keys(np.arange(ODD.block_tokens, dtype=np.uint32))
    assert store.put(keys, np.ones((1, ODD.block_bytes), np.uint8)).stored == 1
    with store.lease(keys) as lease, pytest.raises(BufferError, match="block_bytes"):
        store.load_into_pool(lease, PagedPool(short), [0])
    with pytest.raises(BufferError, match="block_bytes"):
        store.put_from_pool(keys, PagedPool(short), [0])
    assert not any(r.any() for layer in short for r in layer)


# Pieces of three fused 4 KiB chunks and a 608-byte rest (1 layer, 2 heads, dim 403, fp16,
# 8-token blocks: 12896-byte segments), so every piece crosses the copy+hash chunk boundaries.
WIDE = kvtier.Geometry(1, 2, 403, "fp16", 8)


def test_random_block_tables_both_ways_and_a_wrong_byte_at_a_chunk_boundary() -> None:
    """A random block table (n of a 2n-block pool, in random order, as an engine's pool hands them
    out after a while) both ways: every byte lands, blocks outside the table stay untouched, and a
    byte changed in the DRAM object right at a 4 KiB chunk boundary of a piece is refused."""
    n = 12
    cap = 3 * n * (WIDE.block_bytes + 4096)
    store = kvtier.Store(
        kvtier.StoreConfig(geometry=WIDE, model_id="wide", dram=DramConfig(capacity_bytes=cap))
    )
    rng = np.random.default_rng(23)
    pool = np.zeros(WIDE.pool_bytes(2 * n) + 16, np.uint8)[16:]  # 16 bytes past a page, as numpy
    pool[:] = rng.integers(0, 256, pool.size, dtype=np.uint8)
    paged = PagedPool.layer_first(WIDE, pool)
    ids = rng.permutation(2 * n)[:n]
    keys = store.namespace.block_keys(np.arange(n * WIDE.block_tokens, dtype=np.uint32))
    assert store.put_from_pool(keys, paged, ids).stored == n
    objects = gather(WIDE, pool, ids)
    out = np.zeros_like(objects)
    with store.lease(keys) as lease:
        assert store.load(lease, out).loaded_blocks == n
    assert np.array_equal(out, objects)

    back = np.full_like(pool, 0x5A)
    back_ids = rng.permutation(2 * n)[:n]
    with store.lease(keys) as lease:
        report = store.load_into_pool(lease, PagedPool.layer_first(WIDE, back), back_ids)
    assert report.loaded_blocks == n and report.failed == ()
    assert np.array_equal(gather(WIDE, back, back_ids), objects)
    others = [b for b in range(2 * n) if b not in back_ids]
    assert (gather(WIDE, back, others) == 0x5A).all()

    # Object 5's second piece, first byte of its second fused chunk.
    assert store._corrupt_for_test(keys[5], WIDE.segment_bytes + 4096)
    with store.lease(keys) as lease:
        report = store.load_into_pool(lease, PagedPool.layer_first(WIDE, back), back_ids)
    assert report.failed == (5,)
    assert store.stats().checksum_failures == 1
    store.check_integrity()
