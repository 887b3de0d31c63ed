"""A store serving traffic for `kvtier top` to watch (docs/metrics.md); runs until interrupted.

Usage: python scripts/top_traffic.py PORT DIR  (metrics on 127.0.0.1:PORT; SSD files and a
throw-away redis-server under DIR), then `kvtier top http://127.0.0.1:PORT/metrics`.
"""

import sys
import time
from pathlib import Path

import numpy as np

from kvtier import Store, StoreConfig, layout
from kvtier.geometry import Geometry
from kvtier.testing.redis import LocalRedis
from kvtier.transfer import TransferEngine

port = int(sys.argv[1])
root = Path(sys.argv[2])
(root / "ssd").mkdir(parents=True, exist_ok=True)
g = Geometry(num_layers=2, num_kv_heads=2, head_dim=64, dtype="fp16", block_tokens=16)
with LocalRedis(root / "redis") as redis:
    store = Store(
        StoreConfig(
            geometry=g,
            model_id="top-demo",
            dram_capacity_bytes="4MiB",
            ssd_directory=str(root / "ssd"),
            ssd_capacity_bytes="16MiB",
            ssd_write_through=True,
            ssd_probe_bytes=0,
            remote_urls=(redis.url,),
            metrics_port=port,
        )
    )
    engine, pool = TransferEngine(store), layout.alloc_pool(g, 4)
    objects = np.random.default_rng(0).integers(0, 255, (4, g.block_bytes), dtype=np.uint8)
    out = np.empty_like(objects)
    print("ready", flush=True)
    i = 0
    while True:
        keys = store.namespace.block_keys(np.arange(i * 64, i * 64 + 64, dtype=np.uint32))
        store.put(keys, objects)
        store.lookup(
            store.namespace.block_keys(np.arange(10**6 + i * 64, 10**6 + i * 64 + 64, dtype=np.uint32))
        )
        if i % 2:
            with store.lease(keys) as lease:
                store.load(lease, out)
        else:
            engine.wait([engine.submit_load(keys, pool, range(4))])
        i += 1
        time.sleep(0.002)
