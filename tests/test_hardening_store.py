"""Hardening (issue 15) through the public API: another namespace's objects on a shared SSD pool
or Redis are plain misses that are never dropped (defect 2); existing files and links are never
taken over as SSD devices (defect 3); pool files are private and a directory every user can write
is refused (defect 4); a truncated device is named (the zero-byte case). Issue 15 review (bad input
through the API): an SSD pool read into buffers of another size is a BufferError, a load's
``out`` of the wrong shape is named as such, not as too many blocks for the lease, buffers
that share memory are named by their positions, a layer progress takes any timeout, and SSD
bandwidths as large as the config accepts place objects."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvtier
from kvtier import _core
from kvtier.errors import BufferError, ConfigError, LeaseError
from kvtier.keys import BlockKeys
from kvtier.store import LayerProgress
from kvtier.testing.redis import LocalRedis

GEOMETRY = kvtier.Geometry(2, 2, 64, "fp16", 16)  # 16 KiB blocks: whole pages
BLOCK = GEOMETRY.block_bytes
OBJECT = 5 * 4096


def ssd_store(directory: Path, model: str, **ssd: Any) -> kvtier.Store:
    config = kvtier.StoreConfig(
        geometry=GEOMETRY,
        model_id=model,
        dram=kvtier.DramConfig(capacity_bytes=2 * OBJECT),
        ssd=kvtier.SsdConfig(
            directory=str(directory), capacity_bytes="4MiB", probe_bytes=0, write_through=True, **ssd
        ),
    )
    return kvtier.Store(config)


def blocks(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, BLOCK), dtype=np.uint8)


def load_all(store: kvtier.Store, keys: BlockKeys) -> tuple[int, np.ndarray]:
    with store.lease(keys) as lease:
        out = np.zeros((lease.hit_blocks, BLOCK), dtype=np.uint8)
        return store.load(lease, out).loaded_blocks, out


# ---- defect 2: namespaces on shared tiers ---------------------------------------------------


def test_defect2_another_models_keys_on_a_shared_pool_are_misses_and_survive(tmp_path: Path) -> None:
    """The reported reproduction: model B given model A's raw keys saw 8 SSD hits, refused them as
    checksum failures at load and deleted A's 8 valid objects."""
    a = ssd_store(tmp_path, "model-a")
    keys_a = a.namespace.block_keys(range(8 * 16))
    objects = blocks(8, seed=1)
    assert a.put(keys_a, objects).stored == 8
    a.flush()
    del a
    b = ssd_store(tmp_path, "model-b")
    forged = BlockKeys(b.namespace.hash, keys_a.raw)
    assert b.lookup(forged).hit_blocks == 0
    assert load_all(b, forged)[0] == 0
    b.put(forged, blocks(8, seed=2))  # B's own bytes under those keys: never over A's
    b.flush()
    assert b.stats().checksum_failures == 0
    assert "ssd" not in b.lookup(forged).tiers
    del b
    a = ssd_store(tmp_path, "model-a")
    assert a.lookup(keys_a).tiers == ("ssd",) * 8
    loaded, out = load_all(a, keys_a)
    assert loaded == 8 and np.array_equal(out, objects)
    del a


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[LocalRedis]:
    with LocalRedis(tmp_path / "redis") as server:
        yield server


def test_defect2_another_models_keys_on_a_shared_redis_are_misses(redis: LocalRedis) -> None:
    def store(model: str) -> kvtier.Store:
        return kvtier.Store(
            kvtier.StoreConfig(
                geometry=GEOMETRY,
                model_id=model,
                dram=kvtier.DramConfig(capacity_bytes=2 * OBJECT),
                remote=kvtier.RemoteConfig(urls=redis.url),
            )
        )

    a = store("model-a")
    keys_a = a.namespace.block_keys(range(4 * 16))
    objects = blocks(4, seed=3)
    a.put(keys_a, objects)
    a.flush()
    b = store("model-b")
    forged = BlockKeys(b.namespace.hash, keys_a.raw)
    assert b.lookup(forged).hit_blocks == 0
    b.put(forged, blocks(4, seed=4))
    b.flush()
    fresh_a = store("model-a")  # an empty DRAM: everything from the server
    loaded, out = load_all(fresh_a, keys_a)
    assert loaded == 4 and np.array_equal(out, objects)


# ---- defect 3: existing files and links as devices -----------------------------------------


