"""One side of one round of ``kvtier bench peers``, in a process of its own (see
:mod:`kvtier.bench.peers`): ``python -P peers_worker.py SIDE PART SPEC_JSON`` prints one line
``RESULT {json}`` with the timed seconds of each operation and, where a row has one, a plain
memcpy of the same bytes timed in this same process.

SIDE is ``kvtier`` (run by kvtier's interpreter), ``lmcache`` or ``mooncake`` (run by the peer
environment's interpreter, where kvtier is not installed: this file imports no kvtier module at
its top, only inside the kvtier functions). ``mooncake holder`` is the segment-holder process.
PART is ``dram`` (store, retrieve, store from a paged pool, retrieve into it), ``lookup``
(hash + lookup of a 128K-token prompt from a list and from an int64 array), ``remote`` or ``ssd``
(put, durable put, cold get: :mod:`kvtier.bench.peers_ssd`, loaded by path; kvtier's cold get
runs as ``kvtier ssd_cold_get``, a process of its own).

Both sides get the same bytes: a round's seed draws the same random objects in every process.
Each timed call is checked outside its timed region (returned bytes equal to what was stored,
counts equal to what was asked); a wrong answer ends the worker with an error, never a figure.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:  # the peers' environment has no kvtier: types only
    from kvtier.bench.peers_protocol import Spec, WorkerResult

LAYERS, HEADS, HEAD_DIM, DTYPE_BYTES = 32, 8, 128, 2  # Llama-3-8B KV, bf16
BLOCK_TOKENS = 16  # kvtier objects
CHUNK_TOKENS = 256  # LMCache's default chunk
TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD_DIM * DTYPE_BYTES  # 128 KiB
BLOCK_BYTES = TOKEN_BYTES * BLOCK_TOKENS  # 2 MiB
SEGMENT_BYTES = BLOCK_BYTES // (2 * LAYERS)  # one layer's K (or V) of one block
REMOTE_OBJECTS, REMOTE_OBJECT_BYTES, REMOTE_BATCH = 32, 4 * 2**20, 16
Array = npt.NDArray[Any]
T = TypeVar("T")


# ---------------------------------------------------------------- shared by both sides (numpy)
def objects(spec: Spec) -> Array:
    """The round's bytes as ``(n, BLOCK_BYTES)`` uint8 (kvtier's BlockFirst objects: per block,
    layer 0's K and V, then layer 1's ...); the same in every process of a round."""
    n = int(spec["bytes"]) // BLOCK_BYTES
    n -= n % (CHUNK_TOKENS // BLOCK_TOKENS)  # whole LMCache chunks
    rng = np.random.default_rng(int(spec["seed"]))
    return rng.integers(0, 256, (n, BLOCK_BYTES), dtype=np.uint8)


def remote_objects(spec: Spec) -> Array:
    """The round's ``REMOTE_OBJECTS`` objects of ``REMOTE_OBJECT_BYTES`` for the remote rows."""
    rng = np.random.default_rng(1000 + int(spec["seed"]))
    return rng.integers(0, 256, (REMOTE_OBJECTS, REMOTE_OBJECT_BYTES), dtype=np.uint8)


def tokens(spec: Spec, phase: int, count: int) -> list[int]:
    """Distinct token ids per round and phase (so no phase hits what an earlier one stored)."""
    base = (int(spec["seed"]) * 8 + phase) * 1_000_000
    return list(range(base, base + count))


def pool_of(buffer: Array, n: int) -> Array:
    """``buffer`` as a LayerFirst pool ``[layer, 2, block, segment]`` of ``n`` blocks, the layout
    of vLLM's per-layer ``(2, num_blocks, block_size, heads, head_dim)`` tensors stacked."""
    return buffer.reshape(-1)[: n * BLOCK_BYTES].reshape(LAYERS, 2, n, SEGMENT_BYTES)


def scatter(objs: Array, pool: Array, ids: Array) -> None:
    """Object ``b`` into pool block ``ids[b]`` (set-up, untimed)."""
    pool[:, :, ids] = objs.reshape(len(objs), LAYERS, 2, SEGMENT_BYTES).transpose(1, 2, 0, 3)


