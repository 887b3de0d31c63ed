"""A store serving traffic for `kvtier top` to watch (docs/metrics.md); runs until interrupted.

Usage: python scripts/top_traffic.py PORT DIR  (metrics on 127.0.0.1:PORT; SSD files and a
throw-away redis-server under DIR), then `kvtier top http://127.0.0.1:PORT/metrics`.
"""

import sys
import threading
from pathlib import Path

from kvtier import DramConfig, RemoteConfig, SsdConfig, Store, StoreConfig, layout
from kvtier.geometry import Geometry
from kvtier.testing.redis import LocalRedis
from kvtier.testing.traffic import store_traffic
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
            dram=DramConfig(capacity_bytes="4MiB"),
            ssd=SsdConfig(
                directory=str(root / "ssd"), capacity_bytes="16MiB", write_through=True, probe_bytes=0
            ),
            remote=RemoteConfig(urls=(redis.url,)),
            metrics_port=port,
        )
    )
    engine, pool = TransferEngine(store), layout.alloc_pool(g, 4)
    print(f"serving traffic; watch it with: kvtier top http://127.0.0.1:{port}/metrics", flush=True)
    store_traffic(store, engine, pool, threading.Event(), pause_s=0.002)
