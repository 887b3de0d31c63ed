"""The disk's own ceiling under kvtier's SSD tier (docs/benchmarks.md, issue 19's SSD rows).

Usage: python scripts/ssd_ceiling.py [DIR] [--mib N] [--sizes 256K,1M,4M,16M] [--depths 1,4,8,32]
       [--modes write,rewrite,read,buffered,dsync,fsync_each,fsync_batch]

Times ``N`` MiB (default 512) of I/O on one file in ``DIR`` (default the system temp dir), with
``os.pwrite``/``os.preadv`` from ``depth`` threads (the GIL is released during each call, so
``depth`` calls are in flight), each call ``size`` bytes at its own offset:

- ``write``: O_DIRECT writes into a freshly ``fallocate``d file (unwritten extents, as a new
  kvtier pool's device file: each first write also converts its extent);
- ``rewrite``: O_DIRECT writes over blocks written before (a pool that has filled once);
- ``read``: O_DIRECT reads of written blocks (the page cache holds none of them);
- ``buffered``: plain ``pwrite`` into a new file, timed until the calls return (the bytes are in
  the page cache; what LMCache's disk backend waits for), then ``fdatasync`` timed on its own;
- ``dsync``: O_DIRECT | O_DSYNC writes over written blocks (each write durable on return);
- ``fsync_each`` / ``fsync_batch``: O_DIRECT rewrites then ``fdatasync`` after every call /
  once at the end (the durable-put choices).

Prints one line per figure (GB/s, 1e9 bytes/s) with the load average; a measurement, not a test.
Every read is compared with what was written.
"""

from __future__ import annotations

import mmap
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np

MIB = 1 << 20


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": MIB, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _arg(name: str, default: str) -> str:
    argv = sys.argv[1:]
    return argv[argv.index(name) + 1] if name in argv else default


def _aligned(nbytes: int, seed: int) -> mmap.mmap:
    buf = mmap.mmap(-1, nbytes)  # page-aligned, as O_DIRECT needs
    arr = np.frombuffer(buf, dtype=np.uint8)
    arr[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return buf


def _run(depth: int, count: int, one: Callable[[int], None]) -> float:
    """Calls ``one(i)`` for ``i`` in ``range(count)`` from ``depth`` threads; seconds."""
    next_i = iter(range(count))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = next(next_i, None)
            if i is None:
                return
            one(i)

    threads = [threading.Thread(target=worker) for _ in range(depth)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def _open(path: str, flags: int) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o600)


def measure(directory: str, total: int, size: int, depth: int, mode: str, data: mmap.mmap) -> str:
    count = total // size
    view = memoryview(data)
    src = [
        view[(i * size) % len(data) : (i * size) % len(data) + size]
        for i in range(min(count, len(data) // size))
    ]

    def piece(i: int) -> memoryview:
        return src[i % len(src)]

    path = os.path.join(directory, f"ceiling-{mode}-{size}-{depth}.bin")
    direct = os.O_DIRECT if mode != "buffered" else 0
    extra = ""
    try:
        if mode in ("rewrite", "read", "dsync", "fsync_each", "fsync_batch"):
            fd = _open(path, os.O_DIRECT)  # lay the blocks down first (untimed)
            os.posix_fallocate(fd, 0, total)
            _run(4, total // (4 * MIB), lambda i: os.pwrite(fd, view[: 4 * MIB], i * 4 * MIB))
            os.fdatasync(fd)
            os.close(fd)
        flags = direct | (os.O_DSYNC if mode == "dsync" else 0)
        fd = _open(path, flags)
        try:
            if mode in ("write", "buffered"):
                os.posix_fallocate(fd, 0, total)
                os.fsync(fd)
            if mode == "read":
                bufs = [mmap.mmap(-1, size) for _ in range(depth)]
                slot = threading.local()
                free = list(range(depth))
                lock = threading.Lock()

                def read(i: int) -> None:
                    if not hasattr(slot, "b"):
                        with lock:
                            slot.b = bufs[free.pop()]
                    got = os.preadv(fd, [slot.b], i * size)
                    if got != size:
                        raise SystemExit(f"short read {got}")

                seconds = _run(depth, count, read)
                check = mmap.mmap(-1, 4 * MIB)
                os.preadv(fd, [check], 0)
                if check[:] != view[: 4 * MIB].tobytes():
                    raise SystemExit("read back wrong bytes")
            else:

                def write(i: int) -> None:
                    os.pwrite(fd, piece(i), i * size)
                    if mode == "fsync_each":
                        os.fdatasync(fd)

                seconds = _run(depth, count, write)
                if mode == "fsync_batch":
                    t = time.perf_counter()
                    os.fdatasync(fd)
                    seconds += time.perf_counter() - t
                if mode == "buffered":
                    t = time.perf_counter()
                    os.fdatasync(fd)
                    extra = f" (then fdatasync {time.perf_counter() - t:.3f} s)"
        finally:
            os.close(fd)
    finally:
        os.unlink(path)
    load = os.getloadavg()[0]
    return (
        f"{mode:12s} size {size // 1024:6d} KiB depth {depth:3d}: {total / seconds / 1e9:6.2f} GB/s"
        f" ({seconds:.3f} s for {total // MIB} MiB){extra} load {load:.2f}"
    )


def main() -> None:
    directory = (
        sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("--") else tempfile.gettempdir()
    )
    total = int(_arg("--mib", "512")) * MIB
    sizes = [_size(s) for s in _arg("--sizes", "256K,1M,2M,4M,16M").split(",")]
    depths = [int(d) for d in _arg("--depths", "1,4,8,32").split(",")]
    modes = _arg("--modes", "write,rewrite,read,buffered,dsync,fsync_each,fsync_batch").split(",")
    data = _aligned(64 * MIB, 7)
    with tempfile.TemporaryDirectory(prefix="ssd-ceiling-", dir=directory) as tmp:
        for mode in modes:
            for size in sizes:
                for depth in depths:
                    print(measure(tmp, total, size, depth, mode, data), flush=True)


if __name__ == "__main__":
    main()