def pool_holds(pool: Array, objs: Array, ids: Array) -> bool:
    """Whether pool block ``ids[b]`` equals object ``b`` for every ``b`` (64 blocks at a time)."""
    view = objs.reshape(len(objs), LAYERS, 2, SEGMENT_BYTES)
    for b in range(0, len(objs), 64):
        got = pool[:, :, ids[b : b + 64]].transpose(2, 0, 1, 3)
        if not np.array_equal(got, view[b : b + 64]):
            return False
    return True


def dram_result(
    memcpy_s: float, nbytes: int, times: tuple[float, float, float, float], config: str
) -> WorkerResult:
    """One side's DRAM figures, in the shape both sides report: seconds of store, retrieve, pool
    store and pool retrieve beside the memcpy of the same bytes in the same process."""
    ops = dict(zip(("store", "retrieve", "pool_store", "pool_retrieve"), times, strict=True))
    return {"memcpy_s": memcpy_s, "bytes": nbytes, "ops": ops, "config": config}


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def check(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"peers worker: {what}")


def best(fn: Callable[[], object], repeats: int) -> float:
    return min(timed(fn)[0] for _ in range(repeats))


# ---------------------------------------------------------------- kvtier (kvtier's environment)
def kvtier_dram(spec: Spec) -> WorkerResult:
    from kvtier import _core
    from kvtier.config import DramConfig, StoreConfig
    from kvtier.geometry import Geometry
    from kvtier.layout import PagedPool
    from kvtier.store import Store

    geometry = Geometry.llama3_8b()
    assert geometry.block_bytes == BLOCK_BYTES
    objs = objects(spec)
    n = len(objs)
    out = np.zeros_like(objs)
    memcpy_s = best(lambda: _core.memcpy(out, objs), 3)
    config = StoreConfig(
        geometry=geometry,
        model_id="bench-peers",
        dram=DramConfig(capacity_bytes=int(3.3 * objs.nbytes), prefault=True),
        copy_threads=int(spec.get("copy_threads", 0)),
    )
    store = Store(config)  # room for the warm-up, plain and pool puts: no eviction, as LMCache's clears
    keys_of = store.namespace.block_keys
    warm = store.put(keys_of(tokens(spec, 0, n * BLOCK_TOKENS)), objs)
    check(warm.stored == n, f"warm-up put stored {warm.stored} of {n}")
    plain, pooled = tokens(spec, 1, n * BLOCK_TOKENS), tokens(spec, 2, n * BLOCK_TOKENS)

    store_s, report = timed(lambda: store.put(keys_of(plain), objs))
    check(report.stored == n, f"put stored {report} of {n}")

    def retrieve() -> int:
        with store.lease(keys_of(plain)) as lease:
            return store.load(lease, out).loaded_blocks if lease.hit_blocks == n else -1

    out.fill(0)
    retrieve_s, loaded = timed(retrieve)
    check(loaded == n and np.array_equal(out, objs), f"retrieve loaded {loaded} of {n} or wrong bytes")

    pool = pool_of(out, n)  # the engine's pool, in the memory `out` held
    paged = PagedPool.layer_first(geometry, out.reshape(-1))
    ids = np.arange(n)[::-1].copy()  # a reversed block table, as in `kvtier bench store`
    scatter(objs, pool, ids)
    pool_store_s, report = timed(lambda: store.put_from_pool(keys_of(pooled), paged, ids))
    check(report.stored == n, f"put_from_pool stored {report} of {n}")

    def retrieve_into_pool() -> int:
        with store.lease(keys_of(pooled)) as lease:
            got = store.load_into_pool(lease, paged, ids) if lease.hit_blocks == n else None
            return -1 if got is None or got.failed else got.loaded_blocks

    out.fill(0)
    pool_retrieve_s, loaded = timed(retrieve_into_pool)
    check(
        loaded == n and pool_holds(pool, objs, ids), f"load_into_pool loaded {loaded} of {n} or wrong bytes"
    )
    stats = store.stats()
    check(stats.checksum_failures == 0 and stats.evictions == 0, f"unexpected store stats {stats}")
    times = (store_s, retrieve_s, pool_store_s, pool_retrieve_s)
    return dram_result(
        memcpy_s, objs.nbytes, times, f"copy_threads={config.copy_threads}, dram_prefault, 16-token objects"
    )


