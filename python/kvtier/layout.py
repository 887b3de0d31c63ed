"""Layouts and the batched copies between them (DESIGN §2; CPU analogue of Strata §4.1).

- ``LayerFirst`` paged pool (the engine's): one buffer, ``[layer][k|v][block][token][head][dim]``,
  then each extra KV group as ``[block][group bytes]``. :func:`alloc_pool` makes one.
- ``BlockFirst`` objects (storage): one contiguous object per block, ``[layer][k|v][token][head][dim]``
  then the extra groups. An ``(n, block_bytes)`` uint8 array holds ``n`` of them.

:func:`gather` copies pool blocks into objects, :func:`scatter` objects into pool blocks. Both merge
adjacent segments, spread the copies over a bounded worker pool (:class:`Copier`), write straight
into the caller's arrays (zero-copy) and release the GIL while copying.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvtier import _core
from kvtier.errors import BufferError, LayoutError
from kvtier.geometry import Geometry


@dataclass(frozen=True)
class CopyStats:
    bytes: int
    segments: int
    copies: int


def alloc_pool(geometry: Geometry, num_blocks: int) -> npt.NDArray[np.uint8]:
    """A zeroed ``LayerFirst`` pool of ``num_blocks`` blocks as a flat uint8 array."""
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
        raise LayoutError(f"num_blocks is {num_blocks!r}; expected an int >= 1")
    return np.zeros(geometry.pool_bytes(num_blocks), dtype=np.uint8)


def pool_num_blocks(geometry: Geometry, pool: np.ndarray) -> int:
    """Number of blocks a pool array holds; raises if its size is not a whole number of blocks."""
    if not isinstance(pool, np.ndarray):
        raise BufferError(f"pool is {type(pool).__name__}; expected a numpy array")
    per_block = geometry.pool_bytes(1)
    if pool.nbytes == 0 or pool.nbytes % per_block:
        raise BufferError(
            f"pool has {pool.nbytes} bytes; expected a positive multiple of {per_block} bytes "
            f"(one LayerFirst block of this geometry)"
        )
    return pool.nbytes // per_block


def kv_view(geometry: Geometry, pool: np.ndarray) -> np.ndarray:
    """The main K/V region of a pool as ``[layer, 2, block, token, head, dim]`` raw-byte elements.

    The element type is an unsigned int of the dtype's width (bf16/fp16 → uint16), so engines can
    index blocks and reinterpret with ``.view(...)``.
    """
    num_blocks = pool_num_blocks(geometry, pool)
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32}[geometry.dtype_bytes]
    flat = pool.reshape(-1).view(np.uint8)[: geometry.num_layers * 2 * num_blocks * geometry.segment_bytes]
    shape = (
        geometry.num_layers,
        2,
        num_blocks,
        geometry.block_tokens,
        geometry.num_kv_heads,
        geometry.head_dim,
    )
    return flat.view(width).reshape(shape)


def _block_ids(block_ids: Sequence[int] | npt.ArrayLike, num_blocks: int) -> npt.NDArray[np.uint64]:
    ids = np.asarray(block_ids)
    if ids.ndim != 1:
        raise LayoutError(f"block_ids have shape {ids.shape}; expected a 1-D sequence of pool block ids")
    if ids.size == 0:
        return np.zeros(0, dtype=np.uint64)
    if not np.issubdtype(ids.dtype, np.integer):
        raise LayoutError(f"block_ids have dtype {ids.dtype}; expected integers")
    lo = int(ids.min())
    if lo < 0:
        raise LayoutError(f"block id {lo} is negative; the pool has blocks 0..{num_blocks - 1}")
    return np.ascontiguousarray(ids, dtype=np.uint64)


class Copier:
    """Runs gathers and scatters on a bounded pool of ``threads`` copy workers (0 = one per core)."""

    def __init__(self, threads: int = 0) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or not 0 <= threads <= 256:
            raise LayoutError(f"threads is {threads!r}; expected an int in [0, 256]")
        self._core = _core.Copier(threads)
        self.threads = self._core.threads

    def gather(
        self,
        geometry: Geometry,
        pool: np.ndarray,
        block_ids: Sequence[int] | npt.ArrayLike,
        out: np.ndarray | None = None,
        *,
        per_segment: bool = False,
    ) -> np.ndarray:
        """Copies pool blocks ``block_ids`` into ``out[i]`` (allocated if None); returns ``out``.

        ``per_segment=True`` is the naive one-copy-per-segment baseline, kept for benchmarks.
        """
        num_blocks = pool_num_blocks(geometry, pool)
        ids = _block_ids(block_ids, num_blocks)
        if out is None:
            out = np.empty((ids.size, geometry.block_bytes), dtype=np.uint8)
        _check_objects(geometry, out, ids.size, "out", writable=True)
        self._core.gather(geometry._handle, pool, num_blocks, ids, out, per_segment)
        return out

    def scatter(
        self,
        geometry: Geometry,
        objects: np.ndarray,
        block_ids: Sequence[int] | npt.ArrayLike,
        pool: np.ndarray,
        *,
        per_segment: bool = False,
    ) -> CopyStats:
        """Copies ``objects[i]`` into pool block ``block_ids[i]`` (ids must be distinct)."""
        num_blocks = pool_num_blocks(geometry, pool)
        if not pool.flags.writeable:
            raise BufferError("pool is read-only; expected a writable array")
        ids = _block_ids(block_ids, num_blocks)
        _check_objects(geometry, objects, ids.size, "objects", writable=False)
        return CopyStats(*self._core.scatter(geometry._handle, objects, num_blocks, ids, pool, per_segment))


def _check_objects(geometry: Geometry, arr: np.ndarray, count: int, what: str, writable: bool) -> None:
    if not isinstance(arr, np.ndarray):
        raise BufferError(f"{what} is {type(arr).__name__}; expected a numpy array")
    expected = count * geometry.block_bytes
    if arr.nbytes != expected or (arr.ndim > 0 and arr.shape[0] != count and count > 0):
        raise BufferError(
            f"{what} has shape {arr.shape} ({arr.nbytes} bytes, {arr.dtype}); expected {count} blocks of "
            f"{geometry.block_bytes} bytes = {expected} bytes, e.g. shape ({count}, {geometry.block_bytes}) uint8"
        )
    if not arr.flags.c_contiguous:
        raise BufferError(f"{what} is not C-contiguous; expected a contiguous array (np.ascontiguousarray)")
    if writable and not arr.flags.writeable:
        raise BufferError(f"{what} is read-only; expected a writable array")


@functools.cache
def default_copier() -> Copier:
    """The process's shared copier (one worker per core), created on first use."""
    return Copier()


def gather(
    geometry: Geometry,
    pool: np.ndarray,
    block_ids: Sequence[int] | npt.ArrayLike,
    out: np.ndarray | None = None,
    *,
    copier: Copier | None = None,
) -> np.ndarray:
    """Pool blocks → BlockFirst objects. See :meth:`Copier.gather`."""
    return (copier or default_copier()).gather(geometry, pool, block_ids, out)


def scatter(
    geometry: Geometry,
    objects: np.ndarray,
    block_ids: Sequence[int] | npt.ArrayLike,
    pool: np.ndarray,
    *,
    copier: Copier | None = None,
) -> CopyStats:
    """BlockFirst objects → pool blocks. See :meth:`Copier.scatter`."""
    return (copier or default_copier()).scatter(geometry, objects, block_ids, pool)
