"""``kvtier bench ssd``: the SSD pool against the limits and baselines on the same device, all in
one run, page cache bypassed (pool and raw loops use O_DIRECT; file baselines are read cold).

- ``read_ratio_to_raw_device`` / ``write_ratio_to_raw_device``: pool load / put throughput of
  2 MiB objects ÷ a raw sequential O_DIRECT loop (one 2 MiB transfer at a time, like ``dd``)
  over a file on the same file system; ``*_same_depth`` against the raw loop with the pool's
  queue depth.
- ``speedup_vs_file_per_object_small`` / ``_large``: cold read time of one file per object
  (LMCache-style, 256 KiB and 2 MiB) ÷ the pool's; ``write_speedup_*`` likewise for writes made
  durable (files + ``syncfs`` vs pool puts).
- ``striping_ratio_to_sum``: two devices throttled to rates 3:1 (token buckets: both are files on
  this one disk), bandwidth placement: aggregate read throughput ÷ the sum of each device's
  throughput measured alone; ``speedup_vs_round_robin`` on that pair.
- ``recovery_s_per_million_objects``: index-log replay + table rebuild at open, per million objects.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier import _core
from kvtier.errors import KvtierError
from kvtier.progress import progress
from kvtier.results import OMIT, Result

NS = bytes(range(16))
OBJECT_HEADER_BYTES = 64
PAGE_BYTES = 4096
LARGE = 2 * 2**20
SMALL = 256 * 2**10
BATCH = 64  # objects per put/get call: one request's worth of blocks


def _extent(object_bytes: int) -> int:
    return -(-(OBJECT_HEADER_BYTES + object_bytes) // PAGE_BYTES) * PAGE_BYTES


def _keys(first: int, n: int) -> bytes:
    return b"".join((first + i).to_bytes(16, "little") for i in range(n))


@dataclass(frozen=True)
class RawVsPool(Result):
    """The pool against a raw O_DIRECT loop over the same bytes (2 MiB objects); the ``*_depth``
    figures run the raw loop at the pool's depth (absent with the ``pread`` engine)."""

    large_objects: int
    large_bytes: int
    raw_read_gib_per_s: float
    raw_write_gib_per_s: float
    pool_read_gib_per_s: float
    pool_write_gib_per_s: float
    read_ratio_to_raw_device: float
    write_ratio_to_raw_device: float
    engine: str
    direct_io: bool
    read_p50_s: float
    read_p99_s: float
    raw_read_depth_gib_per_s: float | None = field(default=None, metadata=OMIT)
    raw_write_depth_gib_per_s: float | None = field(default=None, metadata=OMIT)
    read_ratio_to_raw_device_same_depth: float | None = field(default=None, metadata=OMIT)
    write_ratio_to_raw_device_same_depth: float | None = field(default=None, metadata=OMIT)


@dataclass(frozen=True)
class VsFiles(Result):
    """The pool against one file per object, at one object size."""

    speedup: float
    write_speedup: float
    files_read_mib_per_s: float
    files_write_mib_per_s: float
    pool_read_mib_per_s: float
    pool_write_mib_per_s: float


@dataclass(frozen=True)
class Striping(Result):
    """Two throttled devices (3:1) read at once, bandwidth-weighted against round-robin placement."""

    striping_throttle_bytes_per_s: list[float]
    striping_alone_bytes_per_s: list[float]
    striping_aggregate_bytes_per_s: float
    striping_ratio_to_sum: float
    speedup_vs_round_robin: float
    striping_bandwidth_source: str
    striping_probed_bytes_per_s: list[float]
    striping_objects_per_device: list[int]


@dataclass(frozen=True)
class Recovery(Result):
    recovery_objects: int
    recovery_s: float
    recovery_s_per_million_objects: float
    open_s_per_million_objects: float