def kvtier_lookup(spec: Spec) -> WorkerResult:
    """Hash + lookup of the prompt, all blocks present; the small geometry of ``kvtier bench
    store``'s lookup (lookup cost does not depend on block size)."""
    from kvtier.config import DramConfig, StoreConfig
    from kvtier.geometry import Geometry
    from kvtier.store import Store

    geometry = Geometry(1, 1, 64, "fp16", BLOCK_TOKENS)
    count = int(spec["lookup_tokens"])
    n = count // BLOCK_TOKENS
    store = Store(
        StoreConfig(
            geometry=geometry,
            model_id="bench-peers-lookup",
            dram=DramConfig(capacity_bytes=3 * n * geometry.block_bytes),
        )
    )
    array = np.random.default_rng(1).integers(0, 128_000, count)
    as_list = array.tolist()
    store.put(store.namespace.block_keys(array), np.zeros((n, geometry.block_bytes), dtype=np.uint8))

    def hash_and_lookup(prompt: Any) -> int:
        return store.lookup(store.namespace.block_keys(prompt)).hit_blocks

    ops = {}
    for name, prompt in (("list", as_list), ("array", array)):
        check(hash_and_lookup(prompt) == n, f"{name}: not every block hit")
        ops[name] = best(partial(hash_and_lookup, prompt), int(spec["lookup_repeats"]))
    return {"ops": ops, "config": f"{n} blocks of {BLOCK_TOKENS} tokens"}


def kvtier_remote(spec: Spec) -> WorkerResult:
    """kvtier's remote tier (verified objects on a loopback Redis), as ``kvtier bench remote``."""
    from kvtier.bench.remote import _Round
    from kvtier.remote import RemotePool

    objs = remote_objects(spec)
    options = {"urls": [spec["redis_url"]], "cluster": False, "key_prefix": "kvtier-peers:"}
    pool = RemotePool(options, bytes(range(16)))
    out = np.zeros_like(objs)
    first = 1 + int(spec["seed"]) * 4 * REMOTE_OBJECTS
    warm = _Round(pool, objs, REMOTE_BATCH, first)  # connections and server buffers, untimed
    warm.put()
    warm.get(out)
    warm.clean_kvtier()
    rd = _Round(pool, objs, REMOTE_BATCH, first + REMOTE_OBJECTS)
    put_s, _ = timed(rd.put)
    out.fill(0)
    get_s, _ = timed(lambda: rd.get(out))
    check(np.array_equal(out, objs), "remote get returned wrong bytes")
    rd.clean_kvtier()
    return {"ops": {"put": put_s, "get": get_s}, "bytes": objs.nbytes}


