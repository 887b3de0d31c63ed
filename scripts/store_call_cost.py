"""Per-call cost of the store's `_core` calls with one 8 KiB block each: put, lookup, and lease +
load + release (20,000 calls a round). Prints one JSON line of microseconds per call, the median
of 5 rounds. Used to A/B the clear gate (docs/remote.md "Clearing is a barrier"): run it with
PYTHONPATH pointing at each tree's python/ (each with its own built extension)."""

import json
import statistics
import time

import numpy as np

from kvtier import Geometry, Store, StoreConfig

g = Geometry(num_layers=2, num_kv_heads=1, head_dim=64, dtype="fp16", block_tokens=16)  # 8 KiB blocks
store = Store(StoreConfig(geometry=g, model_id="gate", dram={"capacity_bytes": 256 * 2**20}))
core = store._core
N = 20000
rng = np.random.default_rng(0)
raw = [rng.integers(0, 2**63, size=2, dtype=np.uint64).tobytes() for _ in range(N)]
nsh = bytes(core.namespace_hash)
obj = np.ones(g.block_bytes, dtype=np.uint8)
out = np.empty(g.block_bytes, dtype=np.uint8)
res = {"put": [], "lookup": [], "lease_load_release": []}
for _rnd in range(5):
    core.clear()
    t = time.perf_counter()
    for k in raw:
        core.put(nsh, k, obj)
    res["put"].append((time.perf_counter() - t) / N * 1e6)
    t = time.perf_counter()
    for k in raw:
        core.lookup(nsh, k)
    res["lookup"].append((time.perf_counter() - t) / N * 1e6)
    t = time.perf_counter()
    for k in raw:
        lid, hit, _ = core.lease(nsh, k)
        core.load(lid, out, 1)
        core.release(lid)
    res["lease_load_release"].append((time.perf_counter() - t) / N * 1e6)
print(json.dumps({k: round(statistics.median(v), 3) for k, v in res.items()}))
