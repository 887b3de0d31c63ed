"""The remote tier on a real loopback redis-server (or valkey-server): round trip, sharing across
processes, tenant isolation, faults (server down at start, killed and restarted mid-loop, garbage
values, another namespace's object, wrong password) and configuration errors."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import kvtier
from kvtier import _core
from kvtier.errors import ConfigError
from kvtier.remote import RemotePool
from kvtier.testing.redis import LocalRedis, free_port

GEOMETRY = kvtier.Geometry(2, 2, 8, "fp16", 4)  # 512-byte blocks
TOKENS = np.arange(64, dtype=np.uint32)  # 16 blocks


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[LocalRedis]:
    with LocalRedis(tmp_path) as server:
        yield server


def config(
    url: str, *, dram: dict[str, object] | None = None, remote: dict[str, object] | None = None, **kw: object
) -> kvtier.StoreConfig:
    """A store on ``url``; ``dram`` and ``remote`` override keys of those sections."""
    fields: dict[str, object] = {
        "geometry": GEOMETRY,
        "model_id": "remote-test",
        "dram": {"capacity_bytes": 64 * 4096, **(dram or {})},
        "remote": {
            "urls": url,
            "reconnect_backoff_min_s": 0.01,
            "reconnect_backoff_max_s": 0.05,
            "connect_timeout_s": 0.5,
            "io_timeout_s": 2.0,
            **(remote or {}),
        },
    }
    fields.update(kw)
    return kvtier.StoreConfig(**fields)  # type: ignore[arg-type]


def blocks(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, GEOMETRY.block_bytes), dtype=np.uint8)


def load_all(store: kvtier.Store, keys: kvtier.BlockKeys) -> tuple[int, np.ndarray]:
    with store.lease(keys) as lease:
        out = np.zeros((lease.hit_blocks, GEOMETRY.block_bytes), dtype=np.uint8)
        report = store.load(lease, out)
    return report.loaded_blocks, out


def test_round_trip_through_the_server(redis: LocalRedis) -> None:
    writer = kvtier.Store(config(redis.url))
    keys = writer.namespace.block_keys(TOKENS)
    data = blocks(len(keys))
    assert writer.put(keys, data).stored == len(keys)
    assert writer.stats().remote_written == len(keys)
    assert redis.command("DBSIZE") == len(keys)

    reader = kvtier.Store(config(redis.url))  # empty DRAM: everything comes from the server
    lookup = reader.lookup(keys)
    assert lookup.hit_blocks == len(keys)
    assert set(lookup.tiers) == {"remote"}
    loaded, out = load_all(reader, keys)
    assert loaded == len(keys)
    assert np.array_equal(out, data)
    # Promotion on hit: the next lookup is served by DRAM.
    assert set(reader.lookup(keys).tiers) == {"dram"}
    assert reader.stats().promoted_blocks == len(keys)
    reader.check_integrity()
    m = reader.remote_metrics()
    assert m is not None and m["get"]["keys"] == len(keys) and m["get"]["bytes"] > 0


def test_consecutive_prefix_spans_dram_and_remote(redis: LocalRedis) -> None:
    a = kvtier.Store(config(redis.url))
    keys = a.namespace.block_keys(TOKENS)
    data = blocks(len(keys))
    a.put(keys[:8], data[:8])
    b = kvtier.Store(config(redis.url, remote={"write_through": False}))
    b.put(keys[:4], data[:4])  # DRAM of b holds 0..4; the server holds 0..8
    lookup = b.lookup(keys)
    assert lookup.hit_blocks == 8
    assert lookup.tiers == ("dram",) * 4 + ("remote",) * 4
    loaded, out = load_all(b, keys)
    assert loaded == 8 and np.array_equal(out, data[:8])
    a.put(keys[10:12], data[10:12])  # past a hole: only lookup_each sees them
    assert b.lookup_each(keys[:13]) == ("dram",) * 8 + (None, None, "remote", "remote", None)


def test_stores_in_two_processes_share_blocks(redis: LocalRedis) -> None:
    script = textwrap.dedent(
        f"""
        import numpy as np, kvtier
        g = kvtier.Geometry(2, 2, 8, "fp16", 4)
        s = kvtier.Store(kvtier.StoreConfig(geometry=g, model_id="remote-test",
                         dram={{"capacity_bytes": 64 * 4096}}, remote={{"urls": {redis.url!r}}}))
        keys = s.namespace.block_keys(np.arange(64, dtype=np.uint32))
        data = np.random.default_rng(7).integers(0, 256, (len(keys), g.block_bytes), dtype=np.uint8)
        print(s.put(keys, data).stored)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "16"
    store = kvtier.Store(config(redis.url))  # this process: same namespace, no shared setup
    keys = store.namespace.block_keys(TOKENS)
    loaded, out = load_all(store, keys)
    assert loaded == 16
    assert np.array_equal(out, blocks(16, seed=7))


