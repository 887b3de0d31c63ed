"""KV access for one forward step: where new K/V go and what each sequence attends over.

A forward step packs several sequences' new tokens into one flat batch (varlen, like vLLM). Sequence
``i`` adds ``query_lens[i]`` tokens at positions ``context_lens[i] - query_lens[i] ..
context_lens[i] - 1`` and attends over its first ``context_lens[i]`` tokens (cached ones plus the new
ones). A :class:`KvAccess` answers, per layer, two questions: *write* the new tokens' K/V (all
sequences at once, packed order) and *read* one sequence's whole context. The model calls ``write``
before ``read`` in every layer, so a sequence's own new tokens are in the context it reads.

Two implementations:

- :class:`ContiguousKvCache` — one ``[layer, k|v, token, head, dim]`` array per sequence; the
  simplest possible cache, the reference the paged one is tested against.
- :class:`PagedKvPool` — a ``LayerFirst`` pool ``[layer][k|v][block][token][head][dim]`` exactly as
  :mod:`kvtier.layout` lays it out (so :func:`kvtier.layout.gather`/``scatter`` move its blocks to and
  from the store), addressed through per-sequence block tables.

K and V arrays are fp32 ``[tokens, num_kv_heads, head_dim]``. Positions are always ``0..n-1`` within
a sequence's context: a context token's position is its index.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvtier.engine.errors import EngineInputError
from kvtier.engine.weights import ModelConfig
from kvtier.geometry import Geometry
from kvtier.layout import alloc_pool, kv_view, pool_num_blocks

F32Array = npt.NDArray[np.float32]
IntArray = npt.NDArray[np.int64]


def _lengths(name: str, values: Sequence[int] | npt.ArrayLike) -> IntArray:
    array = np.asarray(values)
    if array.ndim != 1 or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
        raise EngineInputError(f"{name} is {values!r}; expected a non-empty 1-D sequence of ints")
    return array.astype(np.int64)


class KvAccess(ABC):
    """One forward step's view of the KV cache. See the module doc for the contract."""

    def __init__(
        self, query_lens: Sequence[int] | npt.ArrayLike, context_lens: Sequence[int] | npt.ArrayLike
    ):
        self.query_lens = _lengths("query_lens", query_lens)
        self.context_lens = _lengths("context_lens", context_lens)
        if self.query_lens.shape != self.context_lens.shape:
            raise EngineInputError(
                f"{self.query_lens.size} query_lens but {self.context_lens.size} context_lens; expected one each per sequence"
            )
        if (self.query_lens < 1).any() or (self.context_lens < self.query_lens).any():
            raise EngineInputError(
                f"query_lens {self.query_lens.tolist()} / context_lens {self.context_lens.tolist()}: "
                f"expected 1 <= query_len <= context_len for every sequence"
            )

    @property
    def num_seqs(self) -> int:
        return int(self.query_lens.size)

    @property
    def num_tokens(self) -> int:
        """Packed new tokens in this step."""
        return int(self.query_lens.sum())

    def positions(self) -> IntArray:
        """The positions the new tokens must have, packed: ``ctx - n .. ctx - 1`` per sequence."""
        starts = self.context_lens - self.query_lens
        return np.concatenate([np.arange(s, c) for s, c in zip(starts, self.context_lens, strict=True)])

    @abstractmethod
    def write(self, layer: int, k: F32Array, v: F32Array) -> None:
        """Stores layer ``layer``'s K and V (``[num_tokens, kv_heads, head_dim]``) of the new tokens."""

    @abstractmethod
    def read(self, layer: int, seq: int) -> tuple[F32Array, F32Array]:
        """Sequence ``seq``'s K and V over its whole context, ``[context_len, kv_heads, head_dim]``."""


