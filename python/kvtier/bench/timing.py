"""Timing helpers shared by the benchmarks: best-of-N wall time and pre-faulted buffers."""

from __future__ import annotations

import time
from collections.abc import Callable

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


def touched(nbytes: int, fill: int = 0) -> npt.NDArray[np.uint8]:
    """A uint8 array whose pages are already faulted in, so timings measure copies, not faults."""
    arr = np.empty(nbytes, dtype=np.uint8)
    arr.fill(fill)
    return arr


def memcpy_seconds(nbytes: int, repeats: int) -> float:
    """Best time of one contiguous, single-threaded memcpy of ``nbytes``: the limit."""
    src = touched(nbytes, 1)
    dst = touched(nbytes, 2)
    return best_seconds(lambda: _core.memcpy(dst, src), repeats)


def gib_per_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 2**30