def test_tenants_with_different_salts_never_hit_each_other(redis: LocalRedis) -> None:
    alice = kvtier.Store(config(redis.url, cache_salt="alice"))
    bob = kvtier.Store(config(redis.url, cache_salt="bob"))
    alice_keys = alice.namespace.block_keys(TOKENS)
    alice.put(alice_keys, blocks(16))
    assert bob.lookup(bob.namespace.block_keys(TOKENS)).hit_blocks == 0
    assert kvtier.Store(config(redis.url, cache_salt="alice")).lookup(alice_keys).hit_blocks == 16


def test_server_not_running_at_start_is_a_miss_then_a_hit(tmp_path: Path) -> None:
    server = LocalRedis(tmp_path)  # port chosen, not started
    store = kvtier.Store(config(server.url))
    keys = store.namespace.block_keys(TOKENS)
    data = blocks(16)
    report = store.put(keys, data)  # DRAM takes it; the remote write is skipped, counted
    assert report.stored == 16
    assert store.stats().remote_write_failed == 16
    other = kvtier.Store(config(server.url))
    assert other.lookup(keys).hit_blocks == 0
    m = other.remote_metrics()
    assert m is not None and m["down_misses"] > 0
    with server:
        assert store.put(keys, data).already_present == 16  # DRAM has them; no rewrite
        writer = kvtier.Store(config(server.url))
        writer.put(keys, data)
        hit = 0
        for _ in range(100):  # bounded: the backoff is at most 50 ms
            hit = other.lookup(keys).hit_blocks
            if hit == 16:
                break
            time.sleep(0.02)
        assert hit == 16
        loaded, out = load_all(other, keys)
        assert loaded == 16 and np.array_equal(out, data)
        m = other.remote_metrics()
        assert m is not None and m["reconnects"] >= 1


def test_server_killed_and_restarted_during_a_load_loop(redis: LocalRedis) -> None:
    writer = kvtier.Store(config(redis.url))
    keys = writer.namespace.block_keys(TOKENS)
    data = blocks(16)
    writer.put(keys, data)
    results = []
    for i in range(60):
        if i == 10:
            redis.kill()
        if i == 30:
            redis.start()  # empty: nothing was persisted
        if i == 35:
            writer2 = kvtier.Store(config(redis.url))
            writer2.put(keys, data)
        reader = kvtier.Store(config(redis.url))  # fresh DRAM each round: only remote can hit
        loaded, out = load_all(reader, keys)
        assert np.array_equal(out[:loaded], data[:loaded])  # never wrong bytes
        results.append(loaded)
        if i >= 35 and loaded == 16:
            break
    assert results[:10] == [16] * 10
    assert 0 in results[10:30]  # misses while down
    assert results[-1] == 16  # hits again after the restart


def test_long_lived_store_survives_a_restart(redis: LocalRedis) -> None:
    store = kvtier.Store(config(redis.url, dram={"capacity_bytes": 4096}))  # DRAM holds one block
    keys = store.namespace.block_keys(TOKENS)
    data = blocks(16)
    store.put(keys, data)
    redis.kill()
    for _ in range(5):
        assert store.lookup(keys).hit_blocks <= 1  # no exception; at most the DRAM block
    redis.start()
    store.put(keys, data)
    for _ in range(100):
        if store.lookup(keys).hit_blocks == 16:
            break
        store.put(keys, data)
    loaded, out = load_all(store, keys)
    assert loaded == 16 and np.array_equal(out, data)
    m = store.remote_metrics()
    assert m is not None and m["reconnects"] >= 1 and m["down_misses"] + m["down_skipped_writes"] > 0