@dataclass(frozen=True)
class SsdBench(Result):
    """What ``kvtier bench ssd`` reports: one flat JSON object (its parts' keys side by side, the
    file-per-object figures prefixed ``small_``/``large_``), as it always has."""

    directory: str
    io_depth: int
    load_average_1m_start: float
    raw: RawVsPool
    small: VsFiles
    large: VsFiles
    small_objects: int
    large_file_objects: int
    striping: Striping
    recovery: Recovery
    load_average_1m_end: float

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "bench": "ssd",
            "directory": self.directory,
            "io_depth": self.io_depth,
            "load_average_1m_start": self.load_average_1m_start,
            **self.raw.as_dict(),
        }
        for name, r in (("small", self.small), ("large", self.large)):
            out[f"speedup_vs_file_per_object_{name}"] = r.speedup
            out[f"write_speedup_vs_file_per_object_{name}"] = r.write_speedup
            for k in (
                "files_read_mib_per_s",
                "files_write_mib_per_s",
                "pool_read_mib_per_s",
                "pool_write_mib_per_s",
            ):
                out[f"{name}_{k}"] = getattr(r, k)
        out["small_objects"], out["large_file_objects"] = self.small_objects, self.large_file_objects
        return {
            **out,
            **self.striping.as_dict(),
            **self.recovery.as_dict(),
            "load_average_1m_end": self.load_average_1m_end,
        }


class _Pool:
    """An SsdPool in its own directory, closed and deleted on exit."""

    def __init__(self, root: Path, name: str, capacity: int, **options: Any) -> None:
        self.dir = root / name
        self.dir.mkdir()
        config: dict[str, Any] = {"directory": str(self.dir), "capacity_bytes": capacity, "probe_bytes": 0}
        config.update(options)
        self.pool = _core.SsdPool(config)

    def __enter__(self) -> _core.SsdPool:
        return self.pool

    def __exit__(self, *exc: object) -> None:
        self.pool.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _put_all(pool: _core.SsdPool, objects: npt.NDArray[np.uint8], first_key: int) -> float:
    n, size = objects.shape
    start = time.perf_counter()
    for i in range(0, n, BATCH):
        _, _, rejected, _ = pool.put(
            NS, _keys(first_key + i, min(BATCH, n - i)), objects[i : i + BATCH], size
        )
        if rejected:
            raise KvtierError(f"bench put rejected {rejected} objects: {pool.metrics()['warnings']}")
    return time.perf_counter() - start


def _get_all(pool: _core.SsdPool, out: npt.NDArray[np.uint8], first_key: int, batch: int = BATCH) -> float:
    n, size = out.shape
    start = time.perf_counter()
    for i in range(0, n, batch):
        outcomes = pool.get(NS, _keys(first_key + i, min(batch, n - i)), out[i : i + batch], size)
        if any(o != "loaded" for o in outcomes):
            raise KvtierError(f"bench get: {sorted(set(outcomes))}")
    return time.perf_counter() - start


def _aligned(n: int, size: int) -> npt.NDArray[np.uint8]:
    """An (n, size) array starting on a page, faulted in: like an engine's pinned buffers, so the
    pool can move whole-page objects in place (O_DIRECT, no copy)."""
    raw = np.empty(n * size + PAGE_BYTES, dtype=np.uint8)
    start = -raw.ctypes.data % PAGE_BYTES
    arr = raw[start : start + n * size].reshape(n, size)
    arr.fill(0)
    return arr


def _objects(n: int, size: int, seed: int) -> npt.NDArray[np.uint8]:
    arr = _aligned(n, size)
    arr[:] = np.random.default_rng(seed).integers(0, 256, (n, size), dtype=np.uint8)
    return arr


