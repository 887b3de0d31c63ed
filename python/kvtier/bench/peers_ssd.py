"""The SSD rows of ``kvtier bench peers``: kvtier's SSD tier against LMCache's ``LocalDiskBackend``,
one side per process (called from :mod:`kvtier.bench.peers_worker`, which hands over the round's
objects and token ids; the table's rows are in :mod:`kvtier.bench.peers`). The objects are
KV-like bf16 values (:func:`kv_objects`), the same bytes on both sides.

- ``ssd_put``: like for like, both sides' bytes in the page cache when the clock stops: kvtier
  ``Store.put`` with ``ssd.write_through``, ``ssd.durability="none"`` and ``ssd.direct_io=False``
  (DRAM big enough for every block, so the put copies each block to DRAM and, before it returns,
  hands it to the kernel: buffered writes) against ``LMCacheEngine.store`` (``LocalCPUBackend`` +
  ``LocalDiskBackend``, which writes one file per chunk from its own threads) timed until its
  pending writes are done: every chunk in the backend's index and no put task left.
- ``ssd_direct_put``: kvtier the same with O_DIRECT (its default: on the device when ``put``
  returns) against the same LMCache put (its figure reused): kvtier guarantees more here.
- ``ssd_durable_put``: kvtier with ``ssd.durability="fsync"`` (O_DIRECT + ``fdatasync``) against
  the same LMCache put followed by ``fsync`` of each new file and of the directory (LMCache has
  no durable mode); the ``ssd_put`` files are fsynced before it, untimed, so no writeback of
  theirs is left pending. Both sides' bytes are on stable storage when the clock stops.
- ``ssd_cold_get``: kvtier in a fresh process opening the ``ssd_put`` directory (DRAM empty:
  every block from the device, O_DIRECT) against LMCache's retrieve after its CPU copies were
  cleared and its files fsynced and dropped from the page cache (``POSIX_FADV_DONTNEED``);
  each side reports the bytes of its files still in the page cache when the get starts (mincore).

Loaded by path (the peers' environment has no kvtier package): it imports nothing from kvtier
at its top and nothing from the worker. Every result is checked outside its timed region.
"""

from __future__ import annotations

import ctypes
import gc
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:  # the peers' environment has no kvtier: types only
    from kvtier.bench.peers_protocol import Spec, WorkerResult

PAGE_BYTES = 4096
WARM_BLOCKS = 16  # kvtier's warm-up put: one LMCache chunk's worth
DISK_WAIT_S = 600.0
Array = npt.NDArray[Any]
TokensOf = Callable[[int], list[int]]  # phase -> the round's token ids for that phase
T = TypeVar("T")


def _timed(fn: Callable[[], T]) -> tuple[float, T]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"peers ssd worker: {what}")


def aligned_like(objs: Array) -> Array:
    """A zeroed, faulted-in, page-aligned array shaped as ``objs`` (an engine's buffers are aligned; kvtier's
    O_DIRECT reads land in place only then). Both sides get one."""
    raw = np.zeros(objs.nbytes + PAGE_BYTES, dtype=np.uint8)
    start = -raw.ctypes.data % PAGE_BYTES
    arr: Array = raw[start : start + objs.nbytes].reshape(objs.shape)
    arr.fill(0)  # faulted in (np.zeros maps pages lazily): an engine's buffers are resident
    return arr


KV_SHAPE = (32, 2, 16, 8, 128)  # Llama-3-8B BlockFirst object: layer, K|V, token, kv head, dim