class ContiguousKvCache:
    """Each sequence's K/V in one ``[layer, k|v, token, head, dim]`` fp32 array of fixed capacity."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self._arrays: list[F32Array] = []
        self._lens: list[int] = []

    def add_sequence(self, capacity_tokens: int) -> int:
        """Adds an empty sequence able to hold ``capacity_tokens`` tokens; returns its id."""
        if capacity_tokens < 1 or capacity_tokens > self.config.max_context_tokens:
            raise EngineInputError(
                f"capacity_tokens is {capacity_tokens}; expected 1..{self.config.max_context_tokens}"
            )
        shape = (self.config.num_layers, 2, capacity_tokens, self.config.num_kv_heads, self.config.head_dim)
        self._arrays.append(np.zeros(shape, dtype=np.float32))
        self._lens.append(0)
        return len(self._arrays) - 1

    def num_tokens(self, seq: int) -> int:
        return self._lens[seq]

    def kv(self, seq: int) -> F32Array:
        """Sequence ``seq``'s cached K/V so far, ``[layer, k|v, token, head, dim]`` (a view)."""
        return self._arrays[seq][:, :, : self._lens[seq]]

    def step(self, seqs: Sequence[int], query_lens: Sequence[int]) -> KvAccess:
        """Appends ``query_lens[i]`` tokens to sequence ``seqs[i]`` and returns the step's access. The
        tokens count as cached from here on: run exactly one forward with the access."""
        if len(set(seqs)) != len(seqs):
            raise EngineInputError(f"sequence ids {list(seqs)} repeat; expected each at most once per step")
        context_lens = []
        for seq, n in zip(seqs, query_lens, strict=True):
            if not 0 <= seq < len(self._arrays):
                raise EngineInputError(f"sequence id {seq} is unknown; expected 0..{len(self._arrays) - 1}")
            if self._lens[seq] + n > self._arrays[seq].shape[2]:
                raise EngineInputError(
                    f"sequence {seq} holds {self._lens[seq]} of {self._arrays[seq].shape[2]} tokens; "
                    f"{n} more do not fit"
                )
            context_lens.append(self._lens[seq] + n)
        access = _ContiguousStep([self._arrays[s] for s in seqs], query_lens, context_lens)
        for seq, length in zip(seqs, context_lens, strict=True):
            self._lens[seq] = length
        return access


class _ContiguousStep(KvAccess):
    def __init__(self, arrays: list[F32Array], query_lens: Sequence[int], context_lens: Sequence[int]):
        super().__init__(query_lens, context_lens)
        self._arrays = arrays
        self._offsets = np.concatenate([[0], np.cumsum(self.query_lens)])

    def write(self, layer: int, k: F32Array, v: F32Array) -> None:
        for i, array in enumerate(self._arrays):
            lo, hi = self._offsets[i], self._offsets[i + 1]
            start = self.context_lens[i] - self.query_lens[i]
            array[layer, 0, start : self.context_lens[i]] = k[lo:hi]
            array[layer, 1, start : self.context_lens[i]] = v[lo:hi]

    def read(self, layer: int, seq: int) -> tuple[F32Array, F32Array]:
        ctx = self.context_lens[seq]
        array = self._arrays[seq]
        return array[layer, 0, :ctx], array[layer, 1, :ctx]


def pool_geometry(config: ModelConfig, block_tokens: int) -> Geometry:
    """The fp32 KV geometry of ``config`` — for SmolLM2-135M ``Geometry(30, 3, 64, "fp32", block_tokens)``."""
    return Geometry(config.num_layers, config.num_kv_heads, config.head_dim, "fp32", block_tokens)


