"""Timing helpers shared by the benchmarks: best-of-N wall time and pre-faulted buffers."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt

from kvtier import _core


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Smallest wall time of ``repeats`` calls: the least disturbed run on a shared machine."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


PAGE_BYTES = 4096


def touched(nbytes: int, fill: int = 0) -> npt.NDArray[np.uint8]:
    """A page-aligned uint8 array whose pages are already faulted in, so timings measure copies,
    not faults. Aligned as an engine's buffers are (torch's CPU allocator aligns to 64 B, vLLM's
    pools to pages); a large ``np.empty`` starts 16 B past a page, which splits the first and last
    cache line of every page-sized piece a paged pool's gather or scatter copies."""
    raw = np.empty(nbytes + PAGE_BYTES, dtype=np.uint8)
    start = -raw.ctypes.data % PAGE_BYTES
    arr = raw[start : start + nbytes]
    arr.fill(fill)
    return arr


def memcpy_seconds(nbytes: int, repeats: int) -> float:
    """Best time of one contiguous, single-threaded memcpy of ``nbytes``: the limit."""
    src = touched(nbytes, 1)
    dst = touched(nbytes, 2)
    return best_seconds(lambda: _core.memcpy(dst, src), repeats)


class TwoMemcpys:
    """Two single-threaded memcpys of ``nbytes`` each (distinct, pre-faulted buffers), timed one
    after the other and at once on two threads (a worker kept warm, as a transfer engine's are).
    The ratio of the two is what the memory system allows two concurrent copies on this machine:
    the limit of a duplex ratio when both directions are host-memory copies. Use as a context
    manager (it owns the worker thread)."""

    def __init__(self, nbytes: int) -> None:
        self.a, self.b = touched(nbytes, 1), touched(nbytes, 2)
        self.c, self.d = touched(nbytes, 3), touched(nbytes, 4)
        self.worker = ThreadPoolExecutor(1)
        self.worker.submit(lambda: None).result()

    def __enter__(self) -> TwoMemcpys:
        return self

    def __exit__(self, *_: object) -> None:
        self.worker.shutdown()

    def seconds(self) -> tuple[float, float]:
        """One round: (one after the other, at once)."""
        start = time.perf_counter()
        _core.memcpy(self.b, self.a)
        _core.memcpy(self.d, self.c)
        serial = time.perf_counter() - start
        start = time.perf_counter()
        other = self.worker.submit(_core.memcpy, self.d, self.c)
        _core.memcpy(self.b, self.a)
        other.result()
        return serial, time.perf_counter() - start


def gib_per_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 2**30
