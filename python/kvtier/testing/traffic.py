"""Steady store traffic for `kvtier top` to watch (tests/test_top.py, scripts/top_traffic.py).

Each round puts 4 blocks, looks up 4 blocks nobody stored (misses) and loads the 4 it put: on odd
rounds with `Store.load`, on even ones through a transfer engine into a pool (so its stages show
too). The hit rate over whole rounds is therefore 50%. Scaffolding: it imports no kvtier module
(the store, engine and pool are passed in).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np


def store_traffic(store: Any, engine: Any, pool: Any, stop: threading.Event, pause_s: float = 0.0) -> int:
    """Runs rounds until `stop` is set; returns how many ran. Blocks are `store.config.geometry`'s
    (its `block_tokens` tokens each), filled from a fixed seed."""
    block_tokens = store.config.geometry.block_tokens
    tokens = 4 * block_tokens
    objects = np.random.default_rng(0).integers(0, 255, (4, store.block_bytes), dtype=np.uint8)
    out = np.empty_like(objects)
    i = 0
    while not stop.is_set():
        keys = store.namespace.block_keys(np.arange(i * tokens, (i + 1) * tokens, dtype=np.uint32))
        store.put(keys, objects)
        absent = np.arange(10**6 + i * tokens, 10**6 + (i + 1) * tokens, dtype=np.uint32)
        store.lookup(store.namespace.block_keys(absent))
        if i % 2:
            with store.lease(keys) as lease:
                store.load(lease, out)
        else:
            [job] = engine.wait([engine.submit_load(keys, pool, range(4))])
            if job.done_blocks != 4:
                raise RuntimeError(f"traffic round {i}: the engine loaded {job.done_blocks} of 4 blocks")
        i += 1
        if pause_s:
            time.sleep(pause_s)
    return i
