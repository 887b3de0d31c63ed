from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier
from kvtier import _core
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


INLINE_BYTES_MAX = 512 * 2**10  # kvtier_core::parallel: smaller copies run on the caller's thread


@pytest.mark.parametrize(
    "g",
    [
        Geometry(4, 2, 64, "bf16", 16),  # 32 KiB blocks
        Geometry(3, 3, 40, "fp16", 7, (ExtraGroup("state", 1001),)),  # odd sizes, an extra group
        Geometry(1, 1, 8, "fp8_e4m3", 3, (ExtraGroup("a", 5), ExtraGroup("b", 3))),  # tiny blocks
    ],
)
def test_threaded_copies_above_the_inline_threshold_match_one_thread(g: Geometry) -> None:
    # Above INLINE_BYTES_MAX (and over two 1 MiB copy batches) Copier(2) really uses its workers;
    # it must move exactly the bytes Copier(1) and the layout formulas do.
    count = -(-(3 * 2**20) // g.block_bytes)  # ~3 MiB of objects
    num_blocks = count + 5
    assert count * g.block_bytes > 2 * max(INLINE_BYTES_MAX, 2**20)
    rng = np.random.default_rng(g.block_bytes)
    ids = rng.permutation(num_blocks)[:count]
    objects = rng.integers(0, 256, (count, g.block_bytes), dtype=np.uint8)
    before = rng.integers(0, 256, g.pool_bytes(num_blocks), dtype=np.uint8)
    pools = {}
    for threads in (1, 2):
        pool = before.copy()
        Copier(threads).scatter(g, objects, ids, pool)
        pools[threads] = pool
    assert np.array_equal(pools[1], pools[2]), "threaded scatter differs from one thread"
    for b in rng.choice(count, 16, replace=False):
        assert np.array_equal(reference_object(g, pools[2], int(ids[b]), num_blocks), objects[b])
    for b in sorted(set(range(num_blocks)) - set(ids.tolist())):
        ref = reference_object(g, before, b, num_blocks)
        assert np.array_equal(reference_object(g, pools[2], b, num_blocks), ref)
    one = Copier(1).gather(g, pools[2], ids)
    two = Copier(2).gather(g, pools[2], ids)
    assert np.array_equal(one, two), "threaded gather differs from one thread"
    assert np.array_equal(two, objects)


def test_block_ids_may_be_a_view_of_the_written_buffer(small_geometry: Geometry) -> None:
    # The ids are copied before the copy runs: reading them from bytes being overwritten must give
    # the same result as a separate copy of the ids.
    g = small_geometry
    rng = np.random.default_rng(5)
    num_blocks = 6
    before = rng.integers(0, 256, g.pool_bytes(num_blocks), dtype=np.uint8)
    objects = rng.integers(0, 256, (3, g.block_bytes), dtype=np.uint8)
    pool = before.copy()
    ids = pool[:24].view(np.uint64)  # the first bytes of block 0, which the scatter overwrites
    ids[:] = [0, 4, 2]
    expected = pool.copy()
    Copier(1).scatter(g, objects, ids.copy(), expected)
    Copier(1).scatter(g, objects, ids, pool)
    assert np.array_equal(pool, expected)

    out = np.zeros((3, g.block_bytes), np.uint8)
    ids = out.reshape(-1)[:24].view(np.uint64)  # the gather overwrites these bytes first
    ids[:] = [5, 1, 3]
    expected_out = Copier(1).gather(g, before, ids.copy())
    Copier(1).gather(g, before, ids, out)
    assert np.array_equal(out, expected_out)
    assert np.array_equal(out[0], reference_object(g, before, 5, num_blocks))


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


def test_the_core_copier_bounds_its_threads_itself() -> None:
    """``_core.Copier`` took its thread count as given: past ``layout.Copier``'s bound it spawned
    every thread asked for (2**40 never returned)."""
    with pytest.raises(LayoutError, match=r"threads is 257; expected an int in \[0, 256\]"):
        _core.Copier(257)
    assert _core.Copier(256).threads == 256
