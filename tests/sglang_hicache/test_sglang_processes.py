"""A second process sees the pages the first one stored, through the SSD tier (after the first
exits) and through Redis (shared), with SGLang's own host pools on both sides: the KV pool's, and
every pool of a hybrid model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hicache_helpers import backend, fill, host_pool, hybrid_backend, hybrid_pools, page_bytes, page_keys
from sglang.srt.mem_cache.hicache_storage import PoolName
from test_sglang_hybrid import load, query, tier_extra

from kvtier.testing.redis import LocalRedis

HERE = Path(__file__).resolve().parent

WRITER = """
import json, sys
sys.path.insert(0, sys.argv[1])
from hicache_helpers import backend, fill, host_pool, page_keys
extra = json.loads(sys.argv[2])
pool = host_pool("mha", "page_first")
made = backend(pool, extra, model="two-processes")
done = made.batch_set_v1(page_keys("proc", 8), fill(pool, 8, seed=11))
made.close()
print("STORED", sum(done))
"""


@pytest.mark.parametrize("tier", ["ssd", "redis"])
def test_a_second_process_sees_the_first_ones_pages(tier: str, tmp_path: Path, redis: LocalRedis) -> None:
    extra: dict[str, Any] = {"dram": {"capacity_bytes": "1MiB"}}
    if tier == "ssd":
        extra["ssd"] = {
            "directory": str(tmp_path),
            "capacity_bytes": "4MiB",
            "probe_bytes": 0,
            "write_through": True,
        }
    else:
        extra["remote"] = {"urls": [redis.url]}
    proc = subprocess.run(
        [sys.executable, "-c", WRITER, str(HERE), json.dumps(extra)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "STORED 8" in proc.stdout, proc.stderr[-4000:]
    # This process: the same pages, written here again into a scratch pool, are the expectation.
    scratch = host_pool("mha", "page_first")
    expected_slots = fill(scratch, 8, seed=11)
    expected = [page_bytes(scratch, expected_slots, i) for i in range(8)]
    pool = host_pool("mha", "page_first")
    reader = backend(pool, extra, model="two-processes")
    keys = page_keys("proc", 8)
    assert reader.batch_exists(keys) == 8
    into = pool.alloc(8 * pool.page_size)
    assert reader.batch_get_v1(keys, into) == [True] * 8
    assert [page_bytes(pool, into, i) for i in range(8)] == expected
    assert reader.get_stats().kvtier["put_blocks"] == 0


HYBRID_WRITER = """
import json, sys
sys.path.insert(0, sys.argv[1])
from hicache_helpers import hybrid_backend, hybrid_pools, page_keys
from test_sglang_hybrid import store
pools = hybrid_pools()
made = hybrid_backend(pools, json.loads(sys.argv[2]), model="two-processes-hybrid")
expected = store(made, pools, page_keys("hproc", 6), seed=12)
made.close()
print("STORED", json.dumps({f"{pool}|{key}": data.hex() for (pool, key), data in expected.items()}))
"""


@pytest.mark.parametrize("tier", ["ssd", "redis"])
def test_a_second_process_sees_every_pool_of_a_hybrid_model(
    tier: str, tmp_path: Path, redis: LocalRedis
) -> None:
    # The KV pages, the SWA window and the state snapshots another process stored (its pools
    # laid out over the tiers the same way) load here with exactly its bytes.
    extra = tier_extra(tier, tmp_path, redis)
    proc = subprocess.run(
        [sys.executable, "-c", HYBRID_WRITER, str(HERE), json.dumps(extra)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "STORED" in proc.stdout, proc.stderr[-4000:]
    stored = json.loads(proc.stdout.split("STORED", 1)[1])
    expected = {tuple(k.split("|", 1)): bytes.fromhex(v) for k, v in stored.items()}
    keys = page_keys("hproc", 6)
    pools = hybrid_pools()
    reader = hybrid_backend(pools, extra, model="two-processes-hybrid")
    assert query(reader, keys) == (6, {"kv": 6, "mamba": 6, "swa": 6}, [6])
    assert load(reader, pools, PoolName.KV, keys) == [expected["kv", k] for k in keys]
    assert load(reader, pools, PoolName.SWA, keys[4:]) == [expected["swa", k] for k in keys[4:]]
    assert load(reader, pools, PoolName.MAMBA, [keys[2], keys[5]]) == [
        expected["mamba", k] for k in (keys[2], keys[5])
    ]
    assert all(reader.get_stats().kvtier_pools[n]["put_blocks"] == 0 for n in ("swa", "mamba"))
