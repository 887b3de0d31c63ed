"""Codecs per lower tier (``ssd.codec``, ``remote.codec``): blocks written to SSD or the remote
tier are encoded and their object header records the codec; loads decode by that header whatever
the reader's own codec settings are; undecodable objects are counted misses; bad settings are
clear errors naming the key. ``quant`` is checked against the bound documented in
``kvtier.codec``, the others for exact bytes."""

from __future__ import annotations

import gc
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvtier
from kvtier import _core
from kvtier.bench.codec import GEOMETRY as KV_GEOMETRY
from kvtier.bench.codec import load_blocks
from kvtier.bench.kv_fixture import CHECKOUT_PATH
from kvtier.errors import ConfigError
from kvtier.keys import BlockKeys
from kvtier.testing.redis import LocalRedis

# 4 layers x 2 heads x 64 dims x 16 tokens, fp16: 32 KiB blocks. (quant with CacheGen's bins needs
# at least 3 layers to fit half the fp16 size: layers 0-1 take 32 bins, 8-bit codes.)
GEOMETRY = kvtier.Geometry(4, 2, 64, "fp16", 16)
BLOCK = GEOMETRY.block_bytes
OBJECT = 9 * 4096  # a block in DRAM: payload + 64-byte header, rounded up to pages
CODECS: list[dict[str, Any]] = [
    {"codec": "raw"},
    {"codec": "lossless", "codec_backend": "zstd"},
    {"codec": "lossless", "codec_backend": "deflate", "codec_level": 9},
    {"codec": "lossless", "codec_backend": "lz4"},
    {"codec": "quant"},
]


def shrinks(codec: dict[str, Any]) -> bool:
    """Whether blocks shrink under ``codec``: every codec but raw shrinks this test data."""
    return codec["codec"] != "raw"


