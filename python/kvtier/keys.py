"""Namespaced, chained 128-bit block keys (DESIGN §2; byte layout in ``docs/formats.md``).

``h_i = XXH3-128(seed=KEY_SEED, h_{i-1} ‖ tokens of block i ‖ extra)`` with ``h_{-1}`` the namespace
hash of (model id, geometry, layout version, tenant ``cache_salt``, rank). The seed is fixed, so
every process derives the same keys. Only full blocks get keys.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload

import numpy as np
import numpy.typing as npt

from kvtier import _core
from kvtier.errors import KeyHashError
from kvtier.geometry import Geometry

KEY_BYTES = 16


@dataclass(frozen=True)
class Namespace:
    """What keeps caches apart. Two namespaces never share a key."""

    model_id: str
    geometry: Geometry
    cache_salt: str = ""
    rank: int = 0
    layout_version: int = 1
    hash: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.geometry, Geometry):
            raise KeyHashError(
                f"namespace geometry is {type(self.geometry).__name__}; expected kvtier.Geometry"
            )
        for name in ("rank", "layout_version"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32:
                raise KeyHashError(f"namespace `{name}` is {value!r}; expected an int in [0, 2**32)")
        digest = self.geometry._handle.namespace_hash(
            self.model_id, self.layout_version, self.cache_salt, self.rank
        )
        object.__setattr__(self, "hash", bytes(digest))

    def block_keys(self, tokens: Sequence[int] | npt.ArrayLike, extra: bytes = b"") -> BlockKeys:
        """Keys of every full block of ``tokens``. One call hashes a whole prompt."""
        return block_keys(self, tokens, extra)


def _token_input(tokens: object) -> object:
    """``tokens`` in a form Rust converts itself (``_core.block_keys``: a list or tuple of ints, or a
    1-D integer buffer, each id range-checked there and named by index on error), without numpy
    touching a list (``np.asarray(list)`` cost 3-6 ms for 128K tokens) and without importing torch
    unless a torch tensor is passed."""
    if isinstance(tokens, list | tuple):
        return tokens
    if isinstance(tokens, str | bytes | bytearray):
        raise KeyHashError(
            f"tokens are {type(tokens).__name__}; expected a 1-D sequence of integer token ids"
        )
    if type(tokens).__module__.split(".")[0] == "torch":
        tokens = tokens.detach().cpu().numpy()  # type: ignore[attr-defined]
    arr = np.asarray(tokens)  # a view of arrays, array.array and memoryviews; ranges are converted
    if arr.ndim != 1:
        raise KeyHashError(f"tokens have shape {arr.shape}; expected a 1-D sequence of token ids")
    if arr.size == 0:
        return np.zeros(0, dtype=np.uint32)  # an empty sequence is float64 to numpy
    if not np.issubdtype(arr.dtype, np.integer):
        raise KeyHashError(f"tokens have dtype {arr.dtype}; expected integer token ids")
    if arr.dtype.byteorder not in "=|<":
        arr = arr.astype(arr.dtype.newbyteorder("="))  # Rust reads native-order integers only
    return np.ascontiguousarray(arr)


def block_keys(namespace: Namespace, tokens: Sequence[int] | npt.ArrayLike, extra: bytes = b"") -> BlockKeys:
    """Keys of every full block of ``tokens`` in ``namespace``; ``extra`` is mixed into each block."""
    if not isinstance(extra, bytes | bytearray):
        raise KeyHashError(f"extra is {type(extra).__name__}; expected bytes")
    data = _core.block_keys(
        namespace.hash, _token_input(tokens), namespace.geometry.block_tokens, bytes(extra)
    )
    return BlockKeys(namespace.hash, data)


class BlockKeys(Sequence[int]):
    """An immutable run of block keys of one namespace, consecutive from the prompt's start.

    Indexing gives keys as ints; slicing gives ``BlockKeys``. ``raw`` is ``len * 16`` bytes, each
    key little-endian, which is what the store takes.
    """

    __slots__ = ("namespace_hash", "raw")

    def __init__(self, namespace_hash: bytes, raw: bytes) -> None:
        if len(namespace_hash) != KEY_BYTES or len(raw) % KEY_BYTES:
            raise KeyHashError(
                f"BlockKeys needs a 16-byte namespace hash and a multiple of 16 key bytes; got "
                f"{len(namespace_hash)} and {len(raw)}"
            )
        self.namespace_hash = namespace_hash
        self.raw = raw

    def __len__(self) -> int:
        return len(self.raw) // KEY_BYTES

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> BlockKeys: ...
    def __getitem__(self, index: int | slice) -> int | BlockKeys:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise KeyHashError("BlockKeys slices must be contiguous (step 1): keys are a chain")
            return BlockKeys(self.namespace_hash, self.raw[start * KEY_BYTES : stop * KEY_BYTES])
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"key index {index} out of range for {n} keys")
        i = index % n
        return int.from_bytes(self.raw[i * KEY_BYTES : (i + 1) * KEY_BYTES], "little")

    def __iter__(self) -> Iterator[int]:
        for i in range(len(self)):
            yield int.from_bytes(self.raw[i * KEY_BYTES : (i + 1) * KEY_BYTES], "little")

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, BlockKeys)
            and self.namespace_hash == other.namespace_hash
            and self.raw == other.raw
        )

    def __hash__(self) -> int:
        return hash((self.namespace_hash, self.raw))

    def hex(self) -> list[str]:
        """Keys as 32-digit hex strings (big-endian reading of the u128)."""
        return [f"{k:032x}" for k in self]

    def __repr__(self) -> str:
        return f"BlockKeys(n={len(self)}, namespace={int.from_bytes(self.namespace_hash, 'little'):032x})"
