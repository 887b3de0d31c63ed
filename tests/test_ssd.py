"""The SSD tier through the public API: config validation, DRAM → SSD write-back, promotion,
admission, leases over SSD blocks, corruption on disk, restart, placement, metrics."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvtier
from kvtier import _core
from kvtier.errors import ConfigError
from kvtier.keys import BlockKeys
from kvtier.sched.unified_pool import bandwidth_aware_counts

GEOMETRY = kvtier.Geometry(2, 2, 64, "fp16", 16)  # 16 KiB blocks: whole pages
BLOCK = GEOMETRY.block_bytes
OBJECT = 5 * 4096  # a block in DRAM: payload + 64-byte header, rounded up to pages


def payloads(keys: BlockKeys) -> np.ndarray:
    out = np.empty((len(keys), BLOCK), dtype=np.uint8)
    for i, k in enumerate(keys):
        out[i] = np.random.default_rng(k & (2**64 - 1)).integers(0, 256, BLOCK, dtype=np.uint8)
    return out


def make_store(directory: Path, dram_blocks: int = 4, **ssd: Any) -> kvtier.Store:
    """A store with ``dram_blocks`` blocks of DRAM over an SSD tier in ``directory``; ``ssd`` are
    further keys of its SSD section."""
    config = kvtier.StoreConfig(
        geometry=GEOMETRY,
        model_id="ssd-test",
        dram=kvtier.DramConfig(capacity_bytes=dram_blocks * OBJECT),
        ssd={"directory": str(directory), "capacity_bytes": "4MiB", "probe_bytes": 0, **ssd},
    )
    return kvtier.Store(config)


def put_prompt(store: kvtier.Store, first: int, blocks: int) -> tuple[BlockKeys, np.ndarray]:
    keys = store.namespace.block_keys(range(first, first + 16 * blocks))
    objects = payloads(keys)
    report = store.put(keys, objects)
    assert report.stored + report.already_present == blocks
    return keys, objects


def load_all(store: kvtier.Store, keys: BlockKeys) -> tuple[kvtier.LoadReport, np.ndarray]:
    with store.lease(keys) as lease:
        out = np.zeros((lease.hit_blocks, BLOCK), dtype=np.uint8)
        return store.load(lease, out), out


# ---- configuration --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"ssd": {"devices": ["/tmp/a"]}}, "`ssd.directory` is missing"),
        ({"ssd": {"directory": "/tmp", "devices": ["/a", "/a"]}}, "lists a device or file twice"),
        ({"ssd": {"directory": "/tmp", "devices": "/a"}}, "expected a list of device or file paths"),
        ({"ssd": {"directory": "/tmp", "devices": [""]}}, "expected non-empty paths"),
        ({"ssd": {"directory": ""}}, "`ssd.directory` is ''"),
        ({"ssd": {"directory": "/tmp", "capacity_bytes": 4096}}, "expected at least one 16384-byte object"),
        (
            {"ssd": {"directory": "/tmp", "devices": ["/a", "/b"], "capacity_bytes": 30000}},
            "per device (2 x 16384",
        ),
        ({"ssd": {"directory": "/tmp", "durability": "sync"}}, "`ssd.durability` is 'sync'"),
        ({"ssd": {"directory": "/tmp", "placement": "random"}}, "['bandwidth', 'round_robin']"),
        ({"ssd": {"directory": "/tmp", "io_engine": "aio"}}, "`ssd.io_engine`"),
        ({"ssd": {"directory": "/tmp", "admission_k": 0}}, "`ssd.admission_k` is 0"),
        ({"ssd": {"directory": "/tmp", "io_depth": 0}}, "`ssd.io_depth` is 0"),
        ({"ssd": {"directory": "/tmp", "probe_bytes": "8GiB"}}, "`ssd.probe_bytes`"),
        (
            {"ssd": {"directory": "/tmp", "bandwidth_bytes_per_s": [1e9, 2e9]}},
            "one number of bytes/s per device (1)",
        ),
        (
            {"ssd": {"directory": "/tmp", "bandwidth_bytes_per_s": [-1.0]}},
            "`ssd.bandwidth_bytes_per_s[0]` is -1.0",
        ),
        ({"ssd": {"directory": "/tmp", "write_through": "yes"}}, "`ssd.write_through` is 'yes'"),
        ({"ssd": {"directory": "/tmp", "direct_io": 1}}, "`ssd.direct_io` is 1"),
    ],
)
def test_bad_ssd_settings_are_config_errors(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        kvtier.StoreConfig(geometry=GEOMETRY, **fields)
    assert message in str(info.value)


def test_flat_ssd_devices_without_a_directory_is_a_config_error() -> None:
    """The deprecated flat spelling, as before the sections: ``ssd_devices`` needs ``ssd_directory``."""
    with (
        pytest.warns(DeprecationWarning, match=r"`ssd_devices` is deprecated .*use `ssd\.devices`"),
        pytest.raises(ConfigError, match="`ssd_devices` is set but `ssd_directory` is None"),
    ):
        kvtier.StoreConfig(geometry=GEOMETRY, ssd_devices=["/tmp/a"])


def test_ssd_config_round_trips_through_dict_and_yaml(tmp_path: Path) -> None:
    config = kvtier.StoreConfig(
        geometry=GEOMETRY,
        ssd={
            "directory": tmp_path,  # a Path is accepted and stored as str
            "devices": [str(tmp_path / "a"), str(tmp_path / "b")],
            "capacity_bytes": "64MiB",
            "durability": "fsync",
            "bandwidth_bytes_per_s": [3e9, 1e9],
        },
    )
    assert config.ssd is not None
    assert config.ssd.directory == str(tmp_path)
    assert config.ssd.devices == (str(tmp_path / "a"), str(tmp_path / "b"))
    assert config.ssd.capacity_bytes == 64 * 2**20
    assert kvtier.StoreConfig.from_dict(config.to_dict()) == config
    path = tmp_path / "store.yaml"
    path.write_text(
        "store:\n"
        "  geometry: {num_layers: 2, num_kv_heads: 2, head_dim: 64, dtype: fp16, block_tokens: 16}\n"
        "  ssd:\n"
        f"    directory: {tmp_path}\n"
        "    capacity_bytes: 1GiB\n"
        "    placement: round_robin\n"
        "    admission_k: 2\n"
    )
    loaded = kvtier.StoreConfig.from_yaml(path).ssd
    assert loaded is not None
    assert (loaded.capacity_bytes, loaded.placement, loaded.admission_k) == (
        2**30,
        "round_robin",
        2,
    )
    assert kvtier.StoreConfig(geometry=GEOMETRY).ssd is None


def test_missing_unwritable_and_busy_directories(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"does not exist|No such file") as info:
        make_store(tmp_path / "missing")
    assert "expected an existing, writable directory" in str(info.value)
    if os.geteuid() == 0:
        unwritable = Path("/sys")  # root ignores permission bits; sysfs refuses new files
    else:
        unwritable = tmp_path / "ro"
        unwritable.mkdir()
        unwritable.chmod(0o500)
    with pytest.raises(ConfigError, match="is not writable"):
        make_store(unwritable, devices=[str(tmp_path / "dev")])
    first = make_store(tmp_path)
    with pytest.raises(ConfigError, match="in use by another store"):
        make_store(tmp_path)
    del first


def test_a_device_file_the_disk_cannot_hold_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no space left on device"):
        make_store(tmp_path, capacity_bytes=2**50)
    assert not list(tmp_path.glob("*.kvtd")) or all(p.stat().st_blocks == 0 for p in tmp_path.glob("*.kvtd"))


def test_failed_probe_means_equal_shares_and_a_logged_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    devices = [str(tmp_path / "a"), str(tmp_path / "b")]
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        store = make_store(tmp_path, devices=devices, capacity_bytes="2MiB", probe_bytes="8MiB")
    assert any("placing objects in equal shares" in r.getMessage() for r in caplog.records)
    metrics = store.ssd_metrics()
    assert metrics is not None and metrics["bandwidth_source"].startswith("equal (probe failed")


# ---- the hierarchy --------------------------------------------------------------------------


def test_write_back_lookup_tiers_load_and_promotion(tmp_path: Path) -> None:
    store = make_store(tmp_path, dram_blocks=4)
    keys, objects = put_prompt(store, 0, 12)
    assert store.lookup(keys).tiers == ("ssd",) * 8 + ("dram",) * 4
    stats = store.stats()
    assert (stats.demoted_blocks, stats.admission_skipped, stats.dropped_evictions) == (8, 0, 0)
    report, out = load_all(store, keys[:2])
    assert report == kvtier.LoadReport(2, 0)
    assert np.array_equal(out, objects[:2])
    assert store.stats().promoted_blocks == 2
    assert store.lookup(keys[:2]).tiers == ("dram", "dram")
    report, out = load_all(store, keys)
    assert report.loaded_blocks == 12 and np.array_equal(out, objects)
    tiers = store.tier_stats()
    assert list(tiers) == ["dram", "ssd"]
    assert all(t.used_bytes <= t.capacity_bytes for t in tiers.values())
    store.check_integrity()


def test_admission_needs_k_accesses(tmp_path: Path) -> None:
    store = make_store(tmp_path, dram_blocks=4, admission_k=2)
    a, _ = put_prompt(store, 0, 4)
    with store.lease(a):
        pass  # a second access of each block of a
    b, _ = put_prompt(store, 10_000, 4)  # a leaves DRAM: admitted
    put_prompt(store, 20_000, 4)  # b leaves DRAM with one access: dropped
    assert store.lookup(a).tiers == ("ssd",) * 4
    assert store.lookup(b).hit_blocks == 0
    assert (store.stats().demoted_blocks, store.stats().admission_skipped) == (4, 4)


def test_leases_cover_ssd_blocks_and_capacity_holds(tmp_path: Path) -> None:
    store = make_store(tmp_path, dram_blocks=2, capacity_bytes=4 * BLOCK, promote_on_hit=False)
    keys, objects = put_prompt(store, 0, 6)
    assert store.lookup(keys[:4]).tiers == ("ssd",) * 4
    with store.lease(keys[:4]) as lease:
        for round_ in range(1, 6):
            put_prompt(store, round_ * 10_000, 4)
            assert all(t.used_bytes <= t.capacity_bytes for t in store.tier_stats().values())
        assert store.stats().demotion_failed > 0  # SSD full of leased blocks
        out = np.zeros((4, BLOCK), dtype=np.uint8)
        assert store.load(lease, out).loaded_blocks == 4
    assert np.array_equal(out, objects[:4])
    store.check_integrity()


def test_flipped_byte_on_disk_is_a_counted_miss(tmp_path: Path) -> None:
    store = make_store(tmp_path, dram_blocks=2)
    keys, objects = put_prompt(store, 0, 6)
    assert store.lookup(keys).tiers[:4] == ("ssd",) * 4
    device = tmp_path / "device-0.kvtd"
    data = bytearray(device.read_bytes())
    at = data.find(objects[1][:256].tobytes())  # block 1's payload, found on the raw device
    assert at > 0 and at % 4096 == 0
    with open(device, "r+b") as f:
        f.seek(at + 1000)
        f.write(bytes([data[at + 1000] ^ 0x40]))
        f.flush()
        os.fsync(f.fileno())
    report, out = load_all(store, keys)
    assert (report.loaded_blocks, report.checksum_failures) == (1, 1)
    assert np.array_equal(out[0], objects[0])
    assert store.stats().checksum_failures == 1
    assert store.lookup(keys).hit_blocks == 1  # dropped: the prefix ends before it
    metrics = store.ssd_metrics()
    assert metrics is not None and metrics["checksum_failures"] == 1
    store.check_integrity()


def _unaligned(objects: np.ndarray) -> np.ndarray:
    """A copy of ``objects`` 16 bytes past a page boundary (as a caller's buffer often is)."""
    raw = np.empty(objects.nbytes + 4096 + 16, dtype=np.uint8)
    start = -raw.ctypes.data % 4096 + 16
    out = raw[start : start + objects.nbytes].reshape(objects.shape)
    out[:] = objects
    return out


def _flip_on_device(directory: Path, payload: np.ndarray) -> None:
    device = directory / "device-0.kvtd"
    data = bytearray(device.read_bytes())
    at = data.find(payload[:256].tobytes())
    assert at > 0 and at % 4096 == 0
    with open(device, "r+b") as f:
        f.seek(at + 1000)
        f.write(bytes([data[at + 1000] ^ 0x40]))
        os.fsync(f.fileno())


@pytest.mark.parametrize(("durability", "direct_io"), [("none", True), ("fsync", True), ("none", False)])
def test_write_through_from_dram_pages_and_caller_buffers(
    tmp_path: Path, durability: str, direct_io: bool
) -> None:
    """Write-through writes the copies DRAM holds from their pages and the rest (DRAM full of
    leased blocks) from the caller's unaligned buffers; a fresh store reads every one back
    (O_DIRECT), and a byte flipped on the device is refused."""
    opts = {"write_through": True, "durability": durability, "direct_io": direct_io}
    store = make_store(tmp_path, dram_blocks=4, **opts)
    a_keys = store.namespace.block_keys(range(0, 16 * 4))
    a = payloads(a_keys)
    assert store.put(a_keys, _unaligned(a)).stored == 4
    assert store.stats().written_through == 4
    b_keys = store.namespace.block_keys(range(1000, 1000 + 16 * 3))
    b = payloads(b_keys)
    with store.lease(a_keys) as lease:  # DRAM full and pinned: B cannot go there
        assert lease.hit_blocks == 4
        report = store.put(b_keys, _unaligned(b))
    assert report.stored == 3 and store.stats().written_through == 7
    assert store.lookup(b_keys).tiers == ("ssd",) * 3
    metrics = store.ssd_metrics()
    assert metrics is not None and metrics["devices"][0]["bytes_written"] == 7 * BLOCK
    assert metrics["devices"][0]["direct_io"] is direct_io
    del lease, store  # the lease holds the store: both go, so the directory's lock is released
    again = make_store(tmp_path, dram_blocks=8)  # O_DIRECT reads, DRAM empty
    assert again.lookup(a_keys).tiers == ("ssd",) * 4
    for keys, objects in ((a_keys, a), (b_keys, b)):
        report, out = load_all(again, keys)
        assert report.loaded_blocks == len(objects) and np.array_equal(out, objects)
    del again
    _flip_on_device(tmp_path, a[1])
    third = make_store(tmp_path, dram_blocks=8)
    report, out = load_all(third, a_keys)
    assert (report.loaded_blocks, report.checksum_failures) == (1, 1)
    assert np.array_equal(out[0], a[0]) and third.lookup(a_keys).hit_blocks == 1
    third.check_integrity()


def test_a_corrupt_dram_copy_written_through_is_refused_from_ssd(tmp_path: Path) -> None:
    """Write-through writes the DRAM copy with the checksum DRAM recorded (no second pass over
    it): a DRAM bit flip reaches SSD flagged, and a read from SSD refuses it, never serves it."""
    opts = {"capacity_bytes": 4 * BLOCK, "write_through": True}
    store = make_store(tmp_path, dram_blocks=8, **opts)
    a_keys, a = put_prompt(store, 0, 4)
    put_prompt(store, 1000, 4)  # SSD holds 4 objects: A leaves it, stays in DRAM
    metrics = store.ssd_metrics()
    assert metrics is not None and metrics["evictions"] == 4
    assert store._corrupt_for_test(a_keys[1], 1000)
    assert store.put(a_keys, a).already_present == 4  # in DRAM: written through from its pages
    del store
    fresh = make_store(tmp_path, dram_blocks=8, capacity_bytes=4 * BLOCK)
    assert fresh.lookup(a_keys).tiers == ("ssd",) * 4
    report, out = load_all(fresh, a_keys)
    assert (report.loaded_blocks, report.checksum_failures) == (1, 1)
    assert np.array_equal(out[0], a[0])
    fresh.check_integrity()


def test_a_restarted_store_recovers_from_the_index_log(tmp_path: Path) -> None:
    store = make_store(tmp_path, dram_blocks=4, write_through=True, durability="fsync")
    keys, objects = put_prompt(store, 0, 10)
    del store
    again = make_store(tmp_path, dram_blocks=4, write_through=True, durability="fsync")
    metrics = again.ssd_metrics()
    assert metrics is not None and metrics["recovery"]["recovered_objects"] == 10
    assert again.lookup(keys).tiers == ("ssd",) * 10
    report, out = load_all(again, keys)
    assert report.loaded_blocks == 10 and np.array_equal(out, objects)
    again.check_integrity()


def test_bandwidth_placement_over_two_devices_and_metrics(tmp_path: Path) -> None:
    devices = [str(tmp_path / "fast.kvtd"), str(tmp_path / "slow.kvtd")]
    store = make_store(tmp_path, dram_blocks=8, devices=devices, bandwidth_bytes_per_s=[3e9, 1e9])
    put_prompt(store, 0, 16)  # the first 8 go to SSD in one demotion batch: 6 and 2
    metrics = store.ssd_metrics()
    assert metrics is not None
    assert [d["objects"] for d in metrics["devices"]] == [6, 2]
    assert [d["placement_share"] for d in metrics["devices"]] == [0.75, 0.25]
    fast = metrics["devices"][0]
    assert fast["bytes_written"] == 6 * BLOCK and fast["write_ops"] == 6 and fast["direct_io"]
    assert fast["write_p99_s"] >= fast["write_p50_s"] > 0
    assert metrics["engine"] in ("io_uring", "pread") and metrics["warnings"] == []


def test_odd_sized_blocks_go_through_staging(tmp_path: Path) -> None:
    geometry = kvtier.Geometry(1, 1, 40, "fp16", 3)  # 480-byte blocks: not whole pages
    config = kvtier.StoreConfig(
        geometry=geometry,
        dram=kvtier.DramConfig(capacity_bytes=2 * 4096),
        ssd=kvtier.SsdConfig(directory=str(tmp_path), capacity_bytes="1MiB"),
    )
    store = kvtier.Store(config)
    keys = store.namespace.block_keys(range(30))
    objects = (
        np.arange(len(keys) * geometry.block_bytes, dtype=np.uint32).astype(np.uint8).reshape(len(keys), -1)
    )
    store.put(keys, objects)
    assert "ssd" in store.lookup(keys).tiers
    with store.lease(keys) as lease:
        out = np.zeros_like(objects)
        assert store.load(lease, out).loaded_blocks == len(keys)
    assert np.array_equal(out, objects)


def test_concurrent_writers_and_readers(tmp_path: Path) -> None:
    store = make_store(tmp_path, dram_blocks=6, capacity_bytes=24 * BLOCK)
    errors: list[BaseException] = []

    stored = [0]

    def writer(seed: int) -> None:
        try:
            for i in range(25):
                first = (seed * 1000 + i * 7) % 400 * 16
                keys = store.namespace.block_keys(range(first, first + 64))
                report = store.put(keys, payloads(keys))
                # With DRAM this small, readers' leases can pin every block: a put is then
                # rejected (and counted), never stored over a leased block.
                assert report.stored + report.already_present + report.rejected == 4
                stored[0] += report.stored
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    def reader(seed: int) -> None:
        try:
            for i in range(40):
                keys = store.namespace.block_keys(
                    range((seed * 300 + i * 16) % 6400, (seed * 300 + i * 16) % 6400 + 64)
                )
                with store.lease(keys) as lease:
                    out = np.zeros((lease.hit_blocks, BLOCK), dtype=np.uint8)
                    loaded = store.load(lease, out).loaded_blocks
                assert np.array_equal(out[:loaded], payloads(keys)[:loaded])
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(s,)) for s in range(2)]
    threads += [threading.Thread(target=reader, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert stored[0] > 0
    assert store.stats().demoted_blocks > 0
    store.check_integrity()


# ---- Algorithm 1 ------------------------------------------------------------------------------
# Its cases are unit tests beside it (crates/kvtier-pool/src/ssd/placement.rs). Here: the
# simulator's model of the pool (kvtier.sched.unified_pool) places as the pool does.


@given(st.lists(st.integers(1, 2**40), min_size=1, max_size=8), st.integers(0, 100_000))
def test_the_simulators_algorithm_1_places_as_the_pool_does(bandwidths: list[int], n: int) -> None:
    rates = [float(b) for b in bandwidths]
    assert bandwidth_aware_counts(n, rates) == _core.ssd_placement_counts(rates, n)
