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

import builtins
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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


#: Struct-module codes of the items that are KV bytes: fixed-size plain numbers (the rule of the
#: Rust buffer layer, ``Format::Bytes`` in ``crates/kvtier-py/src/buffer.rs``).
_PLAIN_FORMAT_CODES = frozenset("?bBhHiIlLqQcefd")
#: The numpy dtype characters of those items ('c' is numpy's ``S1``, a string: not included).
_PLAIN_DTYPE_CHARS = frozenset("?bBhHiIlLqQefd")
_FORMAT_NAMES = {"O": "Python objects", "P": "pointers"}
PLAIN_ITEMS = "plain numbers in native byte order (uint8, float16, ...)"


def plain_format(code: str) -> bool:
    """Whether a buffer of struct-module format ``code`` holds KV bytes: one plain number code,
    after at most one native or little-endian prefix. Objects, pointers, strings, structs,
    sub-arrays and big-endian items are not (the same rule as the Rust buffer layer)."""
    body = code[1:] if code[:1] in ("@", "=", "<") else code
    return len(body) == 1 and body in _PLAIN_FORMAT_CODES


def plain_dtype(dtype: np.dtype[Any]) -> bool:
    """Whether items of ``dtype`` are KV bytes (the numpy side of :func:`plain_format`)."""
    return (
        dtype.fields is None
        and dtype.subdtype is None
        and dtype.isnative
        and dtype.char in _PLAIN_DTYPE_CHARS
    )


def _memoryview(value: object, what: str) -> memoryview | None:
    """A memoryview of ``value``, or None if it has no buffer protocol."""
    try:
        return memoryview(value)  # type: ignore[arg-type]
    except TypeError:
        return None
    except (ValueError, builtins.BufferError) as e:  # e.g. a released memoryview
        raise BufferError(f"{what} is a {type(value).__name__} whose buffer cannot be read: {e}") from None


def is_buffer(value: object) -> bool:
    """Whether ``value`` has the buffer protocol (a numpy array, memoryview, bytes, ...)."""
    try:
        memoryview(value)  # type: ignore[arg-type]
    except TypeError:
        return False
    except (ValueError, builtins.BufferError):
        pass  # a buffer, unreadable: buffer_array says why
    return True


def buffer_array(value: object, what: str, *, writable: bool = False) -> np.ndarray:
    """``value`` as a numpy array over the same memory (never a copy), checked for what crosses
    into Rust: items that are plain numbers (:func:`plain_format`), C-contiguous, and writable
    when ``writable``. Raises :class:`BufferError` naming ``what`` and the problem otherwise.

    A numpy array is taken as it is; any other object with the buffer protocol (memoryview,
    bytes, bytearray, array.array, ...) is one buffer, its item format checked before numpy
    sees it. Anything else (a list, an int, None, ...) is refused: converting it would be a guess
    at its bytes (``np.asarray`` makes a list of ints int64, and byte-swaps a list of big-endian
    arrays), and an output converted to a copy would never see the bytes written.
    """
    kind = type(value).__name__
    if isinstance(value, np.ndarray):
        arr = value
    else:
        view = _memoryview(value, what)
        if view is not None:
            if not plain_format(view.format):
                name = _FORMAT_NAMES.get(view.format.lstrip("@=<>!"), "")
                raise BufferError(
                    f"{what} is a {kind} with items of type {view.format!r}"
                    f"{f' ({name})' if name else ''}; expected {PLAIN_ITEMS}"
                )
            if not view.c_contiguous:
                raise BufferError(
                    f"{what} is a {kind} that is not C-contiguous; expected a contiguous buffer"
                )
            if writable and view.readonly:
                raise BufferError(f"{what} is a read-only {kind}; expected a writable buffer")
            try:
                arr = np.asarray(view)
            except (ValueError, TypeError, builtins.BufferError) as e:
                raise BufferError(f"{what} is a {kind} numpy cannot read: {e}") from None
            if view.format.lstrip("@=<") == "c":  # chars: numpy makes them strings (S1)
                arr = arr.view(np.uint8)
        else:
            need = "a writable buffer (bytearray, memoryview)" if writable else "a buffer (bytes, memoryview)"
            raise BufferError(f"{what} is {kind}; expected a numpy array or {need} of {PLAIN_ITEMS}")
    if not plain_dtype(arr.dtype):
        raise BufferError(f"{what} has items of type {arr.dtype}; expected {PLAIN_ITEMS}")
    if not arr.flags.c_contiguous:
        raise BufferError(f"{what} is not C-contiguous; expected a contiguous array (np.ascontiguousarray)")
    if writable and not arr.flags.writeable:
        raise BufferError(f"{what} is read-only; expected a writable array")
    return arr


