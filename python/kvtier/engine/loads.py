"""Loads from the store below the reference engine's pool (:class:`StoreLoads`): a request's cached
prefix into new pool blocks, and host prefetches (Strata §4.3.3).

A load is synchronous, or with ``EngineConfig.layerwise_loads`` it lands while the step computes:
each layer's attention first waits for that layer of the loads in flight (:class:`LayerwiseAccess`;
Unified KV pooling §II-B, Strata §4.2.1), and the load is settled within the step that started it.
A block that fails to load (a miss, a failed checksum) ends the loaded prefix: the request keeps
what landed and computes the rest, never uses wrong KV. A prefetch reads a waiting request's
SSD/remote blocks once so that the store promotes them into its DRAM tier.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Protocol

from kvtier.engine.blocks import BlockManager
from kvtier.engine.hierarchy import KvTransfer, PendingLoad
from kvtier.engine.kv import F32Array, KvAccess
from kvtier.engine.request import EngineRequest
from kvtier.geometry import Geometry
from kvtier.tiers import Tier


class LoadStats(Protocol):
    load_s: float
    loaded_blocks: int
    prefetched_blocks: int


class StoreLoads:
    def __init__(
        self,
        transfer: KvTransfer | None,
        blocks: BlockManager,
        geometry: Geometry,
        layerwise: bool,
        stats: LoadStats,
        commit: Callable[[EngineRequest], None],
    ) -> None:
        self._transfer = transfer
        self._blocks = blocks
        self._geometry = geometry
        self._layerwise = layerwise
        self._stats = stats
        self._commit = commit  # caches a request's newly full blocks in the device prefix cache
        # req_id -> (load in flight, first table index it fills, blocks, start time).
        self.inflight: dict[int, tuple[PendingLoad, int, int, float]] = {}

    def load(self, r: EngineRequest, end_block: int) -> None:
        """Loads blocks ``len(r.table) .. end_block - 1`` of ``r`` from the store into new blocks."""
        assert self._transfer is not None
        bt = self._geometry.block_tokens
        start = len(r.table)
        keys = r.block_keys(end_block)[start:]
        held = len(self._transfer.lookup(keys))
        ids = self._blocks.allocate(held) if held else None
        if not ids:
            return
        began = time.perf_counter()
        if self._layerwise:
            pending = self._transfer.load_async(keys[:held], ids)
            if pending is not None:  # lands while the step computes; settled by settle()
                self.inflight[r.req_id] = (pending, len(r.table), held, began)
                r.table.extend(ids)
                r.num_computed += held * bt
                return
        result = self._transfer.load(keys[:held], ids)
        self._stats.load_s += time.perf_counter() - began
        self._stats.loaded_blocks += result.blocks
        self._blocks.free_private(ids[result.blocks :])
        r.table.extend(ids[: result.blocks])
        r.num_computed += result.blocks * bt
        for tier in result.tiers:
            r.hit_tokens[tier] += bt
        self._commit(r)

    def settle(self, r: EngineRequest) -> bool:
        """Waits for ``r``'s load in flight, if any; returns whether every block landed. On a
        failure ``r`` keeps the loaded prefix and recomputes from the failed block (the blocks past
        it stay in its table, to be rewritten)."""
        entry = self.inflight.pop(r.req_id, None)
        if entry is None:
            return True
        pending, first, blocks, began = entry
        result = pending.finish()
        self._stats.load_s += time.perf_counter() - began
        self._stats.loaded_blocks += result.blocks
        for tier in result.tiers:
            r.hit_tokens[tier] += self._geometry.block_tokens
        if result.blocks < blocks:
            r.num_computed = (first + result.blocks) * self._geometry.block_tokens
        self._commit(r)
        return result.blocks == blocks

    def prefetch(self, r: EngineRequest, tokens: int) -> None:
        """Brings the SSD/remote blocks of ``r``'s stored prefix up into the store's DRAM tier, at
        most ``tokens`` of them past its DRAM part."""
        assert self._transfer is not None
        bt = self._geometry.block_tokens
        keys = r.block_keys((r.prefill_len - 1) // bt)
        tiers = self._transfer.lookup(keys)
        host = next((i for i, t in enumerate(tiers) if t > Tier.HOST), len(tiers))
        end = min(len(tiers), host + math.ceil(tokens / bt))
        self._stats.prefetched_blocks += self._transfer.prefetch(keys[:end])


class LayerwiseAccess(KvAccess):
    """A step's KV access whose reads of layer ``l`` first wait for layer ``l`` of the loads in flight
    (Unified KV pooling §II-B, Strata §4.2.1: a layer computes once its KV has arrived)."""

    def __init__(self, inner: KvAccess, loads: list[PendingLoad]) -> None:
        super().__init__(inner.query_lens, inner.context_lens)
        self._inner, self._loads, self._ready = inner, loads, -1

    def write(self, layer: int, k: F32Array, v: F32Array) -> None:
        self._inner.write(layer, k, v)

    def read(self, layer: int, seq: int) -> tuple[F32Array, F32Array]:
        if layer > self._ready:
            for load in self._loads:
                load.wait_layer(layer)
            self._ready = layer
        return self._inner.read(layer, seq)
