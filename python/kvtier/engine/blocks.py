"""Device block manager: the free list of the paged pool and the device prefix cache.

Every pool block is in exactly one of three states (checked by :meth:`BlockManager.check_integrity`):

- **free** — on the free list;
- **cached** — holds the KV of one full block whose key is device-resident in the
  :class:`~kvtier.radix.HiRadixTree` (``block_of[key]``); requests using it hold a lock on its path,
  and an unlocked cached block is evicted (least recently used, leaf first) when the free list runs
  short;
- **private** — owned by one request: its partial last block, full blocks not committed yet, and a
  full block whose key another request cached first (the copy that arrived second stays private).

Cached blocks are immutable: a request only writes at positions past its committed blocks, so
several requests can read one cached block in the same step.
"""

from __future__ import annotations

import time

from kvtier.engine.errors import EngineError
from kvtier.radix import HiRadixTree
from kvtier.tiers import Tier


class BlockManager:
    """Allocates pool blocks and keeps the device prefix cache (``tree`` + ``block_of``)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, ...
        self.tree = HiRadixTree({Tier.DEVICE: None})  # capacity is the free list's business
        self.block_of: dict[int, int] = {}  # device-resident key -> pool block
        self.private = 0  # blocks owned by requests
        self.evicted_blocks = 0
        self._clock_s = 0.0

    def now_s(self) -> float:
        """A non-decreasing clock for the tree's LRU order."""
        self._clock_s = max(self._clock_s, time.monotonic())
        return self._clock_s

    def available(self) -> int:
        """Blocks an allocation can get now: free ones plus unlocked cached ones."""
        return len(self.free) + self.tree.evictable_blocks(Tier.DEVICE)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` private blocks, evicting unlocked cached blocks if needed; None if they do not fit."""
        if n > self.available():
            return None
        short = n - len(self.free)
        if short > 0:
            for key in self.tree.evict(Tier.DEVICE, short):
                self.free.append(self.block_of.pop(key))
                self.evicted_blocks += 1
        ids = [self.free.pop() for _ in range(n)]
        self.private += n
        return ids

    def drop_unlocked(self) -> None:
        """Evicts every unlocked cached block (no device prefix cache beyond running requests)."""
        for key in self.tree.evict(Tier.DEVICE, self.tree.evictable_blocks(Tier.DEVICE)):
            self.free.append(self.block_of.pop(key))
            self.evicted_blocks += 1

    def free_private(self, ids: list[int]) -> None:
        self.private -= len(ids)
        self.free.extend(reversed(ids))

    def match(self, keys: list[int]) -> list[int]:
        """Pool blocks of the longest device-cached prefix of ``keys`` (touched as used)."""
        m = self.tree.match(keys, now_s=self.now_s())
        return [self.block_of[k] for k in keys[: m.prefix_in(Tier.DEVICE)]]

    def cached_prefix(self, keys: list[int]) -> int:
        """Blocks of the longest device-cached prefix of ``keys``; a query (touches nothing)."""
        return self.tree.match(keys).prefix_in(Tier.DEVICE)

    def lock(self, keys: list[int], start: int = 0) -> None:
        self.tree.lock(keys, start=start)

    def unlock(self, keys: list[int]) -> None:
        if keys:
            self.tree.unlock(keys)

    def commit(self, keys: list[int], table: list[int], start: int) -> list[bool]:
        """Caches full blocks ``start..len(keys)-1`` of a request whose lock ends at ``keys[:start]``
        and extends its lock to ``keys``. Returns, per new block, whether the request's block became
        the cached one (False: the key was already cached from another block; it stays private)."""
        adopted = []
        for i in range(start, len(keys)):
            block = self.block_of.get(keys[i])
            if block is None:
                self.block_of[keys[i]] = table[i]
                self.private -= 1
            adopted.append(block is None)
        self.tree.insert(keys, Tier.DEVICE, self.now_s(), start=start)
        self.tree.lock(keys, start=start)
        return adopted

    def check_integrity(self) -> None:
        self.tree.check_integrity()
        cached = set(self.block_of.values())
        if len(cached) != len(self.block_of) or cached & set(self.free):
            raise EngineError("block manager: a block is cached twice, or both cached and free")
        if self.tree.used_blocks(Tier.DEVICE) != len(self.block_of):
            raise EngineError("block manager: tree residency and block_of disagree")
        if len(self.free) + len(self.block_of) + self.private != self.num_blocks:
            raise EngineError(
                f"block manager: {len(self.free)} free + {len(self.block_of)} cached + {self.private} "
                f"private != {self.num_blocks} blocks"
            )