def bf16_bits(values: Array) -> Array:
    """``values`` (any float dtype) as bf16 bit patterns (``uint16``), rounded to nearest even."""
    u = values.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def kv_objects(count: int, seed: int, fixture: str | Path) -> Array:
    """``count`` Llama-3-8B-shaped bf16 KV objects (``(count, 2 MiB)`` uint8) whose values follow
    real KV: each element of channel (layer, K|V, head, dim) is drawn, independently per token,
    from the values that channel took in the SmolLM2-135M ``fixture`` (real KV from the reference
    engine, :mod:`kvtier.bench.kv_fixture`: the bench passes its path as the spec's ``kv_fixture``;
    channel ``(l % 30, kv, h % 3, d % 64)``: 320 tokens each), rounded to bf16. So each
    channel has the sign/exponent spread of real KV (what a lossless codec can exploit), but no
    object or run of bytes repeats (uniform random bytes, the bench's first version, compress not
    at all; real KV does). The same ``seed`` gives the same bytes in every process."""
    real = np.load(fixture)["kv"]  # [block, layer, K|V, token, head, dim] fp16
    samples = bf16_bits(real).transpose(1, 2, 4, 5, 0, 3).reshape(*real.shape[1:3], *real.shape[4:], -1)
    layers, kinds, heads, dims = KV_SHAPE[0], KV_SHAPE[1], KV_SHAPE[3], KV_SHAPE[4]
    table = samples[
        np.arange(layers)[:, None, None, None] % samples.shape[0],
        np.arange(kinds)[None, :, None, None],
        np.arange(heads)[None, None, :, None] % samples.shape[2],
        np.arange(dims)[None, None, None, :] % samples.shape[3],
    ]  # [layer, K|V, head, dim, sample]
    per = table.shape[-1]
    flat = table.reshape(-1)
    channel = np.arange(layers * kinds * heads * dims, dtype=np.int32).reshape(layers, kinds, 1, heads, dims)
    base = np.broadcast_to(channel * per, KV_SHAPE)
    rng = np.random.default_rng(seed)
    out = np.empty((count, int(np.prod(KV_SHAPE))), dtype=np.uint16)
    for i in range(count):
        np.take(flat, (base + rng.integers(0, per, KV_SHAPE, dtype=np.int32)).reshape(-1), out=out[i])
    return out.view(np.uint8)