@pytest.mark.parametrize("damage", ["magic", "truncated", "checksum", "foreign", "not_an_object"])
def test_garbage_values_are_counted_misses(redis: LocalRedis, damage: str) -> None:
    writer = kvtier.Store(config(redis.url))
    keys = writer.namespace.block_keys(TOKENS)
    data = blocks(16)
    writer.put(keys, data)
    pool = RemotePool(config(redis.url).remote, writer.namespace.hash)
    name = pool.key_name(keys[5])
    good = redis.command("GET", name)
    assert isinstance(good, bytes) and len(good) == 64 + GEOMETRY.block_bytes
    if damage == "magic":
        bad = b"XXXX" + good[4:]
    elif damage == "truncated":
        bad = good[:-100]
    elif damage == "checksum":
        bad = good[:200] + bytes([good[200] ^ 0x40]) + good[201:]
    elif damage == "foreign":  # a valid object of another namespace, planted under our key
        other = kvtier.StoreConfig(geometry=GEOMETRY, model_id="someone-else").namespace
        bad = _core.encode_object(other.hash, keys[5].to_bytes(16, "little"), data[5])
    else:
        bad = b"\x80\x04\x95pickle-like bytes that must never be evaluated"
    assert redis.command("SET", name, bad) == "OK"
    reader = kvtier.Store(config(redis.url))
    assert reader.lookup(keys).hit_blocks == 16  # existence is all a lookup can see
    loaded, out = load_all(reader, keys)
    assert loaded == 5  # the bad block ends the prefix
    assert np.array_equal(out[:5], data[:5])
    assert reader.stats().checksum_failures == 1
    m = reader.remote_metrics()
    assert m is not None
    counted = {"magic": "bad_magic", "truncated": "bad_length", "checksum": "bad_checksum"}
    counted |= {"foreign": "foreign_objects", "not_an_object": "bad_length"}
    assert m[counted[damage]] == 1
    # The bad value was deleted: the next lookup misses it at once.
    assert reader.lookup(keys).hit_blocks == 5
    assert redis.command("EXISTS", name) == 0


def test_other_namespace_keys_are_not_seen(redis: LocalRedis) -> None:
    a = kvtier.Store(config(redis.url, model_id="model-a"))
    b = kvtier.Store(config(redis.url, model_id="model-b"))
    a.put(a.namespace.block_keys(TOKENS), blocks(16))
    # b hashes the same tokens from its own seed: different keys, no hits.
    assert b.lookup(b.namespace.block_keys(TOKENS)).hit_blocks == 0


def test_write_back_goes_remote_only_on_eviction(redis: LocalRedis) -> None:
    store = kvtier.Store(
        config(redis.url, dram={"capacity_bytes": 4 * 4096}, remote={"write_through": False})
    )
    keys = store.namespace.block_keys(TOKENS)
    data = blocks(16)
    store.put(keys[:4], data[:4])
    assert redis.command("DBSIZE") == 0  # all four fit in DRAM: nothing written remote
    store.put(keys[4:], data[4:])  # DRAM gives up the oldest blocks: written back
    assert store.stats().remote_written >= 12
    fresh = kvtier.Store(config(redis.url))
    loaded, out = load_all(fresh, keys)
    assert loaded >= 12
    assert np.array_equal(out[:loaded], data[:loaded])


def test_ttl_is_set_on_stored_objects(redis: LocalRedis) -> None:
    store = kvtier.Store(config(redis.url, remote={"ttl_s": 100}))
    keys = store.namespace.block_keys(TOKENS)
    store.put(keys, blocks(16))
    pool = RemotePool(config(redis.url).remote, store.namespace.hash)
    ttl = redis.command("TTL", pool.key_name(keys[0]))
    assert isinstance(ttl, int) and 0 < ttl <= 100