# ---------------------------------------------------------------- LMCache (the peer environment)
def _lmcache_engine(name: str, kv_shape: tuple[int, ...], cpu_gib: float, **config_extra: Any) -> Any:
    import torch  # type: ignore[import-not-found, unused-ignore]
    from lmcache.v1.cache_engine import LMCacheEngineBuilder  # type: ignore[import-not-found, unused-ignore]
    from lmcache.v1.config import LMCacheEngineConfig  # type: ignore[import-not-found, unused-ignore]
    from lmcache.v1.gpu_connector import GPUConnectorInterface  # type: ignore[import-not-found, unused-ignore]
    from lmcache.v1.metadata import LMCacheMetadata  # type: ignore[import-not-found, unused-ignore]

    layers, _, chunk, heads, head_dim = kv_shape

    class NumpyConnector(GPUConnectorInterface):  # type: ignore[misc]
        """What LMCache's vLLM connector does, with numpy copies on the CPU (its CUDA kernels are
        not in the wheel here): ``objects`` (flat, a whole token range) or a paged ``pool``
        ``[layer, 2, slot, heads*head_dim]`` with ``slot_mapping`` (one slot per token, as
        ``block_id * block_size + offset``), to and from a chunk in KV_2LTD."""

        def _obj(self, memory_obj: Any, n: int) -> Array:
            obj: Array = memory_obj.tensor.view(torch.int16).numpy()
            return obj.reshape(2, layers, n, heads * head_dim)

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
            obj = self._obj(memory_obj, end - start)
            if "pool" in kw:
                for layer in range(layers):
                    for kv in (0, 1):
                        np.take(
                            kw["pool"][layer, kv], kw["slot_mapping"][start:end], axis=0, out=obj[kv, layer]
                        )
            else:
                raw = obj.reshape(-1).view(np.uint8)
                np.copyto(raw, kw["objects"][start * raw.nbytes // (end - start) :][: raw.nbytes])

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
            obj = self._obj(memory_obj, end - start)
            if "pool" in kw:
                for layer in range(layers):
                    for kv in (0, 1):
                        kw["pool"][layer, kv][kw["slot_mapping"][start:end]] = obj[kv, layer]
            else:
                raw = obj.reshape(-1).view(np.uint8)
                np.copyto(kw["objects"][start * raw.nbytes // (end - start) :][: raw.nbytes], raw)

        def batched_from_gpu(self, objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
            for obj, start, end in zip(objs, starts, ends, strict=True):
                self.from_gpu(obj, start, end, **kw)

        def batched_to_gpu(self, objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
            for obj, start, end in zip(objs, starts, ends, strict=True):
                self.to_gpu(obj, start, end, **kw)

        def get_shape(self, num_tokens: int) -> Any:
            return torch.Size([2, layers, num_tokens, heads * head_dim])

    config = LMCacheEngineConfig.from_defaults(
        chunk_size=chunk, local_cpu=True, max_local_cpu_size=cpu_gib, lmcache_instance_id=name, **config_extra
    )
    metadata = LMCacheMetadata(
        model_name=name, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.bfloat16, kv_shape=kv_shape,
    )  # fmt: skip
    engine = LMCacheEngineBuilder.get_or_create(
        name, config, metadata, NumpyConnector(), lambda t, r: None, lambda o, r: o
    )
    engine.post_init()
    return engine


def lmcache_dram(spec: Spec) -> WorkerResult:
    objs = objects(spec)
    n = len(objs)
    ntok = n * BLOCK_TOKENS
    out = np.zeros_like(objs)
    memcpy_s = best(lambda: np.copyto(out, objs), 3)
    flat_in, flat_out = objs.reshape(-1), out.reshape(-1)
    engine = _lmcache_engine(
        "bench-peers", (LAYERS, 2, CHUNK_TOKENS, HEADS, HEAD_DIM), 2.2 * objs.nbytes / 2**30
    )
    engine.store(tokens(spec, 0, ntok), objects=flat_in)  # warm-up: faults the allocator's pages in
    engine.clear()  # LocalCPUBackend keeps no eviction work in the timed puts (kvtier: room for all)
    plain, pooled = tokens(spec, 1, ntok), tokens(spec, 2, ntok)
    store_s, _ = timed(lambda: engine.store(plain, objects=flat_in))
    check(engine.lookup(plain) == ntok, "store did not keep every chunk")
    out.fill(0)
    retrieve_s, mask = timed(lambda: engine.retrieve(plain, objects=flat_out))
    check(
        int(mask.sum()) == ntok and np.array_equal(out, objs),
        "retrieve missed tokens or returned wrong bytes",
    )
    engine.clear()

    pool = pool_of(out, n)
    ids = np.arange(n)[::-1].copy()
    scatter(objs, pool, ids)
    slots = (ids[:, None] * BLOCK_TOKENS + np.arange(BLOCK_TOKENS)).reshape(-1)  # block_id * size + offset
    pool_kv = out.reshape(-1).view(np.int16).reshape(LAYERS, 2, n * BLOCK_TOKENS, HEADS * HEAD_DIM)
    pool_store_s, _ = timed(lambda: engine.store(pooled, pool=pool_kv, slot_mapping=slots))
    check(engine.lookup(pooled) == ntok, "pool store did not keep every chunk")
    out.fill(0)
    pool_retrieve_s, mask = timed(lambda: engine.retrieve(pooled, pool=pool_kv, slot_mapping=slots))
    check(
        int(mask.sum()) == ntok and pool_holds(pool, objs, ids), "pool retrieve missed tokens or wrong bytes"
    )
    times = (store_s, retrieve_s, pool_store_s, pool_retrieve_s)
    config = f"LMCacheEngine -> LocalCPUBackend, {CHUNK_TOKENS}-token chunks, numpy-copy connector"
    return dram_result(memcpy_s, objs.nbytes, times, config)


def lmcache_lookup(spec: Spec) -> WorkerResult:
    import torch  # type: ignore[import-not-found, unused-ignore]

    count = int(spec["lookup_tokens"])
    engine = _lmcache_engine("bench-peers-lookup", (1, 2, CHUNK_TOKENS, 1, 64), 0.25)
    array = np.random.default_rng(1).integers(0, 128_000, count)
    as_list = array.tolist()
    engine.store(as_list, objects=np.zeros(count * 2 * 64 * DTYPE_BYTES, dtype=np.uint8))
    ops = {}
    for name, prompt in (("list", as_list), ("array", torch.from_numpy(array))):
        check(engine.lookup(prompt) == count, f"{name}: not every chunk hit")
        ops[name] = best(partial(engine.lookup, prompt), int(spec["lookup_repeats"]))
    return {"ops": ops, "config": f"{count // CHUNK_TOKENS} chunks of {CHUNK_TOKENS} tokens"}


# ---------------------------------------------------------------- the SSD rows (peers_ssd.py)
def _peers_ssd() -> Any:
    """``peers_ssd.py`` beside this file, loaded by path: the peers' environment has no kvtier."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers_ssd.py")
    module_spec = importlib.util.spec_from_file_location("peers_ssd", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def _ssd_objects(spec: Spec) -> tuple[Array, Callable[[int], list[int]]]:
    """The SSD rows' objects: KV-like bf16 values (``peers_ssd.kv_objects``), not random bytes."""
    per_chunk = CHUNK_TOKENS // BLOCK_TOKENS
    count = int(spec["ssd_bytes"]) // BLOCK_BYTES // per_chunk * per_chunk  # whole LMCache chunks
    objs = _peers_ssd().kv_objects(count, 1000 + int(spec["seed"]), spec["kv_fixture"])
    return objs, lambda phase: tokens(spec, phase, len(objs) * BLOCK_TOKENS)


def kvtier_ssd(spec: Spec) -> WorkerResult:
    objs, tokens_of = _ssd_objects(spec)
    result: WorkerResult = _peers_ssd().kvtier_ssd(spec, objs, tokens_of, os.path.abspath(__file__))
    return result


def kvtier_ssd_cold_get(spec: Spec) -> WorkerResult:
    objs, tokens_of = _ssd_objects(spec)
    result: WorkerResult = _peers_ssd().kvtier_ssd_cold_get(spec, objs, tokens_of)
    return result


def lmcache_ssd(spec: Spec) -> WorkerResult:
    import shutil
    import tempfile

    objs, tokens_of = _ssd_objects(spec)
    disk = tempfile.mkdtemp(prefix="lmcache-peers-ssd-", dir=spec["ssd_root"])
    gib = objs.nbytes / 2**30
    try:
        engine = _lmcache_engine(
            f"bench-peers-ssd-{spec['seed']}", (LAYERS, 2, CHUNK_TOKENS, HEADS, HEAD_DIM), 2.3 * gib,
            local_disk=disk, max_local_disk_size=2.3 * gib,
        )  # fmt: skip
        result: WorkerResult = _peers_ssd().lmcache_ssd(objs, tokens_of, engine, CHUNK_TOKENS)
        return result
    finally:
        shutil.rmtree(disk, ignore_errors=True)


# ---------------------------------------------------------------- Mooncake Store over TCP
def _mooncake(spec: Spec, segment_bytes: int) -> Any:
    from mooncake.store import MooncakeDistributedStore  # type: ignore[import-not-found, unused-ignore]

    store = MooncakeDistributedStore()
    local_buffer = 16 * 2**20 if segment_bytes else 2 * REMOTE_BATCH * REMOTE_OBJECT_BYTES
    rc = store.setup("127.0.0.1", spec["metadata"], segment_bytes, local_buffer, "tcp", "", spec["master"])
    check(rc == 0, f"mooncake setup returned {rc}")
    return store


def mooncake_holder(spec: Spec) -> WorkerResult:
    """The segment holder: mounts ``segment_bytes`` of memory for the store and waits."""
    store = _mooncake(spec, int(spec["segment_bytes"]))
    print("READY", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    store.close()
    return {}


def mooncake_remote(spec: Spec) -> WorkerResult:
    store = _mooncake(spec, 0)
    objs = remote_objects(spec)
    out = np.zeros_like(objs)
    for arr in (objs, out):
        check(store.register_buffer(arr.ctypes.data, arr.nbytes) == 0, "register_buffer failed")
    size = REMOTE_OBJECT_BYTES

    def batches(arr: Array, prefix: str) -> list[tuple[list[str], list[int], list[int]]]:
        out_ = []
        for b in range(0, REMOTE_OBJECTS, REMOTE_BATCH):
            ids = range(b, min(b + REMOTE_BATCH, REMOTE_OBJECTS))
            out_.append(
                ([f"{prefix}-{i}" for i in ids], [arr.ctypes.data + i * size for i in ids], [size] * len(ids))
            )
        return out_

    def put(prefix: str) -> list[int]:
        return [
            rc
            for keys, ptrs, sizes in batches(objs, prefix)
            for rc in store.batch_put_from(keys, ptrs, sizes)
        ]

    def get(prefix: str) -> list[int]:
        return [
            rc for keys, ptrs, sizes in batches(out, prefix) for rc in store.batch_get_into(keys, ptrs, sizes)
        ]

    warm, prefix = f"w{spec['seed']}", f"r{spec['seed']}"
    check(set(put(warm)) == {0} and set(get(warm)) == {size}, "warm-up put/get failed")
    # As kvtier's side deletes its warm-up objects before its timed put, so the timed put may
    # reuse memory the warm-up already touched (the holder's segment) instead of faulting in more.
    store.remove_all(True)
    put_s, codes = timed(lambda: put(prefix))
    check(set(codes) == {0}, f"put returned {sorted(set(codes))}")
    out.fill(0)
    get_s, codes = timed(lambda: get(prefix))
    check(set(codes) == {size} and np.array_equal(out, objs), "get returned errors or wrong bytes")
    store.remove_all(True)
    store.close()
    return {"ops": {"put": put_s, "get": get_s}, "bytes": objs.nbytes}


WORKERS: dict[tuple[str, str], Callable[[Spec], WorkerResult]] = {
    ("kvtier", "dram"): kvtier_dram,
    ("kvtier", "lookup"): kvtier_lookup,
    ("kvtier", "remote"): kvtier_remote,
    ("kvtier", "ssd"): kvtier_ssd,
    ("kvtier", "ssd_cold_get"): kvtier_ssd_cold_get,
    ("lmcache", "ssd"): lmcache_ssd,
    ("lmcache", "dram"): lmcache_dram,
    ("lmcache", "lookup"): lmcache_lookup,
    ("mooncake", "remote"): mooncake_remote,
    ("mooncake", "holder"): mooncake_holder,
}

if __name__ == "__main__":
    side, part, text = sys.argv[1:4]
    result = WORKERS[side, part](json.loads(text))
    # Strict JSON (no NaN literal); kvtier.results.json_text is not importable in the peers' environment.
    print("RESULT " + json.dumps(result, sort_keys=True, allow_nan=False), flush=True)
    sys.stderr.flush()
    os._exit(0)  # LMCache leaves non-daemon threads (stats logger, event loop) that never end