def files_under(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


def resident_bytes(paths: list[Path]) -> int:
    """Bytes of ``paths`` in the page cache now (``mincore`` over a private read mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    total = 0
    for path in paths:
        size = path.stat().st_size
        if size == 0:
            continue
        pages = -(-size // PAGE_BYTES)
        vec = (ctypes.c_ubyte * pages)()
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE) as m:
            anchor = ctypes.c_char.from_buffer(m)
            try:
                rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec)
            finally:
                del anchor  # the mapping cannot close while a ctypes object points into it
            _check(rc == 0, f"mincore({path}) failed: errno {ctypes.get_errno()}")
        total += sum(1 for b in vec if b & 1) * PAGE_BYTES
    return min(total, sum(p.stat().st_size for p in paths))


def fsync_paths(paths: list[Path], directory: Path | None = None) -> None:
    """``fsync`` of each file, then of ``directory`` (a new file's name is durable only then)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if directory is not None:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_from_page_cache(paths: list[Path]) -> int:
    """fsync + ``POSIX_FADV_DONTNEED`` of each file (no global ``drop_caches``: other processes'
    caches stay); returns the bytes still cached afterwards."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return resident_bytes(paths)


def filesystem_of(path: Path) -> str:
    """``type (device)`` of the mount holding ``path``, from ``/proc/mounts``."""
    target, best, found = str(path.resolve()), "", "unknown"
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        device, mount, fstype = line.split()[:3]
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, found = mount, f"{fstype} ({device})"
    return found


def device_read_bytes() -> int:
    """Bytes this process (all its threads) has had read from storage (``/proc/self/io``): what a
    cold get must add up to, where the page cache served nothing."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise SystemExit("peers ssd worker: no read_bytes in /proc/self/io")


def _memcpy_s(copy: Callable[[], object]) -> float:
    return min(_timed(copy)[0] for _ in range(3))


# ---------------------------------------------------------------- kvtier (kvtier's environment)
# kvtier's timed puts, each in a store and directory of its own: (op, ssd.durability, ssd.direct_io).
# ``ssd_put`` hands the bytes to the kernel (page cache), as LMCache's buffered writes; the cold
# get reads its directory back with O_DIRECT in a fresh process.
KVTIER_PUTS = (
    ("ssd_put", "none", False),
    ("ssd_direct_put", "none", True),
    ("ssd_durable_put", "fsync", True),
)


def _kvtier_store(spec: Spec, directory: Path, durability: str, nbytes: int, direct: bool = True) -> Any:
    from kvtier.config import DramConfig, SsdConfig, StoreConfig
    from kvtier.geometry import Geometry
    from kvtier.store import Store

    return Store(
        StoreConfig(
            geometry=Geometry.llama3_8b(),
            model_id="bench-peers-ssd",
            # room for every block and the warm-up: no eviction
            dram=DramConfig(capacity_bytes=int(1.1 * nbytes) + 2**26, prefault=True),
            copy_threads=int(spec.get("copy_threads", 0)),
            ssd=SsdConfig(
                directory=str(directory),
                capacity_bytes=int(1.1 * nbytes) + 2**26,
                durability=durability,
                write_through=True,
                direct_io=direct,
                codec=str(spec.get("ssd_codec", "raw")),
                probe_bytes=0,  # one device: nothing to share out
            ),
        )
    )


def _kvtier_put(
    spec: Spec,
    directory: Path,
    mode: tuple[str, bool],
    objs: Array,
    warm: list[int],
    plain: list[int],
) -> tuple[float, list[bool]]:
    """One store in ``directory`` with ``mode`` (durability, O_DIRECT): a warm-up put, then the
    timed put of every object; the seconds and whether each device ran O_DIRECT. The store
    closes on return (index log flushed, lock released)."""
    n = len(objs)
    directory.mkdir()
    store = _kvtier_store(spec, directory, mode[0], objs.nbytes, direct=mode[1])
    keys_of = store.namespace.block_keys
    report = store.put(keys_of(warm), objs[:WARM_BLOCKS])
    _check(report.stored == WARM_BLOCKS, f"{directory.name}: warm-up stored {report.stored}")
    seconds, report = _timed(lambda: store.put(keys_of(plain), objs))
    stats = store.stats()
    _check(report.stored == n, f"{directory.name}: put stored {report.stored} of {n}")
    _check(
        stats.written_through == n + WARM_BLOCKS and stats.evictions == 0,
        f"{directory.name}: not every block went to SSD at put time: {stats}",
    )
    metrics = store.ssd_metrics() or {"devices": []}
    return seconds, [bool(d["direct_io"]) for d in metrics["devices"]]


def kvtier_ssd(spec: Spec, objs: Array, tokens_of: TokensOf, worker: Path) -> WorkerResult:
    """Both puts here (one store per durability, each its own directory), the cold get in a fresh
    process (``kvtier_ssd_cold_get``) over the ``ssd_put`` directory once this one closed it."""
    from kvtier import _core
    from kvtier.results import json_text

    out = aligned_like(objs)
    memcpy_s = _memcpy_s(lambda: _core.memcpy(out, objs))
    warm = tokens_of(0)[: WARM_BLOCKS * (len(tokens_of(0)) // len(objs))]
    ops: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-peers-ssd-", dir=spec["ssd_root"]) as tmp:
        root = Path(tmp)
        for op, durability, direct_io in KVTIER_PUTS:
            ops[op], direct = _kvtier_put(spec, root / op, (durability, direct_io), objs, warm, tokens_of(1))
            _check(
                bool(direct) and all(d == direct_io for d in direct),
                f"{op}: O_DIRECT {direct}, asked {direct_io}",
            )
            gc.collect()
        resident = drop_from_page_cache(files_under(root / "ssd_put"))  # fsync, then out of the page cache
        child = spec.copy()
        child["ssd_directory"] = str(root / "ssd_put")
        cmd = [sys.executable, "-P", str(worker), "kvtier", "ssd_cold_get", json_text(child)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        _check(proc.returncode == 0 and bool(lines), f"cold get: {(proc.stdout + proc.stderr)[-1500:]}")
        cold = json.loads(lines[-1][len("RESULT ") :])
        ops["ssd_cold_get"] = float(cold["get_s"])
    config = (
        f"write-through, DRAM holds all, probe off, codec {spec.get('ssd_codec', 'raw')}, "
        f"copy_threads={spec.get('copy_threads', 0)}; ssd_put buffered (direct_io=False), the other puts "
        "O_DIRECT; "
        f"cold get: fresh process, {resident + int(cold['resident_bytes'])} B of pool files cached, "
        f"{cold['device_read_bytes']} B read from the device ({cold['stored_bytes']} B stored)"
    )
    return {"memcpy_s": memcpy_s, "bytes": objs.nbytes, "ops": ops, "config": config}


def _stored_bytes(spec: Spec, objs: Array) -> int:
    """Bytes kvtier's SSD objects of ``objs`` hold: the objects themselves, or through the
    ``lossless`` codec (zstd, its default level) their encodings, computed here the same way."""
    if spec.get("ssd_codec", "raw") == "raw":
        return int(objs.nbytes)
    from kvtier import codec

    return sum(len(codec.encode(o, "lossless", backend="zstd")) for o in objs)


def kvtier_ssd_cold_get(spec: Spec, objs: Array, tokens_of: TokensOf) -> WorkerResult:
    """A fresh store over the ``ssd_put`` directory: DRAM empty, so every block is read from SSD."""
    from kvtier.errors import KvtierError

    n = len(objs)
    directory = Path(spec["ssd_directory"])
    deadline = time.monotonic() + 30
    while True:  # the parent's store lets go of the directory's lock shortly after it is dropped
        try:
            store = _kvtier_store(spec, directory, "none", objs.nbytes)
            break
        except KvtierError as e:
            _check("in use" in str(e) and time.monotonic() < deadline, f"cold get: open failed: {e}")
            time.sleep(0.05)
    keys_of = store.namespace.block_keys
    _check(store.tier_stats()["dram"].objects == 0, "DRAM not empty at open")
    out = aligned_like(objs)

    def get(tokens: list[int], into: Array) -> int:
        with store.lease(keys_of(tokens)) as lease:
            return int(store.load(lease, into).loaded_blocks) if lease.hit_blocks == len(into) else -1

    # Warm-up: the warm-up put's blocks, from SSD (this process's I/O and copy threads start), as
    # LMCache's side reads its warm-up chunk back before its timed get.
    warm = tokens_of(0)[: WARM_BLOCKS * (len(tokens_of(0)) // n)]
    _check(get(warm, out[:WARM_BLOCKS]) == WARM_BLOCKS, "warm-up get missed")
    resident = resident_bytes(files_under(directory))
    plain = tokens_of(1)
    read_before = device_read_bytes()
    get_s, loaded = _timed(lambda: get(plain, out))
    device_read = device_read_bytes() - read_before
    _check(loaded == n and np.array_equal(out, objs), f"cold get loaded {loaded} of {n} or wrong bytes")
    stored = _stored_bytes(spec, objs)
    _check(device_read >= stored, f"cold get read {device_read} B from the device, not {stored}")
    stats = store.stats()
    _check(
        stats.promoted_blocks == n + WARM_BLOCKS and stats.checksum_failures == 0,
        f"not all from SSD: {stats}",
    )
    return {
        "get_s": get_s,
        "resident_bytes": resident,
        "device_read_bytes": device_read,
        "stored_bytes": stored,
    }


# ---------------------------------------------------------------- LMCache (the peer environment)
def _wait_for_disk(disk: Any, chunks: int) -> None:
    """Until ``LocalDiskBackend`` has ``chunks`` files indexed and no put task pending."""
    deadline = time.monotonic() + DISK_WAIT_S
    while True:
        with disk.disk_worker.put_lock:
            pending = len(disk.disk_worker.put_tasks)
        if pending == 0 and len(disk.dict) >= chunks:
            return
        _check(
            time.monotonic() < deadline, f"LocalDiskBackend: {pending} writes pending after {DISK_WAIT_S}s"
        )
        time.sleep(0.001)


def lmcache_ssd(objs: Array, tokens_of: TokensOf, engine: Any, chunk_tokens: int) -> WorkerResult:
    """``engine``: a fresh LMCacheEngine (one per round: its ``LocalDiskBackend.remove`` never
    lowers ``current_cache_size``) with a CPU backend and a ``LocalDiskBackend`` in an empty
    directory, both with room for the warm-up and both puts."""
    out = aligned_like(objs)
    memcpy_s = _memcpy_s(lambda: np.copyto(out, objs))
    flat_in, flat_out = objs.reshape(-1), out.reshape(-1)
    manager = engine.storage_manager
    disk = manager.storage_backends["LocalDiskBackend"]
    directory = Path(disk.path)
    ntok = len(tokens_of(0))
    chunks = ntok // chunk_tokens
    # Warm-up: the CPU allocator's pages (disk bypassed, as kvtier's dram_prefault), then one chunk
    # through the disk path (its threads and event loop), as kvtier's warm-up put.
    manager.set_backend_bypass("LocalDiskBackend", True)
    engine.store(tokens_of(0), objects=flat_in)
    manager.clear(["LocalCPUBackend"])
    manager.set_backend_bypass("LocalDiskBackend", False)
    warm, warm_bytes = tokens_of(3)[:chunk_tokens], objs.nbytes // chunks
    engine.store(warm, objects=flat_in[:warm_bytes])
    _wait_for_disk(disk, 1)
    before = {m.path for m in disk.dict.values()}

    def put(phase: int, indexed: int) -> None:
        engine.store(tokens_of(phase), objects=flat_in)
        _wait_for_disk(disk, indexed)

    put_s, _ = _timed(lambda: put(1, 1 + chunks))
    plain_files = sorted(Path(m.path) for m in disk.dict.values() if m.path not in before)
    _check(len(plain_files) == chunks, f"put left {len(plain_files)} of {chunks} chunk files")

    fsync_paths(plain_files, directory)  # untimed: no writeback of the last put left to slow this one

    def durable_put() -> None:
        put(2, 1 + 2 * chunks)
        done = {str(p) for p in plain_files} | before
        fsync_paths([Path(m.path) for m in list(disk.dict.values()) if m.path not in done], directory)

    durable_put_s, _ = _timed(durable_put)
    _check(len(disk.dict) == 1 + 2 * chunks, f"durable put: {len(disk.dict)} files indexed")
    manager.clear(["LocalCPUBackend"])  # the retrieves must come from the disk backend
    mask = engine.retrieve(warm, objects=flat_out[:warm_bytes])  # warm-up: its read threads start
    _check(int(mask.sum()) == chunk_tokens, "warm-up retrieve missed")
    manager.clear(["LocalCPUBackend"])  # the retrieve wrote the chunk back to the CPU backend
    resident = drop_from_page_cache(plain_files)
    plain = tokens_of(1)
    _check(engine.lookup(plain) == ntok, "the disk backend does not hold every chunk")
    read_before = device_read_bytes()
    get_s, mask = _timed(lambda: engine.retrieve(plain, objects=flat_out))
    device_read = device_read_bytes() - read_before
    _check(int(mask.sum()) == ntok and np.array_equal(out, objs), "cold get missed tokens or wrong bytes")
    _check(device_read >= objs.nbytes, f"cold get read {device_read} B from the device, not {objs.nbytes}")
    config = (
        f"LMCacheEngine -> LocalCPUBackend + LocalDiskBackend ({chunk_tokens}-token chunk files, "
        f"buffered writes from its default 4 I/O threads); cold get: {resident} B of chunk files cached, "
        f"{device_read} B read from the device"
    )
    ops = {"ssd_put": put_s, "ssd_direct_put": put_s, "ssd_durable_put": durable_put_s, "ssd_cold_get": get_s}
    return {"memcpy_s": memcpy_s, "bytes": objs.nbytes, "ops": ops, "config": config}
