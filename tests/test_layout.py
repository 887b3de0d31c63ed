from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier
from kvtier.errors import BufferError, KvtierError, LayoutError
from kvtier.geometry import ExtraGroup, Geometry
from kvtier.layout import Copier, alloc_pool, gather, kv_view, scatter


def reference_object(g: Geometry, pool: np.ndarray, block: int, num_blocks: int) -> np.ndarray:
    """BlockFirst bytes of pool block ``block``, from the layout formulas (docs/formats.md)."""
    seg = g.segment_bytes
    parts = []
    for layer in range(g.num_layers):
        for kv in range(2):
            off = ((layer * 2 + kv) * num_blocks + block) * seg
            parts.append(pool[off : off + seg])
    base = g.num_layers * 2 * num_blocks * seg
    for grp in g.extra_groups:
        gb = grp.bytes_per_token * g.block_tokens
        parts.append(pool[base + block * gb : base + (block + 1) * gb])
        base += num_blocks * gb
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


geometries = st.builds(
    Geometry,
    num_layers=st.integers(1, 4),
    num_kv_heads=st.integers(1, 3),
    head_dim=st.integers(1, 8),
    dtype=st.sampled_from(["fp16", "bf16", "fp32", "fp8_e4m3"]),
    block_tokens=st.integers(1, 5),
    extra_groups=st.lists(st.integers(1, 9), max_size=2).map(
        lambda sizes: tuple(ExtraGroup(f"g{i}", s) for i, s in enumerate(sizes))
    ),
)


@settings(max_examples=60, deadline=None)
@given(geometries, st.integers(1, 12), st.randoms(use_true_random=False), st.sampled_from([1, 2]))
def test_gather_scatter_round_trip(g: Geometry, num_blocks: int, rnd: object, threads: int) -> None:
    rng = np.random.default_rng(rnd.randint(0, 2**32))  # type: ignore[attr-defined]
    n = int(rng.integers(0, num_blocks + 1))
    ids = rng.permutation(num_blocks)[:n]
    copier = Copier(threads)
    pool = rng.integers(0, 256, g.pool_bytes(num_blocks), dtype=np.uint8)
    before = pool.copy()
    objects = rng.integers(0, 256, (n, g.block_bytes), dtype=np.uint8)
    copier.scatter(g, objects, ids, pool)
    back = copier.gather(g, pool, ids)
    assert np.array_equal(back, objects)  # gather ∘ scatter = identity
    for i, b in enumerate(ids):
        assert np.array_equal(reference_object(g, pool, int(b), num_blocks), objects[i])
    untouched = [b for b in range(num_blocks) if b not in set(ids.tolist())]
    for b in untouched:  # scatter wrote only the listed blocks
        assert np.array_equal(
            reference_object(g, pool, b, num_blocks), reference_object(g, before, b, num_blocks)
        )
    naive = copier.gather(g, pool, ids, per_segment=True)
    assert np.array_equal(naive, objects)


def test_large_multithreaded_gather_matches_reference() -> None:
    g = Geometry(4, 2, 64, "bf16", 16)  # 32 KiB blocks; 64 blocks = 2 MiB: uses the worker pool
    num_blocks = 96
    rng = np.random.default_rng(3)
    pool = rng.integers(0, 256, g.pool_bytes(num_blocks), dtype=np.uint8)
    ids = rng.permutation(num_blocks)[:64]
    out = Copier(2).gather(g, pool, ids)
    for i, b in enumerate(ids):
        assert np.array_equal(out[i], reference_object(g, pool, int(b), num_blocks))
    kv = kv_view(g, pool)
    assert kv.shape == (4, 2, num_blocks, 16, 2, 64)
    assert np.array_equal(np.ascontiguousarray(kv[:, :, ids[0]]).view(np.uint8).reshape(-1), out[0])