def alloc_pool(geometry: Geometry, num_blocks: int) -> npt.NDArray[np.uint8]:
    """A zeroed ``LayerFirst`` pool of ``num_blocks`` blocks as a flat uint8 array."""
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
        raise LayoutError(f"num_blocks is {num_blocks!r}; expected an int >= 1")
    return np.zeros(geometry.pool_bytes(num_blocks), dtype=np.uint8)


def pool_num_blocks(geometry: Geometry, pool: np.ndarray, what: str = "pool") -> int:
    """Number of blocks a pool array holds; raises :class:`BufferError` (naming ``what``) unless
    it is a numpy array of plain numbers, C-contiguous, of a whole number of blocks."""
    if not isinstance(pool, np.ndarray):
        raise BufferError(f"{what} is {type(pool).__name__}; expected a numpy array")
    buffer_array(pool, what)
    per_block = geometry.pool_bytes(1)
    if pool.nbytes == 0 or pool.nbytes % per_block:
        raise BufferError(
            f"{what} has {pool.nbytes} bytes; expected a positive multiple of {per_block} bytes "
            f"(one LayerFirst block of this geometry)"
        )
    return pool.nbytes // per_block


def kv_view(geometry: Geometry, pool: np.ndarray) -> np.ndarray:
    """The main K/V region of a pool as ``[layer, 2, block, token, head, dim]`` raw-byte elements.

    The element type is an unsigned int of the dtype's width (bf16/fp16 → uint16), so engines can
    index blocks and reinterpret with ``.view(...)``. It is a view of ``pool`` (writes through it
    reach the pool), so the pool must be C-contiguous (see :func:`pool_num_blocks`).
    """
    num_blocks = pool_num_blocks(geometry, pool)
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32}[geometry.dtype_bytes]
    # C-contiguous (checked above): the reshape is a view, never a copy.
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


def int64_overflow(block_ids: object) -> tuple[int, int] | None:
    """(position, id) of the first id past int64 in a list or tuple of Python ints: numpy makes
    such a list a float64 or object array, whose dtype is not what is wrong with it."""
    if isinstance(block_ids, list | tuple) and all(type(b) is int for b in block_ids):
        return next(((i, b) for i, b in enumerate(block_ids) if not -(2**63) <= b < 2**63), None)
    return None


def _block_ids(block_ids: Sequence[int] | npt.ArrayLike, num_blocks: int) -> npt.NDArray[np.uint64]:
    ids = np.asarray(block_ids)
    if ids.ndim != 1:
        raise LayoutError(f"block_ids have shape {ids.shape}; expected a 1-D sequence of pool block ids")
    if ids.size == 0:
        return np.zeros(0, dtype=np.uint64)
    if not np.issubdtype(ids.dtype, np.integer):
        if (big := int64_overflow(block_ids)) is not None:
            raise LayoutError(
                f"block id {big[1]} at position {big[0]} is out of range; the pool has {num_blocks} blocks"
            )
        raise LayoutError(f"block_ids have dtype {ids.dtype}; expected integers")
    lo = int(ids.min())
    if lo < 0:
        raise LayoutError(f"block id {lo} is negative; the pool has blocks 0..{num_blocks - 1}")
    out = np.ascontiguousarray(ids, dtype=np.uint64)
    # Rust reads the ids in place as u64: an unaligned array (a view at an odd offset) is copied
    # into a fresh, aligned one (read-only input: the copy changes nothing the caller sees).
    return out if out.flags.aligned else out.copy()