def kv_blocks(keys: BlockKeys) -> np.ndarray:
    """fp16 KV-like values per key: normal, scale 0.5, rounded to 3 mantissa bits (compressible)."""
    out = np.empty((len(keys), BLOCK), dtype=np.uint8)
    for i, k in enumerate(keys):
        x = np.random.default_rng(k & (2**64 - 1)).normal(0.0, 0.5, BLOCK // 2).astype(np.float16)
        bits = x.view(np.uint16) & np.uint16(0xFF80)
        out[i] = bits.view(np.uint8)
    return out


def assert_blocks(codec: dict[str, Any], got: np.ndarray, want: np.ndarray) -> None:
    if codec["codec"] != "quant":
        assert np.array_equal(got, want)
        return
    # kvtier.codec: |x - x^| <= s * (1/(2h) + 2**-10), s the token vector's max |x|,
    # h = (bins - 1) // 2 >= 7 with CacheGen's bins (16 or 32).
    d = GEOMETRY.head_dim
    x = want.reshape(-1).view(np.float16).astype(np.float32).reshape(-1, d)
    y = got.reshape(-1).view(np.float16).astype(np.float32).reshape(-1, d)
    scale = np.abs(x).max(axis=1, keepdims=True)
    bound = scale * (1 / 14 + 2**-10)
    assert np.all(np.abs(x - y) <= bound + 1e-7), float((np.abs(x - y) - bound).max())
    assert not np.array_equal(y, np.zeros_like(y))


def load_all(store: kvtier.Store, keys: BlockKeys) -> tuple[int, list[str], np.ndarray]:
    with store.lease(keys) as lease:
        out = np.zeros((lease.hit_blocks, BLOCK), dtype=np.uint8)
        report = store.load(lease, out)
        return report.loaded_blocks, list(lease.tiers), out


def ssd_store(directory: Path, codec: dict[str, Any], **ssd: Any) -> kvtier.Store:
    """A store with an SSD tier under ``codec``; ``ssd`` are further keys of its SSD section."""
    config = kvtier.StoreConfig(
        geometry=GEOMETRY,
        model_id="codec-test",
        dram=kvtier.DramConfig(capacity_bytes=2 * OBJECT),
        ssd=kvtier.SsdConfig(directory=str(directory), capacity_bytes="8MiB", probe_bytes=0, **codec, **ssd),
    )
    return kvtier.Store(config)


def put_each(store: kvtier.Store, keys: BlockKeys, data: np.ndarray) -> None:
    for i in range(len(keys)):
        report = store.put(keys[i : i + 1], data[i : i + 1])
        assert report.rejected == 0


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("write_through", [False, True])
def test_ssd_round_trip(tmp_path: Path, codec: dict[str, Any], write_through: bool) -> None:
    store = ssd_store(tmp_path, codec, write_through=write_through)
    keys = store.namespace.block_keys(np.arange(16 * 8, dtype=np.uint32))
    data = kv_blocks(keys)
    put_each(store, keys, data)  # DRAM holds 2: the rest are demoted (or were written through)
    loaded, tiers, out = load_all(store, keys)
    assert loaded == len(keys)
    assert "ssd" in tiers
    assert_blocks(codec, out, data)
    s = store.stats()
    if shrinks(codec):
        assert s.ssd_encoded_blocks >= 6
        assert s.ssd_encoded_bytes_before == s.ssd_encoded_blocks * BLOCK
        assert s.ssd_encoded_bytes_after < s.ssd_encoded_bytes_before
        ssd = store.tier_stats()["ssd"]
        assert ssd.used_bytes < ssd.objects * BLOCK  # smaller objects on the device
    elif codec["codec"] == "raw":
        assert s.ssd_encoded_blocks == s.ssd_encode_fallbacks == 0
    else:
        assert s.ssd_encode_fallbacks >= 6
    assert s.decode_failures == 0 and s.checksum_failures == 0
    store.check_integrity()


@pytest.mark.parametrize(
    ("writer", "reader"),
    [(CODECS[1], CODECS[0]), (CODECS[0], CODECS[2]), (CODECS[4], CODECS[1]), (CODECS[2], CODECS[4])],
    ids=["lossless-by-raw", "raw-by-lossless", "quant-by-lossless", "lossless-by-quant"],
)
def test_ssd_reader_follows_the_header(
    tmp_path: Path, writer: dict[str, Any], reader: dict[str, Any]
) -> None:
    store = ssd_store(tmp_path, writer, write_through=True)
    keys = store.namespace.block_keys(np.arange(16 * 6, dtype=np.uint32))
    data = kv_blocks(keys)
    put_each(store, keys, data)
    store.flush()
    del store
    gc.collect()  # the pool's directory lock goes with the store
    store = ssd_store(tmp_path, reader)
    loaded, tiers, out = load_all(store, keys)
    assert loaded == len(keys)
    assert set(tiers) == {"ssd"}
    assert_blocks(writer, out, data)
    assert store.stats().decode_failures == 0


def test_corrupt_encoded_ssd_object_is_a_counted_miss(tmp_path: Path) -> None:
    store = ssd_store(tmp_path, CODECS[1], write_through=True)
    keys = store.namespace.block_keys(np.arange(16 * 6, dtype=np.uint32))
    data = kv_blocks(keys)
    put_each(store, keys, data)
    assert store._corrupt_for_test(keys[1], 100)  # inside the codec object, on SSD only
    loaded, _, out = load_all(store, keys)
    assert loaded == 1
    assert np.array_equal(out[0], data[0])
    assert store.stats().checksum_failures == 1
    assert store.lookup(keys).hit_blocks == 1


@pytest.mark.parametrize("codec", ["lossless", "quant"])
def test_real_kv_through_ssd(tmp_path: Path, codec: str) -> None:
    """The SmolLM2-135M KV fixture through an SSD tier with a codec, read back by a raw store."""
    if not CHECKOUT_PATH.exists():
        pytest.skip(f"{CHECKOUT_PATH} missing")
    blocks = load_blocks(CHECKOUT_PATH)
    fields: dict[str, Any] = {
        "geometry": KV_GEOMETRY,
        "model_id": "real-kv",
        "dram": {"capacity_bytes": "8MiB"},
        "ssd": {"directory": str(tmp_path), "capacity_bytes": "64MiB", "probe_bytes": 0},
    }
    extra = {"codec_backend": "deflate"} if codec == "lossless" else {}
    ssd = {**fields["ssd"], "codec": codec, "write_through": True, **extra}
    writer = kvtier.Store(kvtier.StoreConfig(**{**fields, "ssd": ssd}))
    keys = writer.namespace.block_keys(np.arange(16 * len(blocks), dtype=np.uint32))
    writer.put(keys, blocks)
    s = writer.stats()
    assert s.ssd_encoded_blocks == len(blocks)
    ratio = s.ssd_encoded_bytes_before / s.ssd_encoded_bytes_after
    assert ratio > (3.5 if codec == "quant" else 1.05), ratio  # measured: quant 4.35, deflate 1.14
    del writer
    gc.collect()
    reader = kvtier.Store(kvtier.StoreConfig(**fields))
    with reader.lease(keys) as lease:
        out = np.zeros_like(blocks)
        assert reader.load(lease, out).loaded_blocks == len(blocks)
    if codec == "lossless":
        assert np.array_equal(out, blocks)
    else:
        d = KV_GEOMETRY.head_dim
        x = blocks.reshape(-1).view(np.float16).astype(np.float32).reshape(-1, d)
        y = out.reshape(-1).view(np.float16).astype(np.float32).reshape(-1, d)
        bound = np.abs(x).max(axis=1, keepdims=True) * (1 / 14 + 2**-10)
        assert np.all(np.abs(x - y) <= bound + 1e-7)


# ---- remote ----


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[LocalRedis]:
    if not (shutil.which("redis-server") or shutil.which("valkey-server")):
        pytest.skip("no redis-server/valkey-server installed")
    with LocalRedis(tmp_path) as server:
        yield server


def remote_store(url: str, codec: dict[str, Any]) -> kvtier.Store:
    """A store with a remote tier on ``url`` under ``codec``."""
    config = kvtier.StoreConfig(
        geometry=GEOMETRY,
        model_id="codec-test",
        dram=kvtier.DramConfig(capacity_bytes=2 * OBJECT),
        remote=kvtier.RemoteConfig(
            urls=url, reconnect_backoff_min_s=0.01, reconnect_backoff_max_s=0.05, **codec
        ),
    )
    return kvtier.Store(config)


def server_key(store: kvtier.Store, key: int) -> str:
    return f"kvtier:{int.from_bytes(store.namespace.hash, 'little'):032x}:{key:032x}"


def codec_id_on_server(redis: LocalRedis, store: kvtier.Store, key: int) -> int:
    name = server_key(store, key)
    value = redis.command("GET", name)
    assert isinstance(value, bytes) and value[:4] == b"KVTO"
    return int(struct.unpack_from("<H", value, 6)[0])


@pytest.mark.parametrize("writer", CODECS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_remote_round_trip_and_mixed_readers(redis: LocalRedis, writer: dict[str, Any]) -> None:
    store = remote_store(redis.url, writer)
    keys = store.namespace.block_keys(np.arange(16 * 6, dtype=np.uint32))
    data = kv_blocks(keys)
    put_each(store, keys, data)
    s = store.stats()
    if shrinks(writer):
        assert s.remote_encoded_blocks == len(keys)
        assert s.remote_encoded_bytes_after < s.remote_encoded_bytes_before == len(keys) * BLOCK
    want_id = {"raw": 0, "lossless": 1, "quant": 2}[writer["codec"]] if shrinks(writer) else 0
    assert codec_id_on_server(redis, store, keys[0]) == want_id
    for reader in (CODECS[0], CODECS[3], CODECS[4]):
        fresh = remote_store(redis.url, reader)  # empty DRAM: every block from the server
        loaded, tiers, out = load_all(fresh, keys)
        assert loaded == len(keys), reader
        assert set(tiers) == {"remote"}
        assert_blocks(writer, out, data)
        assert fresh.stats().decode_failures == 0


def codec_object(namespace_hash: bytes, key: int, codec_id: int, payload: bytes) -> bytes:
    """An object whose header verifies (docs/formats.md §2) with any codec id and payload."""
    head = struct.pack("<4sHHQ", b"KVTO", 1, codec_id, len(payload))
    head += namespace_hash + key.to_bytes(16, "little") + struct.pack("<Q", _core.checksum(payload))
    return head + struct.pack("<Q", _core.checksum(head)) + payload


def test_undecodable_remote_values_are_counted_misses(redis: LocalRedis) -> None:
    store = remote_store(redis.url, CODECS[0])
    keys = store.namespace.block_keys(np.arange(16 * 4, dtype=np.uint32))
    writer = remote_store(redis.url, CODECS[1])
    data = kv_blocks(keys)
    put_each(writer, keys, data)
    ns = store.namespace.hash
    # keys[1]: unknown codec id; keys[2]: a lossless payload of garbage (both headers verify);
    # keys[3]: the stored codec object with its codec id changed (its header checksum fails).
    names = [server_key(store, keys[i]) for i in (1, 2, 3)]
    redis.command("SET", names[0], codec_object(ns, keys[1], 9, b"\x5a" * 700))
    redis.command("SET", names[1], codec_object(ns, keys[2], 1, b"\x5a" * 700))
    value = bytearray(redis.command("GET", names[2]))
    value[6:8] = struct.pack("<H", 9)
    redis.command("SET", names[2], bytes(value))
    loaded, _, out = load_all(store, keys)
    assert loaded == 1
    assert np.array_equal(out[0], data[0])
    s = store.stats()
    assert s.decode_failures == 2  # headers verified, payloads did not decode
    assert s.checksum_failures == 3
    m = store.remote_metrics()
    assert m is not None and m["bad_magic"] == 1  # the header that failed, counted by the tier
    for name in names:
        assert redis.command("EXISTS", name) == 0  # deleted: later lookups miss at once


# ---- configuration ----


SSD = {"directory": "/nonexistent-kvtier-dir"}
REMOTE = {"urls": "redis://127.0.0.1:1"}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"ssd": {**SSD, "codec": "gzip"}}, "`ssd.codec` is 'gzip'"),
        (
            {"remote": {**REMOTE, "codec": "lossless", "codec_backend": "brotli"}},
            "`remote.codec_backend` is 'brotli'",
        ),
        (
            {"ssd": {**SSD, "codec": "lossless", "codec_backend": "deflate", "codec_level": 40}},
            "`ssd.codec_level`",
        ),
        (
            {"ssd": {**SSD, "codec": "lossless", "codec_backend": "lz4", "codec_level": 3}},
            "`ssd.codec_level`",
        ),
        ({"ssd": {**SSD, "codec": "raw", "codec_backend": "zstd"}}, "apply to 'lossless' only"),
    ],
)
def test_bad_codec_config(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        kvtier.StoreConfig(geometry=GEOMETRY, model_id="m", **fields)


def test_quant_needs_fp16_without_extra_groups(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"`remote\.codec` is 'quant', which needs fp16"):
        kvtier.StoreConfig(
            geometry=kvtier.Geometry(4, 2, 64, "bf16", 16), model_id="m", remote={**REMOTE, "codec": "quant"}
        )
    # Two layers: CacheGen's 32-bin layers do not fit half the fp16 size; the store says so.
    config = kvtier.StoreConfig(
        geometry=kvtier.Geometry(2, 2, 64, "fp16", 16),
        model_id="m",
        ssd=kvtier.SsdConfig(directory=str(tmp_path), capacity_bytes="1MiB", probe_bytes=0, codec="quant"),
    )
    with pytest.raises(ConfigError, match=r"ssd\.codec \(quant\).*half"):
        kvtier.Store(config)


def test_codec_keys_from_dict_and_defaults() -> None:
    config = kvtier.StoreConfig.from_dict(
        {
            "geometry": GEOMETRY.to_dict(),
            "model_id": "m",
            "ssd": {**SSD, "codec": "lossless"},
            "remote": {**REMOTE, "codec": "quant"},
        }
    )
    assert config.ssd is not None and config.ssd.codec_backend == "zstd"  # lossless defaults to zstd
    assert (
        config.remote is not None and config.remote.codec == "quant" and config.remote.codec_backend is None
    )
    assert kvtier.StoreConfig.from_dict(config.to_dict()) == config
    assert kvtier.SsdConfig(directory="/d").codec == "raw"


def test_flat_codec_keys_without_their_tier_are_still_checked() -> None:
    # The deprecated flat spelling: no tier without ssd_directory / remote_urls, but the values
    # are checked as before, and the error names the key as it was given.
    with (
        pytest.warns(DeprecationWarning, match=r"use `ssd\.codec`"),
        pytest.raises(ConfigError, match=r"`ssd\.codec` is 'gzip'.*deprecated `ssd_codec`"),
    ):
        kvtier.StoreConfig(geometry=GEOMETRY, model_id="m", ssd_codec="gzip")
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="`remote_codec_backend`"):
        kvtier.StoreConfig(geometry=GEOMETRY, remote_codec="lossless", remote_codec_backend="brotli")
    with pytest.warns(DeprecationWarning):
        config = kvtier.StoreConfig(geometry=GEOMETRY, model_id="m", ssd_codec="lossless")
    assert config.ssd is None
