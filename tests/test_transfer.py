"""kvtier.TransferEngine and kvtier.DuplexEngine over numpy pools: correct bytes, per-block
outcomes, layerwise waits, cancellation, bounds and bad input."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier
from kvtier import layout
from kvtier.errors import BufferError, ConfigError, NamespaceError
from kvtier.keys import BlockKeys
from kvtier.testing.redis import LocalRedis
from kvtier.transfer import (
    DuplexEngine,
    TransferConfig,
    TransferEngine,
    TransferError,
    balanced_stage_workers,
)


def fp16_blocks(keys: BlockKeys, block_bytes: int) -> np.ndarray:
    """Deterministic finite fp16 values per key (quant accepts them; zstd compresses them)."""
    out = np.empty((len(keys), block_bytes), dtype=np.uint8)
    for i, k in enumerate(keys):
        rng = np.random.default_rng(k & (2**64 - 1))
        out[i] = rng.uniform(-2, 2, block_bytes // 2).astype(np.float16).view(np.uint8)
    return out


def make_store(geometry: kvtier.Geometry, blocks: int) -> kvtier.Store:
    object_bytes = (geometry.block_bytes + 64 + 4095) // 4096 * 4096
    config = kvtier.StoreConfig(
        geometry=geometry, model_id="transfer", dram=kvtier.DramConfig(capacity_bytes=blocks * object_bytes)
    )
    return kvtier.Store(config)


def make_ssd_store(
    geometry: kvtier.Geometry, blocks: int, directory: str, codec: str, backend: str | None = None
) -> kvtier.Store:
    """DRAM holds one block; every put block is written through to SSD under ``codec``."""
    object_bytes = (geometry.block_bytes + 64 + 4095) // 4096 * 4096
    config = kvtier.StoreConfig(
        geometry=geometry,
        model_id="transfer",
        dram=kvtier.DramConfig(capacity_bytes=object_bytes),
        ssd=kvtier.SsdConfig(
            directory=directory,
            capacity_bytes=(blocks + 4) * object_bytes,
            probe_bytes=0,
            write_through=True,
            promote_on_hit=False,
            codec=codec,
            codec_backend=backend,
        ),
    )
    return kvtier.Store(config)


def pool_with(geometry: kvtier.Geometry, num_blocks: int, objects: np.ndarray, ids: list[int]) -> np.ndarray:
    pool = layout.alloc_pool(geometry, num_blocks)
    layout.scatter(geometry, objects, ids, pool)
    return pool


@pytest.fixture
def geometry() -> kvtier.Geometry:
    return kvtier.Geometry(4, 2, 64, "fp16", 16)  # 32 KiB blocks


@settings(max_examples=12, deadline=None)
@given(
    n=st.integers(1, 24),
    chunk=st.integers(1, 5),
    buffers=st.integers(1, 3),
    codec=st.sampled_from([("raw", None), ("lossless", "zstd"), ("lossless", "deflate"), ("quant", None)]),
)
def test_store_then_load_round_trips(
    tmp_path_factory: pytest.TempPathFactory, n: int, chunk: int, buffers: int, codec: tuple[str, str | None]
) -> None:
    """Loads from an SSD tier storing each codec: the pipeline reads the encoded bytes and
    decodes them by the codec each object records (exact, or within quant's bound)."""
    geometry = kvtier.Geometry(3, 2, 64, "fp16", 8)
    directory = str(tmp_path_factory.mktemp("ssd"))
    store = make_ssd_store(geometry, n + 2, directory, codec[0], codec[1])
    keys = store.namespace.block_keys(range(8 * n))
    objects = fp16_blocks(keys, geometry.block_bytes)
    src_ids = list(range(n))[::-1]
    src = pool_with(geometry, n + 1, objects, src_ids)
    config = TransferConfig(chunk_blocks=chunk, buffer_chunks=buffers)
    engine = TransferEngine(store, config)
    [stored] = engine.wait([engine.submit_store(keys, src, src_ids)])
    assert stored.ok, stored.failed
    dst = layout.alloc_pool(geometry, n + 3)
    dst_ids = [n + 2 - i for i in range(n)]
    [loaded] = engine.wait(engine.submit_load(keys, dst, dst_ids))
    assert loaded.ok and loaded.kind == "load"
    chunks = (n + chunk - 1) // chunk
    assert loaded.rounds == max(1, (chunks + buffers - 1) // buffers)
    got = layout.gather(geometry, dst, dst_ids)
    read = engine.stage_stats()[0]
    if codec[0] == "quant":
        # DRAM keeps one block raw; the others are read as quant objects (about 1/4 size).
        bb = geometry.block_bytes
        assert read.stored_bytes <= bb + 0.4 * (read.bytes - bb), (read.stored_bytes, read.bytes)
        # Lossy, within the codec's bound: |x - x'| <= scale * (1/(2h) + 2^-10), h >= 7 (16 bins).
        a = objects.view(np.float16).astype(np.float32)
        b = got.view(np.float16).astype(np.float32)
        assert np.max(np.abs(a - b)) <= 2.0 * (1 / 14 + 2**-10) + 1e-3
    else:
        assert np.array_equal(got, objects)
    assert store.stats().leases_active == 0


def test_failures_are_listed_per_block(geometry: kvtier.Geometry) -> None:
    store = make_store(geometry, 16)
    keys = store.namespace.block_keys(range(16 * 8))
    objects = fp16_blocks(keys, geometry.block_bytes)
    store.put(keys[:6], objects[:6])
    assert store._core.corrupt_for_test(keys[2].to_bytes(16, "little"), 10)
    engine = TransferEngine(store, TransferConfig(chunk_blocks=2))
    pool = layout.alloc_pool(geometry, 8)
    job = engine.submit_load(keys, pool, [0, 1, 2, 3, 1, 99, 6, 7])
    [done] = engine.wait([job])
    assert done.outcomes == (
        "done",
        "done",
        "read_failed",
        "done",
        "duplicate_block",
        "bad_block_id",
        "miss",
        "miss",
    )
    assert done.failed[0] == (2, "read_failed")
    assert np.array_equal(layout.gather(geometry, pool, [3]), objects[3:4])
    assert not layout.gather(geometry, pool, [2]).any(), "a failed block is not written"
    # Negative ids are out of range too.
    [neg] = engine.wait([engine.submit_load(keys[:1], pool, [-1])])
    assert neg.outcomes == ("bad_block_id",)


def test_bad_input_is_a_clear_error(geometry: kvtier.Geometry) -> None:
    store = make_store(geometry, 8)
    keys = store.namespace.block_keys(range(32))
    engine = TransferEngine(store, TransferConfig(jobs_in_flight_max=1))
    with pytest.raises(BufferError):
        engine.submit_load(keys, np.zeros(geometry.block_bytes * 2 + 1, np.uint8), [0, 1])
    with pytest.raises(BufferError):
        engine.submit_load(keys, layout.alloc_pool(geometry, 2), [0])
    other = kvtier.Store(
        kvtier.StoreConfig(geometry=geometry, model_id="other", dram=kvtier.DramConfig(capacity_bytes=2**20))
    )
    with pytest.raises(NamespaceError):
        engine.submit_load(other.namespace.block_keys(range(16)), layout.alloc_pool(geometry, 2), [0])
    job = engine.submit_load(keys[:1], layout.alloc_pool(geometry, 2), [0])
    with pytest.raises(TransferError, match="jobs_in_flight_max"):
        engine.submit_load(keys[:1], layout.alloc_pool(geometry, 2), [1])
    assert engine.finished()[0].id == job
    with pytest.raises(TransferError, match="unknown"):
        engine.cancel(job)
    with pytest.raises(TransferError, match="unknown"):
        engine.wait([job])
    with pytest.raises(ConfigError):
        TransferConfig(stage_workers=(1, 0, 1, 1))
    assert isinstance(TransferError("x"), kvtier.KvtierError)


@pytest.mark.parametrize("bad", [True, np.bool_(True), -1, 2**64, 1.0, "1"], ids=repr)
def test_job_ids_layers_and_transfer_ids_are_ints_in_range(geometry: kvtier.Geometry, bad: object) -> None:
    """As device blocks and host slots are: a job id, a layer or a duplex transfer id from Python
    that is negative or too large was pyo3's bare OverflowError ("out of range integral type
    conversion attempted"), and True waited for job 1. Each is a TransferError naming it."""
    store = make_store(geometry, 8)
    keys = store.namespace.block_keys(range(2 * geometry.block_tokens))
    store.put(keys, fp16_blocks(keys, geometry.block_bytes))
    engine = TransferEngine(store)
    job = engine.submit_load(keys, layout.alloc_pool(geometry, 2), [0, 1])
    calls = {
        "job": [
            lambda: engine.wait(bad),  # type: ignore[arg-type]
            lambda: engine.wait([job, bad]),  # type: ignore[list-item]
            lambda: engine.wait_layer(bad, 0),  # type: ignore[arg-type]
            lambda: engine.outcomes(bad),  # type: ignore[arg-type]
            lambda: engine.cancel(bad),  # type: ignore[arg-type]
        ],
        "layer": [lambda: engine.wait_layer(job, bad)],  # type: ignore[arg-type]
    }
    duplex = DuplexEngine(
        geometry, layout.alloc_pool(geometry, 2), np.zeros((2, geometry.block_bytes), np.uint8)
    )
    calls["transfer"] = [lambda: duplex.wait(bad)]  # type: ignore[arg-type]
    for what, fns in calls.items():
        for call in fns:
            with pytest.raises(TransferError, match=f"{what} {bad!r}.*expected an int"):
                call()
    with pytest.raises(TransferError, match=f"layer {2**32} .*expected an int in"):
        engine.wait_layer(job, 2**32)
    [done] = engine.wait(np.int64(job))  # numpy ints are ints
    assert done.ok


def test_python_ints_past_int64_are_out_of_range_block_ids(geometry: kvtier.Geometry) -> None:
    """numpy makes a list holding an int past int64 a float64 or object array, and the error
    said "dtype float64" of a list of ints. Such an id is out of range like any id past the pool:
    a ``bad_block_id`` outcome in a job, a LayoutError naming it in a copy."""
    store = make_store(geometry, 8)
    keys = store.namespace.block_keys(range(2 * geometry.block_tokens))
    objects = fp16_blocks(keys, geometry.block_bytes)
    store.put(keys, objects)
    engine = TransferEngine(store)
    pool = layout.alloc_pool(geometry, 2)
    for huge in (2**63, 2**64, -(2**63) - 1):
        [done] = engine.wait(engine.submit_load(keys, pool, [huge, 1]))
        assert done.outcomes == ("bad_block_id", "done")
        with pytest.raises(kvtier.errors.LayoutError, match=rf"block id {huge} .*out of range"):
            layout.gather(geometry, pool, (1, huge))
    assert np.array_equal(layout.gather(geometry, pool, [1]), objects[1:])


def test_transfer_config_bounds_are_checked_at_construction() -> None:
    """TransferConfig checked only ``>= 1``: a value past the engine's bounds (or past u64)
    constructed, and failed later, when an engine was built from it."""
    for name, value, bound in [
        ("chunk_blocks", 4097, 4096),
        ("buffer_chunks", 1025, 1024),
        ("store_workers", 65, 64),
        ("jobs_in_flight_max", 2**20 + 1, 2**20),
        ("inflight_bytes_max", 2**64, 2**64 - 1),
        ("job_blocks_max", 2**64, 2**64 - 1),
    ]:
        with pytest.raises(ConfigError, match=rf"{name} is {value}; expected an int in \[1, {bound}\]"):
            TransferConfig(**{name: value})
    with pytest.raises(ConfigError, match=r"stage_workers\[dequantize\] is 65; expected an int in \[1, 64\]"):
        TransferConfig(stage_workers=(1, 1, 65, 1))
    TransferConfig(chunk_blocks=4096, buffer_chunks=1024, stage_workers=(64, 64, 64, 64), store_workers=64)


def test_a_job_racing_an_uncollected_one_on_a_pool_block_is_refused_naming_both(
    geometry: kvtier.Geometry,
) -> None:
    store = make_store(geometry, 8)
    keys = store.namespace.block_keys(range(4 * geometry.block_tokens))
    engine = TransferEngine(store)
    pool = layout.alloc_pool(geometry, 4)
    save = engine.submit_store(keys[:2], pool, [0, 1])
    with pytest.raises(TransferError, match=f"pool block 1 is in use by store job {save}"):
        engine.submit_load(keys[2:4], pool, [2, 1])
    other = engine.submit_store(keys[2:3], pool, [1])  # stores share a block
    [done, _] = engine.wait([save, other])
    assert done.ok
    load = engine.submit_load(keys[:2], pool, [2, 1])  # collected: the block is free again
    with pytest.raises(TransferError, match=f"pool block 2 is in use by load job {load}"):
        engine.submit_store(keys[:1], pool, [2])
    engine.submit_load(keys[:2], layout.alloc_pool(geometry, 4), [2, 1])  # another pool
    engine.wait([load])


def test_a_pool_seen_with_another_block_count_while_held_is_refused(geometry: kvtier.Geometry) -> None:
    # A view of the first half of a pool has the same base but another block count: block 0's V
    # of layer 0 there is block 4's K of layer 0 in the whole pool, so the two jobs would race.
    store = make_store(geometry, 8)
    keys = store.namespace.block_keys(range(2 * geometry.block_tokens))
    store.put(keys, fp16_blocks(keys, geometry.block_bytes))
    engine = TransferEngine(store)
    pool = layout.alloc_pool(geometry, 8)
    half = pool.reshape(-1).view(np.uint8)[: pool.nbytes // 2]
    load = engine.submit_load(keys[:1], pool, [4])
    with pytest.raises(
        TransferError, match=rf"pool of load job {load} .*laid out otherwise \(4 blocks here, 8 there"
    ):
        engine.submit_load(keys[1:], half, [0])
    assert engine.jobs() == 1
    engine.wait([load])
    engine.wait([engine.submit_load(keys[1:], half, [0])])  # collected: free again


def test_layerwise_wait_and_cancel(geometry: kvtier.Geometry) -> None:
    store = make_store(geometry, 40)
    keys = store.namespace.block_keys(range(16 * 32))
    objects = fp16_blocks(keys, geometry.block_bytes)
    store.put(keys, objects)
    engine = TransferEngine(store, TransferConfig(chunk_blocks=1, buffer_chunks=1))
    pool = layout.alloc_pool(geometry, 32)
    ids = list(range(32))
    job = engine.submit_load(keys, pool, ids)
    view = layout.kv_view(geometry, pool)
    expected = layout.kv_view(geometry, pool_with(geometry, 32, objects, ids))
    for layer in range(geometry.num_layers):
        engine.wait_layer(job, layer)
        assert np.array_equal(view[layer], expected[layer]), f"layer {layer}"
    assert engine.wait([job])[0].ok
    # Queued behind eight 32-chunk jobs (oldest jobs are read first, one buffer region), so the job
    # is still running when it is cancelled right away (as the Rust test does); one blocker was
    # not enough on a loaded machine (the thread that cancels can be descheduled that long).
    blockers = [engine.submit_load(keys, layout.alloc_pool(geometry, 32), ids) for _ in range(8)]
    big = engine.submit_load(keys, layout.alloc_pool(geometry, 32), ids)
    assert engine.cancel(big), "the job was still running"
    done, *blocked = engine.wait([big, *blockers])
    assert done.cancelled and "cancelled" in done.outcomes and all(b.ok for b in blocked)
    assert set(done.outcomes) <= {"done", "cancelled"}
    assert store.stats().leases_active == 0
    stats = {s.name: s for s in engine.stage_stats()}
    assert stats["read"].chunks >= 32 and stats["scatter"].rate_bytes_per_s > 0
    split = engine.balanced_stage_workers(6)
    assert sum(split) == 6 and split[1] == split[2] == 1  # raw codec: no decompress/dequantize work


def test_sequential_baseline_and_balance(geometry: kvtier.Geometry, tmp_path: object) -> None:
    store = make_ssd_store(geometry, 12, str(tmp_path), "lossless", "zstd")
    keys = store.namespace.block_keys(range(16 * 10))
    src = pool_with(geometry, 10, fp16_blocks(keys, geometry.block_bytes), list(range(10)))
    engine = TransferEngine(store, TransferConfig(chunk_blocks=3))
    assert engine.wait([engine.submit_store(keys, src, range(10))])[0].ok
    dst = layout.alloc_pool(geometry, 10)
    job, times = engine.load_sequential(keys, dst, range(10))
    assert job.ok and set(times) == {"read", "decompress", "dequantize", "scatter"}
    assert times["decompress"] > 0 and times["dequantize"] == 0
    assert np.array_equal(dst, src)
    w = balanced_stage_workers([4e9, 1e9, 4e9, 4e9], 8)
    assert sum(w) == 8 and w[1] == max(w)


@pytest.mark.parametrize(
    ("rates", "threads", "message"),
    [
        ([1e9] * 4, -1, r"threads is -1; expected an int >= 1"),  # was a bare OverflowError
        ([1e9] * 4, 0, r"threads is 0; expected an int >= 1"),
        ([1e9] * 4, 2**70, r"threads is 1180591620717411303424; expected an int >= 1"),
        ([1e9] * 4, True, r"threads is True"),
        ([1e9] * 4, 4.0, r"threads is 4\.0"),
        ([float("nan"), 1e9, 1e9, 1e9], 8, r"rates_bytes_per_s\[0\] is nan; expected finite bytes/s >= 0"),
        ([1e9, -1.0, 1e9, 1e9], 8, r"rates_bytes_per_s\[1\] is -1\.0"),
        ([1e9, 1e9, float("inf"), 1e9], 8, r"rates_bytes_per_s\[2\] is inf"),
        ([1e9, 1e9, 1e9, 10**400], 8, r"rates_bytes_per_s\[3\] is an int of"),
        ([1e9, 1e9, 1e9, "1e9"], 8, r"rates_bytes_per_s\[3\] is '1e9'"),
        ([1e9] * 3, 8, r"rates_bytes_per_s is \[.*\]; expected 4 stage rates"),
    ],
)
def test_balanced_stage_workers_names_a_bad_argument(
    rates: list[object], threads: object, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        balanced_stage_workers(rates, threads)  # type: ignore[arg-type]
    if len(rates) == 4 and all(isinstance(r, float) for r in rates):  # the binding checks them too
        with pytest.raises(ConfigError, match=message.split(" is ")[0] + " is "):
            kvtier._core.balanced_stage_workers(tuple(rates), threads)  # type: ignore[arg-type]


def test_balanced_stage_workers_gives_an_idle_stage_one_worker() -> None:
    # A rate of 0 is a stage that did no work (stage_stats of a raw-codec load): one worker.
    assert balanced_stage_workers([1e9, 0.0, 0.0, 1e9], 6) == (2, 1, 1, 2)
    assert balanced_stage_workers([0.0] * 4, 1) == (1, 1, 1, 1)  # fewer than 4 threads: one each


def test_duplex_preempt_and_swap_in(geometry: kvtier.Geometry) -> None:
    device = layout.alloc_pool(geometry, 4)
    host = np.zeros((4, geometry.block_bytes), np.uint8)
    engine = DuplexEngine(geometry, device, host)
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (2, geometry.block_bytes), dtype=np.uint8)
    for b in (0, 1):
        engine.write(b)
        layout.scatter(geometry, blocks[b : b + 1], [b], device)
    engine.rotate(0, 0)  # block 0 is full: eager rotation
    out_id, in_id = engine.submit_step()
    assert out_id is not None and in_id is None
    engine.wait(out_id)
    assert engine.state(0) == ("synced", 0)
    assert engine.dirty_blocks([0, 1]) == [1]
    assert engine.swap_out(0, 0) is False  # synced: preemption moves nothing
    assert engine.swap_out(1, 1) is True  # the dirty tail moves
    engine.free(0)
    engine.free(1)
    engine.swap_in(1, 1)  # reuses the block whose swap-out was queued this very step
    engine.swap_in(0, 2)
    engine.submit_step()
    engine.wait_all()
    assert np.array_equal(host[:2], blocks)
    assert np.array_equal(layout.gather(geometry, device, [1, 2]), blocks[::-1])
    with pytest.raises(TransferError):
        engine.swap_in(9, 0)
    with pytest.raises(BufferError):
        DuplexEngine(geometry, device, np.zeros(10, np.uint8))


@pytest.mark.parametrize("bad", [True, np.bool_(True), -1, 2**64, 1.0, "1"], ids=repr)
def test_duplex_block_and_slot_numbers_are_ints_in_range(geometry: kvtier.Geometry, bad: object) -> None:
    """Every device block and host slot from Python is an int >= 0: a bool is not block 1, and a
    negative or a too large one is a TransferError naming the argument (not pyo3's bare
    OverflowError); the pool is left as it was."""
    device = layout.alloc_pool(geometry, 4)
    host = np.zeros((4, geometry.block_bytes), np.uint8)
    engine = DuplexEngine(geometry, device, host)
    data = np.full(geometry.block_bytes, 9, np.uint8)
    calls = {
        "block": [
            lambda: engine.state(bad),  # type: ignore[arg-type]
            lambda: engine.write(bad),  # type: ignore[arg-type]
            lambda: engine.wait_block(bad),  # type: ignore[arg-type]
            lambda: engine.rotate(bad, 0),  # type: ignore[arg-type]
            lambda: engine.swap_out(bad, 0),  # type: ignore[arg-type]
            lambda: engine.swap_in(0, bad),  # type: ignore[arg-type]
            lambda: engine.free(bad),  # type: ignore[arg-type]
            lambda: engine.dirty_blocks([0, bad]),  # type: ignore[list-item]
            lambda: engine.swap_out_per_segment([(bad, 0)]),  # type: ignore[list-item]
            lambda: engine.read_block(bad),  # type: ignore[arg-type]
            lambda: engine.write_block(bad, data),  # type: ignore[arg-type]
        ],
        "slot": [
            lambda: engine.rotate(0, bad),  # type: ignore[arg-type]
            lambda: engine.swap_out(0, bad),  # type: ignore[arg-type]
            lambda: engine.swap_in(bad, 0),  # type: ignore[arg-type]
            lambda: engine.swap_out_per_segment([(0, bad)]),  # type: ignore[list-item]
        ],
    }
    for what, fns in calls.items():
        for call in fns:
            with pytest.raises(TransferError, match=f"{what} {bad!r}.*expected an int"):
                call()
    engine.wait_all()
    assert not device.any() and not host.any()
    engine.write_block(np.int64(1), data)  # numpy ints are ints
    assert engine.state(np.uint8(1)) == ("dirty", None)


def test_threads_submit_and_collect_concurrently(geometry: kvtier.Geometry) -> None:
    import threading

    store = make_store(geometry, 16)
    keys = store.namespace.block_keys(range(16 * 8))
    store.put(keys, fp16_blocks(keys, geometry.block_bytes))
    engine = TransferEngine(store, TransferConfig(chunk_blocks=2, jobs_in_flight_max=256))
    submitted: list[int] = []
    collected: list[int] = []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(20):
            job = engine.submit_load(keys, layout.alloc_pool(geometry, 8), range(8))
            done = engine.finished()  # collects any thread's finished jobs
            with lock:
                submitted.append(job)
                collected.extend(j.id for j in done if j.ok)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "submit/collect deadlocked"
    while engine.jobs():  # jobs not yet collected
        collected.extend(j.id for j in engine.finished() if j.ok)
    assert sorted(collected) == sorted(submitted)
    assert store.stats().leases_active == 0


@pytest.mark.parametrize("codec", [("raw", None), ("lossless", "zstd"), ("quant", None)], ids=str)
def test_pipelined_loads_from_the_remote_tier(
    tmp_path: Path, geometry: kvtier.Geometry, codec: tuple[str, str | None]
) -> None:
    """Loads from a real Redis server: the read stage fetches each value as stored (encoded
    under the remote codec, pipelined GETs) and the pipeline decodes it; a second engine on a
    fresh store (empty DRAM) reads everything from the server; with the server down the job
    lists each remote block as a miss and the DRAM block still loads."""
    if not (shutil.which("redis-server") or shutil.which("valkey-server")):
        pytest.skip("no redis-server/valkey-server installed")
    bb = geometry.block_bytes
    object_bytes = (bb + 64 + 4095) // 4096 * 4096

    def remote_store(url: str) -> kvtier.Store:
        config = kvtier.StoreConfig(
            geometry=geometry,
            model_id="transfer-remote",
            dram=kvtier.DramConfig(capacity_bytes=object_bytes),  # DRAM keeps the last block put
            remote=kvtier.RemoteConfig(
                urls=url,
                write_through=True,
                promote_on_hit=False,
                codec=codec[0],
                codec_backend=codec[1],
                reconnect_backoff_min_s=0.01,
                reconnect_backoff_max_s=0.05,
            ),
        )
        return kvtier.Store(config)

    def check(got: np.ndarray, want: np.ndarray) -> None:
        if codec[0] == "quant":
            a = want.view(np.float16).astype(np.float32)
            b = got.view(np.float16).astype(np.float32)
            assert np.max(np.abs(a - b)) <= 2.0 * (1 / 14 + 2**-10) + 1e-3
        else:
            assert np.array_equal(got, want)

    n = 10
    config = TransferConfig(chunk_blocks=3, buffer_chunks=2)
    with LocalRedis(tmp_path) as server:
        writer = remote_store(server.url)
        keys = writer.namespace.block_keys(range(16 * n))
        objects = fp16_blocks(keys, bb)
        ids = list(range(n))
        engine = TransferEngine(writer, config)
        [stored] = engine.wait([engine.submit_store(keys, pool_with(geometry, n, objects, ids), ids)])
        assert stored.ok, stored.failed
        assert list(writer.lookup(keys).tiers) == ["remote"] * (n - 1) + ["dram"]
        if codec[0] != "raw":
            assert writer.stats().remote_encoded_blocks == n
        for store in (writer, remote_store(server.url)):
            reader = TransferEngine(store, config)
            dst = layout.alloc_pool(geometry, n)
            dst_ids = ids[::-1]
            [loaded] = reader.wait([reader.submit_load(keys, dst, dst_ids)])
            assert loaded.ok, loaded.failed
            check(layout.gather(geometry, dst, dst_ids), objects)
            read = reader.stage_stats()[0]
            if codec[0] == "quant":
                assert read.stored_bytes < 0.4 * read.bytes, (read.stored_bytes, read.bytes)
            assert store.stats().leases_active == 0
        server.stop()
        dst = layout.alloc_pool(geometry, n)
        [down] = engine.wait([engine.submit_load(keys, dst, ids)])
        assert down.failed == [(i, "miss") for i in range(n)]
        [last] = engine.wait([engine.submit_load(keys[n - 1 :], dst, [0])])
        assert last.ok
        check(layout.gather(geometry, dst, [0]), objects[n - 1 :])
        assert writer.stats().leases_active == 0