class PagedPool:
    """An engine's paged KV pool as *regions*, for copies straight between the store and the
    engine's blocks (:meth:`kvtier.Store.load_into_pool`; ``kvtier_core::paged`` in Rust).

    A region is one piece of every block: an array whose first axis is the block id (C-contiguous,
    plain numbers, writable), ``block_len`` bytes per block. ``layers[l]`` lists the regions of
    layer ``l`` in object order: a block's object is layer 0's pieces, then layer 1's, and so
    on, so the pool's ``block_bytes`` is the sum of every region's ``block_len``. A layer is the
    unit of layerwise progress. Two shapes are built in:

    - :meth:`layer_first`: kvtier's own ``LayerFirst`` pool (K and V of each layer; the extra
      groups of a hybrid model join the last layer);
    - vLLM's per-layer tensors (one region per layer on CPU, K and V on CUDA):
      ``PagedPool([[layer0], [layer1], ...])``.

    The pool holds views of the arrays (never copies). Regions must not overlap.
    """

    def __init__(self, layers: Sequence[Sequence[np.ndarray]]) -> None:
        if not isinstance(layers, Sequence) or not layers:
            raise LayoutError("a paged pool needs at least one layer")
        regions: list[np.ndarray] = []
        layer_regions: list[int] = []
        num_blocks: int | None = None
        for index, layer in enumerate(layers):
            if not isinstance(layer, Sequence) or not layer:
                raise LayoutError(f"layer {index} has no region; expected a list of arrays")
            for j, region in enumerate(layer):
                what = f"layer {index} region {j}"
                arr = buffer_array(region, what, writable=True)
                if arr.ndim < 1 or arr.shape[0] < 1 or arr.nbytes == 0:
                    raise BufferError(f"{what} has shape {arr.shape}; expected (num_blocks, ...) with data")
                if num_blocks is None:
                    num_blocks = int(arr.shape[0])
                elif arr.shape[0] != num_blocks:
                    raise LayoutError(f"{what} has {arr.shape[0]} blocks; layer 0 has {num_blocks}")
                regions.append(arr.reshape(num_blocks, -1).view(np.uint8))
            layer_regions.append(len(layer))
        assert num_blocks is not None
        self.regions = regions
        self.layer_regions = layer_regions
        self.num_blocks = num_blocks
        self.block_bytes = sum(int(r.shape[1]) for r in regions)

    @property
    def num_layers(self) -> int:
        return len(self.layer_regions)

    @classmethod
    def layer_first(cls, geometry: Geometry, pool: np.ndarray) -> PagedPool:
        """kvtier's ``LayerFirst`` pool array (see :mod:`kvtier.layout`) as regions."""
        n = pool_num_blocks(geometry, pool)
        flat = buffer_array(pool, "pool", writable=True).reshape(-1).view(np.uint8)
        seg = geometry.segment_bytes
        layers: list[list[np.ndarray]] = []
        for layer in range(geometry.num_layers):
            k = flat[(2 * layer) * n * seg : (2 * layer + 1) * n * seg]
            v = flat[(2 * layer + 1) * n * seg : (2 * layer + 2) * n * seg]
            layers.append([k.reshape(n, seg), v.reshape(n, seg)])
        start = 2 * geometry.num_layers * n * seg
        for group in geometry.extra_groups:
            gbb = group.bytes_per_token * geometry.block_tokens
            layers[-1].append(flat[start : start + n * gbb].reshape(n, gbb))
            start += n * gbb
        return cls(layers)


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
        self._core.copy(True, geometry._handle, pool, num_blocks, ids, out, per_segment)
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
        return CopyStats(
            *self._core.copy(False, geometry._handle, objects, num_blocks, ids, pool, per_segment)
        )


def _check_objects(geometry: Geometry, arr: np.ndarray, count: int, what: str, writable: bool) -> None:
    if not isinstance(arr, np.ndarray):
        raise BufferError(f"{what} is {type(arr).__name__}; expected a numpy array")
    expected = count * geometry.block_bytes
    if arr.nbytes != expected or (arr.ndim > 0 and arr.shape[0] != count and count > 0):
        raise BufferError(
            f"{what} has shape {arr.shape} ({arr.nbytes} bytes, {arr.dtype}); expected {count} blocks of "
            f"{geometry.block_bytes} bytes = {expected} bytes, e.g. shape ({count}, {geometry.block_bytes}) uint8"
        )
    buffer_array(arr, what, writable=writable)


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