def test_defect3_a_file_of_other_data_is_refused_untouched(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    pool.mkdir(mode=0o700)
    victim = tmp_path / "data.bin"
    data = os.urandom(10_000)
    victim.write_bytes(data)
    with pytest.raises(ConfigError, match=r"holding other data.*ssd\.format_devices"):
        ssd_store(pool, "m", devices=[str(victim)])
    assert victim.read_bytes() == data, "the file was written"
    store = ssd_store(pool, "m", devices=[str(victim)], format_devices=True)
    keys = store.namespace.block_keys(range(16))
    assert store.put(keys, blocks(1, seed=5)).stored == 1
    del store


def test_defect3_a_device_link_in_the_pool_directory_is_never_followed(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    pool.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"")
    (pool / "device-0.kvtd").symlink_to(victim)
    with pytest.raises(ConfigError, match="symbolic link"):
        ssd_store(pool, "m")
    assert victim.stat().st_size == 0, "the link's target was written"


# ---- defect 4: file modes -------------------------------------------------------------------


def test_defect4_pool_files_are_private_under_any_umask(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    pool.mkdir(mode=0o700)
    old = os.umask(0)
    try:
        store = ssd_store(pool, "m")
        store.put(store.namespace.block_keys(range(16)), blocks(1, seed=6))
        store.flush()
        del store
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in pool.iterdir()}
    assert {"lock", "index.log", "device-0.kvtd"} <= set(modes)
    assert all(mode == 0o600 for mode in modes.values()), modes


def test_defect4_a_pool_directory_every_user_can_write_is_refused(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    pool.mkdir()
    pool.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by every user"):
        ssd_store(pool, "m")
    assert list(pool.iterdir()) == [], "nothing may be created there"


# ---- also seen: a zero-byte device ----------------------------------------------------------


def test_a_truncated_device_is_named_not_an_io_error(tmp_path: Path) -> None:
    ssd_store(tmp_path, "m")  # created, then dropped: the pool is closed
    (tmp_path / "device-0.kvtd").write_bytes(b"")
    with pytest.raises(ConfigError, match="0 bytes, too short to hold its superblock"):
        ssd_store(tmp_path, "m")


# ---- review: buffers of the wrong size or shape ---------------------------------------------


def test_an_ssd_pool_read_into_buffers_of_another_size_is_a_buffer_error(tmp_path: Path) -> None:
    """``_core.SsdPool.get`` (the SSD tier alone, as ``kvtier bench ssd`` uses it) with an
    ``object_bytes`` other than the stored objects' was a Rust assertion: a PanicException (a
    BaseException, past every ``except Exception``) that left the objects pinned. It is refused
    before any read, naming both sizes, and the pool serves the objects as before."""
    pool = _core.SsdPool({"directory": str(tmp_path), "capacity_bytes": 2**22, "probe_bytes": 0})
    namespace, raw = bytes(range(16)), bytes(range(32, 64))
    objects = blocks(2, seed=8)
    assert pool.put(namespace, raw, objects, BLOCK)[0] == 2
    for size in (BLOCK - 1, BLOCK + 4096, 16):
        out = np.zeros((2, size), np.uint8)
        with pytest.raises(
            BufferError, match=rf"read buffer 0 holds {size} bytes; the stored object holds {BLOCK} bytes"
        ):
            pool.get(namespace, raw, out, size)
        assert not out.any()
    out = np.zeros_like(objects)
    assert pool.get(namespace, raw, out, BLOCK) == ["loaded", "loaded"]
    assert np.array_equal(out, objects)
    assert pool.metrics()["pinned_objects"] == 0
    pool.check_integrity()


def test_a_flat_or_transposed_out_is_named_as_the_wrong_shape(tmp_path: Path) -> None:
    """``Store.load`` counted the rows of ``out`` before checking that they are blocks: a flat
    buffer of the right size (a bytearray, a 1-D array) or a transposed shape was reported as a
    LeaseError ("asked to load 49152 blocks; lease holds 3"), which names the wrong problem."""
    store = ssd_store(tmp_path, "m")
    keys = store.namespace.block_keys(range(48))
    store.put(keys, blocks(3, seed=9))
    with store.lease(keys) as lease:
        for out in (bytearray(3 * BLOCK), np.zeros(3 * BLOCK, np.uint8), np.zeros((BLOCK, 3), np.uint8)):
            with pytest.raises(BufferError, match=rf"out .*shape.*expected .*\(n, {BLOCK}\)"):
                store.load(lease, out)
        with pytest.raises(LeaseError, match="holds 3"):
            store.load(lease, np.zeros((4, BLOCK), np.uint8))


def test_buffers_that_share_memory_are_named_by_position(tmp_path: Path) -> None:
    """Every writable buffer must be the only view of its bytes; the error said "out and out share
    memory" (or "pool region and pool region"), not which two."""
    store = ssd_store(tmp_path, "m")
    keys = store.namespace.block_keys(range(48))
    store.put(keys, blocks(3, seed=10))
    out = np.zeros((3, BLOCK), np.uint8)
    flat = out.reshape(-1)
    with store.lease(keys) as lease:
        with pytest.raises(BufferError, match=r"out 0 and out 2 share memory"):
            store.load(lease, [out[0], out[1], flat[100 : 100 + BLOCK]])
        with pytest.raises(BufferError, match=r"out 1 and out 2 share memory"):
            store.load(lease, [out[2], out[0], out[0]])
        seg = BLOCK // 4  # 2 layers: K and V regions of a quarter block each
        regions = [np.zeros((4, seg), np.uint8) for _ in range(3)]
        pool = kvtier.layout.PagedPool([[regions[0], regions[1]], [regions[2], regions[1]]])
        with pytest.raises(BufferError, match=r"pool region 1 and pool region 3 share memory"):
            store.load_into_pool(lease, pool, [0])
    assert not out.any() and not any(r.any() for r in regions)


def test_a_progress_wait_takes_any_timeout_and_names_a_bad_layer() -> None:
    """``LayerProgress.wait(layer, timeout_s=1e19)`` panicked ("overflow when adding duration to
    instant": a PanicException, past every ``except Exception``), even on a closed progress; inf
    was refused as not "seconds >= 0"; a negative layer was a bare OverflowError and True was
    layer 1. A timeout past what the clock holds waits as None does."""
    closed = LayerProgress()
    closed.close()  # a closed progress never blocks
    for timeout in (1e19, 1.8e19, float("inf")):
        assert closed.wait(0, timeout_s=timeout)
    progress = LayerProgress()
    assert not progress.wait(0, timeout_s=0.0)
    for timeout in (float("nan"), -1.0):
        with pytest.raises(BufferError, match=r"timeout_s is .*expected seconds >= 0"):
            progress.wait(0, timeout_s=timeout)
    for layer in (-1, 2**64, True):
        with pytest.raises(BufferError, match=rf"layer {layer!r} .*expected an int >= 0"):
            progress.wait(layer, timeout_s=0.0)


def placed(directory: Path, bandwidths: list[float]) -> list[int]:
    """Objects per device of a two-device SSD tier with ``bandwidths`` after a put of 8 blocks
    (written through, several at once), each loaded back exactly."""
    directory.mkdir(mode=0o700)
    config = kvtier.StoreConfig(
        geometry=GEOMETRY,
        model_id="m",
        dram=kvtier.DramConfig(capacity_bytes=OBJECT),
        ssd=kvtier.SsdConfig(
            directory=str(directory),
            devices=[str(directory / "dev-a"), str(directory / "dev-b")],
            capacity_bytes="4MiB",
            probe_bytes=0,
            write_through=True,
            bandwidth_bytes_per_s=bandwidths,
        ),
    )
    store = kvtier.Store(config)
    keys = store.namespace.block_keys(range(8 * 16))
    objects = blocks(8, seed=11)
    assert store.put(keys, objects).written.ssd == 8
    loaded, out = load_all(store, keys)
    assert loaded == 8 and np.array_equal(out, objects)
    return [d["objects"] for d in store.ssd_metrics()["devices"]]  # type: ignore[index]


@pytest.mark.parametrize(
    ("bandwidths", "same_as"),
    [([1e300, 1e300], [1e9, 1e9]), ([2e38, 2e38], [1e9, 1e9]), ([1.7e308, 1.0], [2.0**53, 1.0])],
    ids=str,
)
def test_bandwidths_as_large_as_the_config_takes_place_objects(
    tmp_path: Path, bandwidths: list[float], same_as: list[float]
) -> None:
    """``ssd.bandwidth_bytes_per_s`` takes any positive float; Algorithm 1 rounded each to a u128
    (1e300 saturates) and summed them: the sum wrapped, so a put writing several blocks at once
    panicked ("flooring loses less than one object per device", a PanicException), and
    [1.7e308, 1.0] wrapped to 0, read as a failed probe (equal shares). They place as the same
    ratios at a real device's scale do."""
    assert placed(tmp_path / "huge", bandwidths) == placed(tmp_path / "same", same_as)