class PagedKvPool:
    """A ``LayerFirst`` fp32 pool: ``pool`` is the flat uint8 buffer :mod:`kvtier.layout` copies
    blocks in and out of; ``kv`` is the same memory as ``[layer, k|v, block, token, head, dim]`` fp32.

    Block allocation is the caller's (a scheduler's block manager); this class only reads and writes
    the blocks a step's block tables name. Several sequences may list the same block (a shared
    prefix) as long as no step writes into a block another sequence reads.
    """

    def __init__(self, geometry: Geometry, num_blocks: int, pool: npt.NDArray[np.uint8] | None = None):
        if geometry.dtype != "fp32" or geometry.extra_groups:
            raise EngineInputError(
                f"pool geometry is {geometry}; expected dtype fp32 and no extra groups (the engine computes in fp32)"
            )
        self.geometry = geometry
        if pool is None:
            pool = alloc_pool(geometry, num_blocks)
            # Touch every page now, as an engine reserves its KV memory up front: otherwise the
            # first steps that write fresh blocks also pay the page faults, which skews step times.
            pool.fill(0)
        self.pool = pool
        self.num_blocks = pool_num_blocks(geometry, self.pool)
        if self.num_blocks != num_blocks:
            raise EngineInputError(f"pool holds {self.num_blocks} blocks; expected {num_blocks}")
        self.kv: F32Array = kv_view(geometry, self.pool).view(np.float32)

    @property
    def block_tokens(self) -> int:
        return self.geometry.block_tokens

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_tokens)

    def step(
        self,
        block_tables: Sequence[Sequence[int]],
        context_lens: Sequence[int],
        query_lens: Sequence[int],
    ) -> KvAccess:
        """The access for one step: sequence ``i`` has block table ``block_tables[i]`` (pool block ids
        of its tokens ``0..``, ``block_tokens`` each) and reaches ``context_lens[i]`` tokens by adding
        ``query_lens[i]`` new ones."""
        return _PagedStep(self, block_tables, query_lens, context_lens)


class _PagedStep(KvAccess):
    def __init__(
        self,
        pool: PagedKvPool,
        block_tables: Sequence[Sequence[int]],
        query_lens: Sequence[int],
        context_lens: Sequence[int],
    ):
        super().__init__(query_lens, context_lens)
        if len(block_tables) != self.num_seqs:
            raise EngineInputError(f"{len(block_tables)} block tables for {self.num_seqs} sequences")
        self._kv = pool.kv
        self._block_tokens = pool.block_tokens
        self._tables: list[IntArray] = []
        for i, table in enumerate(block_tables):
            needed = pool.blocks_needed(int(self.context_lens[i]))
            ids = np.asarray(table, dtype=np.int64)[:needed]
            if ids.ndim != 1 or ids.size < needed:
                raise EngineInputError(
                    f"sequence {i}'s block table has {np.size(table)} blocks; {self.context_lens[i]} tokens "
                    f"need {needed} of {pool.block_tokens} tokens"
                )
            if ids.size and (ids.min() < 0 or ids.max() >= pool.num_blocks):
                raise EngineInputError(
                    f"sequence {i}'s block table {ids.tolist()} names blocks outside 0..{pool.num_blocks - 1}"
                )
            self._tables.append(ids)
        # vLLM's slot mapping: the (block, offset) each new token's K/V is written to.
        positions = self.positions()
        starts = self.context_lens - self.query_lens
        self._write_blocks = np.concatenate(
            [
                table[np.arange(start, ctx) // self._block_tokens]
                for table, start, ctx in zip(self._tables, starts, self.context_lens, strict=True)
            ]
        )
        self._write_offsets = positions % self._block_tokens

    def write(self, layer: int, k: F32Array, v: F32Array) -> None:
        self._kv[layer, 0, self._write_blocks, self._write_offsets] = k
        self._kv[layer, 1, self._write_blocks, self._write_offsets] = v

    def read(self, layer: int, seq: int) -> tuple[F32Array, F32Array]:
        ctx = int(self.context_lens[seq])
        ids = self._tables[seq]
        kv = self._kv
        shape = (ids.size * self._block_tokens, *kv.shape[4:])
        if ids.size and (np.diff(ids) == 1).all():
            # Consecutive blocks: a view, no copy.
            first = int(ids[0])
            blocks = kv[layer, :, first : first + ids.size]
            return blocks[0].reshape(shape)[:ctx], blocks[1].reshape(shape)[:ctx]
        return kv[layer, 0, ids].reshape(shape)[:ctx], kv[layer, 1, ids].reshape(shape)[:ctx]
