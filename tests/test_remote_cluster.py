"""The remote tier on a real three-master Redis Cluster on loopback (formed with
``redis-cli --cluster create``): round trip across masters, sharing between processes that know
different seed nodes, and a master killed mid-run."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import kvtier
from kvtier.remote import RemotePool
from kvtier.testing.redis import LocalCluster

GEOMETRY = kvtier.Geometry(2, 2, 8, "fp16", 4)  # 512-byte blocks
TOKENS = np.arange(256, dtype=np.uint32)  # 64 blocks: spread over all three masters


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path) as c:
        yield c


def config(urls: list[str], **kw: object) -> kvtier.StoreConfig:
    fields: dict[str, object] = {
        "geometry": GEOMETRY,
        "model_id": "cluster-test",
        "dram": {"capacity_bytes": 128 * 4096},
        "remote": {
            "urls": tuple(urls),
            "cluster": True,
            "reconnect_backoff_min_s": 0.01,
            "reconnect_backoff_max_s": 0.05,
            "connect_timeout_s": 0.5,
            "io_timeout_s": 2.0,
        },
    }
    fields.update(kw)
    return kvtier.StoreConfig(**fields)  # type: ignore[arg-type]


def blocks(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, GEOMETRY.block_bytes), dtype=np.uint8)


def load_all(store: kvtier.Store, keys: kvtier.BlockKeys) -> tuple[int, np.ndarray]:
    with store.lease(keys) as lease:
        out = np.zeros((lease.hit_blocks, GEOMETRY.block_bytes), dtype=np.uint8)
        return store.load(lease, out).loaded_blocks, out


def test_round_trip_spreads_over_all_masters(cluster: LocalCluster) -> None:
    writer = kvtier.Store(config(cluster.urls[:1]))
    keys = writer.namespace.block_keys(TOKENS)
    data = blocks(len(keys))
    assert writer.put(keys, data).stored == len(keys)
    sizes = [n.command("DBSIZE") for n in cluster.nodes]
    assert sum(sizes) == len(keys)
    assert all(s > 0 for s in sizes), sizes  # every master holds some blocks
    reader = kvtier.Store(config(cluster.urls[2:]))  # knows another seed node only
    lookup = reader.lookup(keys)
    assert lookup.hit_blocks == len(keys) and set(lookup.tiers) == {"remote"}
    loaded, out = load_all(reader, keys)
    assert loaded == len(keys) and np.array_equal(out, data)
    m = reader.remote_metrics()
    assert m is not None and m["nodes"] == 3 and m["nodes_down"] == 0
    reader.check_integrity()


def test_processes_on_different_seed_nodes_share(cluster: LocalCluster) -> None:
    script = textwrap.dedent(
        f"""
        import numpy as np, kvtier
        g = kvtier.Geometry(2, 2, 8, "fp16", 4)
        s = kvtier.Store(kvtier.StoreConfig(geometry=g, model_id="cluster-test", dram={{"capacity_bytes": 128 * 4096}},
                         remote={{"urls": ({cluster.urls[1]!r},), "cluster": True}}))
        keys = s.namespace.block_keys(np.arange(256, dtype=np.uint32))
        data = np.random.default_rng(3).integers(0, 256, (len(keys), g.block_bytes), dtype=np.uint8)
        print(s.put(keys, data).stored)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "64"
    store = kvtier.Store(config(cluster.urls[:1]))
    loaded, out = load_all(store, store.namespace.block_keys(TOKENS))
    assert loaded == 64 and np.array_equal(out, blocks(64, seed=3))


def test_killed_master_gives_misses_for_its_slots_only(cluster: LocalCluster) -> None:
    writer = kvtier.Store(config(cluster.urls))
    keys = writer.namespace.block_keys(TOKENS)
    data = blocks(len(keys))
    writer.put(keys, data)
    pool = RemotePool(config(cluster.urls).remote, writer.namespace.hash)
    first_owner = cluster.node_for(pool.key_name(keys[0]))
    victim = next(n for n in cluster.nodes if n is not first_owner)
    on_victim = [i for i in range(len(keys)) if cluster.node_for(pool.key_name(keys[i])) is victim]
    assert on_victim and on_victim[0] > 0
    victim.kill()
    for _ in range(3):  # no exception, whatever the loop does
        reader = kvtier.Store(config(cluster.urls))
        lookup = reader.lookup(keys)
        assert lookup.hit_blocks == on_victim[0]  # the prefix ends at the first dead-slot block
        loaded, out = load_all(reader, keys)
        assert loaded == on_victim[0] and np.array_equal(out, data[:loaded])
    # Blocks on the live masters are still all there.
    out = np.zeros_like(data)
    outcomes = pool.get(keys.raw, out, GEOMETRY.block_bytes)
    for i, o in enumerate(outcomes):
        assert o == ("missing" if i in on_victim else "loaded"), i
        if o == "loaded":
            assert np.array_equal(out[i], data[i])
    m = pool.metrics()
    assert m["down_misses"] >= len(on_victim)
    # Puts keep working for the live masters; the dead master's share is skipped and counted.
    fresh = kvtier.Store(config(cluster.urls))
    other_keys = fresh.namespace.block_keys(TOKENS + 1000)
    assert fresh.put(other_keys, data).stored == len(keys)
    assert fresh.stats().remote_write_failed > 0
    assert fresh.stats().remote_written + fresh.stats().remote_write_failed == len(keys)