def _raw_vs_pool(root: Path, total: int, repeats: int, depth: int, engine: str) -> RawVsPool:
    n = max(1, total // LARGE)
    total = n * LARGE
    objects = _objects(n, LARGE, 1)
    out = _aligned(*objects.shape)
    raw = root / "raw.bin"
    best = {
        "raw_w": np.inf,
        "raw_r": np.inf,
        "raw_w_d": np.inf,
        "raw_r_d": np.inf,
        "put": np.inf,
        "get": np.inf,
    }
    direct = True
    with _Pool(root, "pool-raw", _extent(LARGE) * n * 2 + 2**20, io_depth=depth, io_engine=engine) as pool:
        for r in range(repeats):
            # dd-like: one 2 MiB buffer, one transfer at a time; then the pool's depth, cycling
            # through a batch's worth of memory as the pool's loads do. The file is kept between
            # repeats, so later rounds overwrite written blocks, as the pool's later rounds do.
            best["raw_w"] = min(
                best["raw_w"], _core.ssd_raw_sequential(str(raw), total, LARGE, True, 1, LARGE)
            )
            best["raw_r"] = min(
                best["raw_r"], _core.ssd_raw_sequential(str(raw), total, LARGE, False, 1, LARGE)
            )
            if engine != "pread":
                ring = BATCH * LARGE
                best["raw_w_d"] = min(
                    best["raw_w_d"], _core.ssd_raw_sequential(str(raw), total, LARGE, True, depth, ring)
                )
                best["raw_r_d"] = min(
                    best["raw_r_d"], _core.ssd_raw_sequential(str(raw), total, LARGE, False, depth, ring)
                )
            key = 1 + r * n  # fresh keys: a put of present keys is a no-op; old rounds get evicted
            best["put"] = min(best["put"], _put_all(pool, objects, key))
            best["get"] = min(best["get"], _get_all(pool, out, key))
        raw.unlink()
        if not np.array_equal(out[n // 2], objects[n // 2]):
            raise KvtierError("bench get returned wrong bytes")
        metrics = pool.metrics()
        direct = all(d["direct_io"] for d in metrics["devices"])
    gib = total / 2**30
    depth_run = engine != "pread"
    return RawVsPool(
        large_objects=n,
        large_bytes=total,
        raw_read_gib_per_s=gib / best["raw_r"],
        raw_write_gib_per_s=gib / best["raw_w"],
        pool_read_gib_per_s=gib / best["get"],
        pool_write_gib_per_s=gib / best["put"],
        read_ratio_to_raw_device=best["raw_r"] / best["get"],
        write_ratio_to_raw_device=best["raw_w"] / best["put"],
        engine=metrics["engine"],
        direct_io=direct,
        read_p50_s=metrics["devices"][0]["read_p50_s"],
        read_p99_s=metrics["devices"][0]["read_p99_s"],
        raw_read_depth_gib_per_s=gib / best["raw_r_d"] if depth_run else None,
        raw_write_depth_gib_per_s=gib / best["raw_w_d"] if depth_run else None,
        read_ratio_to_raw_device_same_depth=best["raw_r_d"] / best["get"] if depth_run else None,
        write_ratio_to_raw_device_same_depth=best["raw_w_d"] / best["put"] if depth_run else None,
    )


def _vs_files(root: Path, size: int, count: int, repeats: int, depth: int, engine: str) -> VsFiles:
    objects = _objects(count, size, 2)
    out = _aligned(*objects.shape)
    files = root / f"files-{size}"
    best = {"fw": np.inf, "fr": np.inf, "pw": np.inf, "pr": np.inf}
    one = np.empty(size, dtype=np.uint8)
    with _Pool(
        root, f"pool-{size}", _extent(size) * count * 2 + 2**20, io_depth=depth, io_engine=engine
    ) as pool:
        for r in range(repeats):
            files.mkdir()
            best["fw"] = min(best["fw"], _core.ssd_file_per_object(str(files), count, objects[0], True))
            best["fr"] = min(best["fr"], _core.ssd_file_per_object(str(files), count, one, False))
            shutil.rmtree(files)
            key = 1 + r * count
            best["pw"] = min(best["pw"], _put_all(pool, objects, key))
            best["pr"] = min(best["pr"], _get_all(pool, out, key))
    if not np.array_equal(one, objects[0]) or not np.array_equal(out[-1], objects[-1]):
        raise KvtierError("bench file-per-object comparison read wrong bytes")
    mib = count * size / 2**20
    return VsFiles(
        speedup=best["fr"] / best["pr"],
        write_speedup=best["fw"] / best["pw"],
        files_read_mib_per_s=mib / best["fr"],
        files_write_mib_per_s=mib / best["fw"],
        pool_read_mib_per_s=mib / best["pr"],
        pool_write_mib_per_s=mib / best["pw"],
    )


def _striping(
    root: Path, raw_read_bytes_per_s: float, count: int, repeats: int, depth: int, engine: str
) -> Striping:
    # Both devices are files on this one disk: throttle them to rates whose sum the disk can
    # serve, so each behaves as an independent device (a fast one and one a third as fast).
    fast = 0.3 * raw_read_bytes_per_s
    rates = [fast, fast / 3]
    objects = _objects(count, LARGE, 3)
    out = _aligned(*objects.shape)
    capacity = 2 * _extent(LARGE) * count + 2**20
    common = {"io_depth": depth, "io_engine": engine}

    def measure(name: str, throttles: list[float], **options: Any) -> tuple[float, _core.SsdMetrics]:
        devices = [str(root / name / f"dev{i}.kvtd") for i in range(len(throttles))]
        with _Pool(
            root, name, capacity, devices=devices, throttle_bytes_per_s=throttles, **options, **common
        ) as pool:
            _put_all(pool, objects, 1)
            # One batch: every device reads at once. Best of `repeats` reads (O_DIRECT: cold each time).
            seconds = min(_get_all(pool, out, 1, batch=count) for _ in range(repeats))
            return seconds, pool.metrics()

    alone = [count * LARGE / measure(f"alone-{i}", [rate])[0] for i, rate in enumerate(rates)]
    pair_s, pair = measure("pair", rates, probe_bytes=32 * 2**20)
    rr_s, _ = measure("pair-rr", rates, placement="round_robin", bandwidth_bytes_per_s=rates)
    aggregate = count * LARGE / pair_s
    return Striping(
        striping_throttle_bytes_per_s=rates,
        striping_alone_bytes_per_s=alone,
        striping_aggregate_bytes_per_s=aggregate,
        striping_ratio_to_sum=aggregate / sum(alone),
        speedup_vs_round_robin=rr_s / pair_s,
        striping_bandwidth_source=pair["bandwidth_source"],
        striping_probed_bytes_per_s=[d["read_bytes_per_s"] for d in pair["devices"]],
        striping_objects_per_device=[d["objects"] for d in pair["devices"]],
    )


def _recovery(root: Path, objects: int, depth: int, engine: str) -> Recovery:
    payload = np.full((BATCH * 64, 1), 7, dtype=np.uint8)  # 1-byte payloads: one page each
    config = {"io_depth": depth, "io_engine": engine}
    with _Pool(root, "pool-recovery", objects * PAGE_BYTES + 2**20, **config) as pool:
        for i in range(0, objects, len(payload)):
            k = min(len(payload), objects - i)
            pool.put(NS, _keys(1 + i, k), payload[:k], 1)
        pool.close()
        start = time.perf_counter()
        reopened = _core.SsdPool({"directory": str(root / "pool-recovery"), "probe_bytes": 0, **config})
        open_s = time.perf_counter() - start
        recovery = reopened.metrics()["recovery"]
        reopened.close()
    if recovery["recovered_objects"] != objects:
        raise KvtierError(f"recovery found {recovery['recovered_objects']} of {objects} objects")
    return Recovery(
        recovery_objects=objects,
        recovery_s=recovery["seconds"],
        recovery_s_per_million_objects=recovery["seconds"] * 1e6 / objects,
        open_s_per_million_objects=open_s * 1e6 / objects,
    )


def run(
    directory: str | None = None,
    total_bytes: int = 2**30,
    small_count: int = 2048,
    large_count: int = 256,
    stripe_count: int = 128,
    recovery_objects: int = 100_000,
    repeats: int = 3,
    io_depth: int = 8,
    io_engine: str = "auto",
    show: bool = True,
) -> SsdBench:
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-ssd-", dir=directory))
    try:
        steps = iter(progress(range(5), 5, "bench ssd", enabled=show))
        next(steps)
        # This machine may be shared: the load says how much the CPU-side figures were disturbed.
        load_start = os.getloadavg()[0]
        raw = _raw_vs_pool(root, total_bytes, repeats, io_depth, io_engine)
        next(steps)
        small = _vs_files(root, SMALL, small_count, repeats, io_depth, io_engine)
        next(steps)
        large = _vs_files(root, LARGE, large_count, repeats, io_depth, io_engine)
        next(steps)
        striping = _striping(root, raw.raw_read_gib_per_s * 2**30, stripe_count, repeats, io_depth, io_engine)
        next(steps)
        recovery = _recovery(root, recovery_objects, io_depth, io_engine)
        result = SsdBench(
            directory=str(root.parent),
            io_depth=io_depth,
            load_average_1m_start=load_start,
            raw=raw,
            small=small,
            large=large,
            small_objects=small_count,
            large_file_objects=large_count,
            striping=striping,
            recovery=recovery,
            load_average_1m_end=os.getloadavg()[0],
        )
        for _ in steps:
            pass
        return result
    finally:
        shutil.rmtree(root, ignore_errors=True)


def summary(result: SsdBench) -> str:
    r = result.as_dict()  # the summary names the figures by their JSON keys
    lines = [
        f"ssd bench in {r['directory']} ({r['engine']}, depth {r['io_depth']}, O_DIRECT {r['direct_io']})",
        f"  raw O_DIRECT loop  read {r['raw_read_gib_per_s']:.2f} GiB/s  write {r['raw_write_gib_per_s']:.2f} GiB/s "
        f"({r['large_objects']} x 2 MiB)",
        f"  pool               read {r['pool_read_gib_per_s']:.2f} GiB/s  write {r['pool_write_gib_per_s']:.2f} GiB/s",
        f"  read_ratio_to_raw_device {r['read_ratio_to_raw_device']:.2f}   "
        f"write_ratio_to_raw_device {r['write_ratio_to_raw_device']:.2f}",
    ]
    if "read_ratio_to_raw_device_same_depth" in r:
        lines.append(
            f"  (raw loop at depth {r['io_depth']}: read {r['raw_read_depth_gib_per_s']:.2f} GiB/s, ratio "
            f"{r['read_ratio_to_raw_device_same_depth']:.2f}; write {r['raw_write_depth_gib_per_s']:.2f} GiB/s, "
            f"ratio {r['write_ratio_to_raw_device_same_depth']:.2f})"
        )
    lines += [
        f"  vs file per object, cold read: 256 KiB {r['speedup_vs_file_per_object_small']:.2f}x  "
        f"2 MiB {r['speedup_vs_file_per_object_large']:.2f}x  (durable write: "
        f"{r['write_speedup_vs_file_per_object_small']:.2f}x, {r['write_speedup_vs_file_per_object_large']:.2f}x)",
        f"  striping 3:1 pair: ratio to sum {r['striping_ratio_to_sum']:.2f}, "
        f"speedup vs round-robin {r['speedup_vs_round_robin']:.2f}x "
        f"(objects per device {r['striping_objects_per_device']})",
        f"  recovery: {r['recovery_s_per_million_objects']:.2f} s per million objects "
        f"({r['recovery_objects']} objects in {r['recovery_s']:.3f} s)",
        f"  load average (1 min) {r['load_average_1m_start']:.1f} at start, {r['load_average_1m_end']:.1f} at end",
    ]
    return "\n".join(lines)