def test_wrong_password_is_a_clear_error_at_start(tmp_path: Path) -> None:
    with LocalRedis(tmp_path, password="right-one") as server:
        with pytest.raises(ConfigError, match=r"authentication failed.*WRONGPASS"):
            kvtier.Store(config(f"redis://:wrong@127.0.0.1:{server.port}"))
        with pytest.raises(ConfigError, match="needs a password"):
            kvtier.Store(config(server.plain_url))
        store = kvtier.Store(config(server.plain_url, remote={"password": "right-one"}))
        keys = store.namespace.block_keys(TOKENS)
        assert store.put(keys, blocks(16)).stored == 16
        assert server.command("DBSIZE") == 16


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://127.0.0.1:6379", "expected redis://"),
        ("redis://127.0.0.1:99999", "expected 1 to 65535"),
        ("redis://127.0.0.1:6379/x", "expected a number"),
        ("redis://:pw@/0", "has no host"),
    ],
)
def test_bad_urls_are_clear_errors_at_start(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        kvtier.Store(config(url))


def test_bad_remote_fields_are_config_errors() -> None:
    url = f"redis://127.0.0.1:{free_port()}"
    for kw in (
        {"ttl_s": 0.5},
        {"connect_timeout_s": 0},
        {"reconnect_backoff_min_s": 1.0, "reconnect_backoff_max_s": 0.5},
        {"inflight_bytes_max": 0},
        {"key_prefix": "a b"},
        {"username": "u"},
        {"urls": (url, url)},
        {"tls_ca_file": "/ca.pem"},
    ):
        with pytest.raises(ConfigError):
            kvtier.Store(config(url, remote=kw))


def test_config_round_trips_remote_fields() -> None:
    c = config("redis://127.0.0.1:1", remote={"ttl_s": 60, "inflight_bytes_max": "8MiB"})
    assert c.remote is not None and c.remote.urls == ("redis://127.0.0.1:1",)
    assert c.remote.inflight_bytes_max == 8 * 2**20
    again = kvtier.StoreConfig.from_dict(c.to_dict())
    assert again == c
    shown = repr(
        kvtier.StoreConfig(geometry=GEOMETRY, remote={"urls": "redis://127.0.0.1:1", "password": "pw-9f3"})
    )
    assert "password" not in shown and "pw-9f3" not in shown


def test_remote_pool_raw_and_verified_paths(redis: LocalRedis) -> None:
    ns = kvtier.StoreConfig(geometry=GEOMETRY).namespace
    pool = RemotePool(config(redis.url).remote, ns.hash)
    keys = ns.block_keys(TOKENS)
    data = blocks(16)
    assert pool.put(keys.raw, data, GEOMETRY.block_bytes) == (16, 0, 0)
    assert pool.put(keys.raw, data, GEOMETRY.block_bytes) == (0, 16, 0)
    out = np.zeros_like(data)
    assert pool.get(keys.raw, out, GEOMETRY.block_bytes) == ["loaded"] * 16
    assert np.array_equal(out, data)
    assert pool.exists(keys.raw) == [True] * 16
    names = [b"raw:%d" % i for i in range(4)]
    assert pool.raw_set(names, data[:4], GEOMETRY.block_bytes) == ["ok"] * 4
    raw = np.zeros((4, GEOMETRY.block_bytes), dtype=np.uint8)
    assert pool.raw_get(names, raw, GEOMETRY.block_bytes) == ["loaded"] * 4
    assert np.array_equal(raw, data[:4])
    assert pool.remove(keys.raw) == 16
    assert pool.get(keys.raw, out, GEOMETRY.block_bytes) == ["missing"] * 16


def test_remote_pool_reads_of_another_size_leave_the_objects(redis: LocalRedis) -> None:
    """``RemotePool.get`` with a ``block_bytes`` other than the stored objects' reported each as
    corrupt and deleted it from the server, which every store of the namespace shares: a
    caller's wrong size destroyed good blocks. Such a value is ``"wrong_length"``, left alone."""
    ns = kvtier.StoreConfig(geometry=GEOMETRY).namespace
    pool = RemotePool(config(redis.url).remote, ns.hash)
    keys = ns.block_keys(TOKENS)
    data = blocks(16)
    assert pool.put(keys.raw, data, GEOMETRY.block_bytes) == (16, 0, 0)
    for size in (GEOMETRY.block_bytes // 2, GEOMETRY.block_bytes + 1):
        assert pool.get(keys.raw, np.zeros((16, size), np.uint8), size) == ["wrong_length"] * 16
    out = np.zeros_like(data)
    assert pool.get(keys.raw, out, GEOMETRY.block_bytes) == ["loaded"] * 16
    assert np.array_equal(out, data)
    assert pool.metrics()["bad_length"] == 0


def test_acl_user_and_password(tmp_path: Path) -> None:
    with LocalRedis(tmp_path, password="admin-pw") as server:
        assert server.command("ACL", "SETUSER", "kv", "on", ">kv-pw", "~kvtier:*", "+@all") == "OK"
        store = kvtier.Store(config(server.plain_url, remote={"username": "kv", "password": "kv-pw"}))
        keys = store.namespace.block_keys(TOKENS)
        assert store.put(keys, blocks(16)).stored == 16
        assert store.stats().remote_written == 16
        with pytest.raises(ConfigError, match=r"user \"kv\".*WRONGPASS"):
            kvtier.Store(config(server.plain_url, remote={"username": "kv", "password": "nope"}))


def test_long_prompt_with_short_cached_prefix_asks_few_keys(redis: LocalRedis) -> None:
    geometry = kvtier.Geometry(1, 1, 8, "fp16", 1)  # 32-byte blocks, one token each
    writer = kvtier.Store(config(redis.url, geometry=geometry, dram={"capacity_bytes": 4096}))
    tokens = np.arange(4000, dtype=np.uint32)
    keys = writer.namespace.block_keys(tokens)
    data = np.ones((600, geometry.block_bytes), dtype=np.uint8)
    writer.put(keys[:600], data)
    reader = kvtier.Store(config(redis.url, geometry=geometry, dram={"capacity_bytes": 4096}))
    assert reader.lookup(keys).hit_blocks == 600
    m = reader.remote_metrics()
    assert m is not None
    # Two chunks, not 4000 keys: the first (512, all present) confirmed by one multi-key EXISTS;
    # the second (1024, with the first miss) asked at once, then name by name.
    assert m["exists"]["keys"] == 512 + 1024 + 1024
    assert reader.lookup(keys[:512]).hit_blocks == 512


def test_concurrent_loads_share_the_connection_pool(redis: LocalRedis) -> None:
    writer = kvtier.Store(config(redis.url))
    keys = writer.namespace.block_keys(TOKENS)
    data = blocks(16)
    writer.put(keys, data)
    reader = kvtier.Store(config(redis.url, remote={"promote_on_hit": False, "connections_per_node_max": 2}))
    errors: list[str] = []

    def work() -> None:
        for _ in range(20):
            loaded, out = load_all(reader, keys)
            if loaded != 16 or not np.array_equal(out, data):
                errors.append(f"loaded {loaded}")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    reader.check_integrity()
    m = reader.remote_metrics()
    assert m is not None and m["connects"] <= 2 and m["get"]["keys"] == 4 * 20 * 16


def test_prefix_across_dram_ssd_and_remote(redis: LocalRedis, tmp_path: Path) -> None:
    writer = kvtier.Store(config(redis.url))
    keys = writer.namespace.block_keys(TOKENS[:48])  # 12 blocks
    data = blocks(12)
    writer.put(keys[8:], data[8:])  # only the server holds blocks 8..12
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    store = kvtier.Store(
        config(
            redis.url,
            dram={"capacity_bytes": 4 * 4096},  # four blocks
            ssd=kvtier.SsdConfig(directory=str(ssd), capacity_bytes="1MiB", probe_bytes=0),
            remote={"write_through": False},
        )
    )
    store.put(keys[:8], data[:8])  # DRAM keeps 4..8; 0..4 are demoted to SSD (and written back)
    lookup = store.lookup(keys)
    assert lookup.hit_blocks == 12
    assert lookup.tiers == ("ssd",) * 4 + ("dram",) * 4 + ("remote",) * 4
    loaded, out = load_all(store, keys)
    assert loaded == 12 and np.array_equal(out, data)
    assert store.stats().remote_written >= 4  # the SSD victims went remote too (write-back)
    store.check_integrity()


def test_write_through_republishes_after_a_server_restart(redis: LocalRedis) -> None:
    store = kvtier.Store(config(redis.url))
    keys = store.namespace.block_keys(TOKENS)
    data = blocks(16)
    store.put(keys, data)
    store.put(keys, data)  # all in DRAM and on the server: no value is sent again
    assert store.stats().remote_written == 16
    m = store.remote_metrics()
    assert m is not None and m["set"]["keys"] == 16
    redis.kill()
    redis.start()  # empty
    for _ in range(100):  # bounded: the backoff is at most 50 ms
        store.put(keys, data)
        if redis.command("DBSIZE") == 16:
            break
        time.sleep(0.02)
    assert redis.command("DBSIZE") == 16  # DRAM still held them; the put sent them again
    fresh = kvtier.Store(config(redis.url))
    loaded, out = load_all(fresh, keys)
    assert loaded == 16 and np.array_equal(out, data)