def test_module_functions_use_default_copier(small_geometry: Geometry) -> None:
    pool = alloc_pool(small_geometry, 4)
    objs = np.full((2, small_geometry.block_bytes), 7, dtype=np.uint8)
    stats = scatter(small_geometry, objs, [3, 1], pool)
    assert stats.bytes == 2 * small_geometry.block_bytes
    assert np.array_equal(gather(small_geometry, pool, [1, 3]), objs)


def test_objects_may_have_any_dtype_of_the_right_size(small_geometry: Geometry) -> None:
    pool = alloc_pool(small_geometry, 4)
    objs = np.arange(2 * small_geometry.block_bytes // 2, dtype=np.float16).reshape(2, -1)
    scatter(small_geometry, objs, [0, 2], pool)
    back = gather(small_geometry, pool, [0, 2]).view(np.float16).reshape(2, -1)
    assert np.array_equal(back, objs)


class TestBadInput:
    def test_out_of_range_block(self, small_geometry: Geometry) -> None:
        pool = alloc_pool(small_geometry, 4)
        with pytest.raises(LayoutError, match="block id 4"):
            gather(small_geometry, pool, [0, 4])

    def test_negative_block(self, small_geometry: Geometry) -> None:
        pool = alloc_pool(small_geometry, 4)
        with pytest.raises(LayoutError, match="negative"):
            gather(small_geometry, pool, [-1])

    def test_duplicate_scatter_target(self, small_geometry: Geometry) -> None:
        pool = alloc_pool(small_geometry, 4)
        objs = np.zeros((2, small_geometry.block_bytes), np.uint8)
        with pytest.raises(LayoutError, match="twice"):
            scatter(small_geometry, objs, [1, 1], pool)

    def test_wrong_pool_size(self, small_geometry: Geometry) -> None:
        with pytest.raises(BufferError, match="multiple of"):
            gather(small_geometry, np.zeros(small_geometry.block_bytes + 1, np.uint8), [0])

    def test_wrong_object_size(self, small_geometry: Geometry) -> None:
        pool = alloc_pool(small_geometry, 4)
        with pytest.raises(BufferError, match="expected 2 blocks"):
            scatter(small_geometry, np.zeros((2, 10), np.uint8), [0, 1], pool)

    def test_non_contiguous(self, small_geometry: Geometry) -> None:
        pool = alloc_pool(small_geometry, 4)
        objs = np.zeros((2, 2 * small_geometry.block_bytes), np.uint8)[:, ::2]
        with pytest.raises(BufferError, match="C-contiguous"):
            scatter(small_geometry, objs, [0, 1], pool)

    def test_read_only_output(self, small_geometry: Geometry) -> None:
        pool = alloc_pool(small_geometry, 4)
        out = np.zeros((1, small_geometry.block_bytes), np.uint8)
        out.flags.writeable = False
        with pytest.raises(BufferError, match="read-only"):
            gather(small_geometry, pool, [0], out)

    def test_pool_aliasing_objects(self, small_geometry: Geometry) -> None:
        pool = alloc_pool(small_geometry, 4)
        view = pool[: small_geometry.block_bytes].reshape(1, -1)
        with pytest.raises(BufferError, match="share memory"):
            gather(small_geometry, pool, [1], view)

    def test_float_block_ids(self, small_geometry: Geometry) -> None:
        pool = alloc_pool(small_geometry, 4)
        with pytest.raises(LayoutError, match="dtype"):
            gather(small_geometry, pool, [0.5])

    def test_bad_threads_and_blocks(self, small_geometry: Geometry) -> None:
        with pytest.raises(LayoutError):
            Copier(-1)
        with pytest.raises(LayoutError):
            alloc_pool(small_geometry, 0)

    def test_all_errors_are_kvtier_errors(self, small_geometry: Geometry) -> None:
        with pytest.raises(KvtierError):
            kvtier.layout.gather(small_geometry, np.zeros(3, np.uint8), [0])
