"""The engine's KV hierarchy below the device pool: where full blocks go and come back from.

The engine talks to one small interface, :class:`KvTransfer` — *save* pool blocks under their keys,
*lookup* how much of a key chain the lower tiers hold (and in which tier), *load* the longest held
prefix into pool blocks — so that an asynchronous transfer engine (``kvtier.TransferEngine``, with
layerwise waits) can replace the synchronous implementation here without touching the loop.

:class:`StoreKvTransfer` is that synchronous implementation over a :class:`kvtier.Store` (DRAM, then
SSD, then remote as the store is configured); :class:`TransferEngineKvTransfer` runs the same calls as
jobs of :class:`kvtier.TransferEngine`: ``save`` gathers ``LayerFirst`` pool blocks into ``BlockFirst``
objects (:func:`kvtier.layout.gather`) and puts them; ``load`` leases the prefix, loads it into a
staging array and scatters it into the pool (:func:`kvtier.layout.scatter`). The store verifies
every block's checksum on load, so a corrupt block ends the loaded prefix: the engine then computes
the rest, never uses wrong KV.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvtier import layout
from kvtier.engine.errors import EngineError, EngineInputError
from kvtier.engine.kv import PagedKvPool
from kvtier.keys import BlockKeys
from kvtier.store import Store
from kvtier.tiers import Tier

if TYPE_CHECKING:
    from kvtier.transfer import TransferEngine


def store_tiers(names: Sequence[str]) -> tuple[Tier, ...]:
    """The store's tier names (``Lookup.tiers``, ``Lease.tiers``) as :class:`Tier` values."""
    return tuple(Tier.from_store(name) for name in names)


@dataclass(frozen=True)
class LoadResult:
    blocks: int  # loaded into the first ``blocks`` pool block ids given
    tiers: tuple[Tier, ...]  # the tier each loaded block came from


class PendingLoad(ABC):
    """A load in flight (:meth:`KvTransfer.load_async`): its blocks land layer by layer."""

    @abstractmethod
    def wait_layer(self, layer: int) -> None:
        """Returns once layer ``layer`` of every block of the load is in place (or failed)."""

    @abstractmethod
    def finish(self) -> LoadResult:
        """Waits for the whole load; the loaded prefix (a failed block ends it)."""


class KvTransfer(ABC):
    """Moves whole blocks between the engine's paged pool and the tiers below it."""

    def load_async(self, keys: BlockKeys, block_ids: Sequence[int]) -> PendingLoad | None:
        """Starts loading ``keys`` (all held, per :meth:`lookup`) into ``block_ids``; ``None`` when
        this transfer has no asynchronous path (the engine then calls :meth:`load`)."""
        return None

    def prefetch(self, keys: BlockKeys) -> int:
        """Brings the blocks of ``keys``' held prefix that sit below host memory (SSD, remote) up
        into it (Strata §4.3.3); returns how many moved up. Raises where this transfer cannot."""
        raise EngineError(f"{type(self).__name__} cannot prefetch blocks into host memory")

    @abstractmethod
    def save(self, keys: BlockKeys, block_ids: Sequence[int]) -> int:
        """Stores pool blocks ``block_ids[i]`` under ``keys[i]``; returns the blocks newly stored."""

    @abstractmethod
    def lookup(self, keys: BlockKeys) -> tuple[Tier, ...]:
        """The tier holding each block of the longest consecutive held prefix of ``keys``."""

    @abstractmethod
    def load(self, keys: BlockKeys, block_ids: Sequence[int]) -> LoadResult:
        """Loads the longest held prefix of ``keys`` (at most ``len(block_ids)`` blocks) into pool
        blocks ``block_ids``, in order; a miss or a failed checksum ends it."""


class StoreKvTransfer(KvTransfer):
    """Synchronous save/lookup/load through a :class:`Store`, with ``layout.gather``/``scatter``."""

    def __init__(self, store: Store, pool: PagedKvPool, copier: layout.Copier | None = None) -> None:
        if store.config.geometry != pool.geometry:
            raise EngineInputError(
                f"the store's geometry {store.config.geometry} differs from the engine pool's {pool.geometry}; "
                f"build the StoreConfig with kvtier.engine.pool_geometry(model.config, block_tokens)"
            )
        self.store = store
        self.pool = pool
        self.copier = copier or layout.Copier(threads=1)

    def save(self, keys: BlockKeys, block_ids: Sequence[int]) -> int:
        if len(keys) != len(block_ids):
            raise EngineInputError(f"{len(keys)} keys for {len(block_ids)} blocks")
        if not len(keys):
            return 0
        held = self.store.lookup(keys).hit_blocks  # a chain's held part is a prefix: skip it
        if held == len(keys):
            return 0
        geometry = self.pool.geometry
        objects = self.copier.gather(geometry, self.pool.pool, list(block_ids[held:]))
        return self.store.put(keys[held:], objects).stored

    def lookup(self, keys: BlockKeys) -> tuple[Tier, ...]:
        return store_tiers(self.store.lookup(keys).tiers) if len(keys) else ()

    def prefetch(self, keys: BlockKeys) -> int:
        return promote(self.store, keys)

    def load(self, keys: BlockKeys, block_ids: Sequence[int]) -> LoadResult:
        keys = keys[: len(block_ids)]
        if not len(keys):
            return LoadResult(0, ())
        with self.store.lease(keys) as lease:
            if not lease.hit_blocks:
                return LoadResult(0, ())
            staging = np.empty((lease.hit_blocks, self.store.block_bytes), dtype=np.uint8)
            report = self.store.load(lease, staging)
            tiers = store_tiers(lease.tiers[: report.loaded_blocks])
        if report.loaded_blocks:
            ids = list(block_ids[: report.loaded_blocks])
            self.copier.scatter(self.pool.geometry, staging[: report.loaded_blocks], ids, self.pool.pool)
        return LoadResult(report.loaded_blocks, tiers)


class TransferEngineKvTransfer(KvTransfer):
    """Save and load through :class:`kvtier.TransferEngine` (the chunked read → decompress →
    dequantize → scatter pipeline, ``crates/kvtier-transfer``) instead of gather/put and
    lease/load/scatter here. Jobs are waited for before returning, so the loop sees the same
    contract as :class:`StoreKvTransfer`: a block whose job outcome is not ``"done"`` (a miss, a
    failed checksum, a failed decode) ends the loaded prefix, and the engine computes the rest."""

    def __init__(self, store: Store, pool: PagedKvPool, engine: TransferEngine | None = None) -> None:
        from kvtier.transfer import TransferConfig, TransferEngine

        if store.config.geometry != pool.geometry:
            raise EngineInputError(
                f"the store's geometry {store.config.geometry} differs from the engine pool's {pool.geometry}"
            )
        self.store = store
        self.pool = pool
        self.engine = engine or TransferEngine(store, TransferConfig())

    def save(self, keys: BlockKeys, block_ids: Sequence[int]) -> int:
        if len(keys) != len(block_ids):
            raise EngineInputError(f"{len(keys)} keys for {len(block_ids)} blocks")
        held = self.store.lookup(keys).hit_blocks if len(keys) else 0
        if held == len(keys):
            return 0
        [job] = self.engine.wait(
            self.engine.submit_store(keys[held:], self.pool.pool, list(block_ids[held:]))
        )
        return job.done_blocks

    def lookup(self, keys: BlockKeys) -> tuple[Tier, ...]:
        return store_tiers(self.store.lookup(keys).tiers) if len(keys) else ()

    def prefetch(self, keys: BlockKeys) -> int:
        return promote(self.store, keys)

    def load(self, keys: BlockKeys, block_ids: Sequence[int]) -> LoadResult:
        keys = keys[: len(block_ids)]
        tiers = self.lookup(keys)
        if not tiers:
            return LoadResult(0, ())
        n = len(tiers)
        [job] = self.engine.wait(self.engine.submit_load(keys[:n], self.pool.pool, list(block_ids[:n])))
        loaded = next((i for i, outcome in enumerate(job.outcomes) if outcome != "done"), n)
        return LoadResult(loaded, tiers[:loaded])

    def load_async(self, keys: BlockKeys, block_ids: Sequence[int]) -> PendingLoad | None:
        tiers = self.lookup(keys)
        if len(tiers) < len(keys):
            return None  # not all held any more: the synchronous path loads what is
        job = self.engine.submit_load(keys, self.pool.pool, list(block_ids))
        return _TransferJobLoad(self.engine, job, tiers)


def promote(store: Store, keys: BlockKeys) -> int:
    """Reads the held prefix of ``keys`` once, so that the store promotes its SSD and remote hits
    into DRAM (``promote_on_hit``); returns the blocks that moved up. A tier holding some of them
    with promotion off raises: the prefetch could not be carried out."""
    if not len(keys):
        return 0
    with store.lease(keys) as lease:
        before = store_tiers(lease.tiers)
        below = [t for t in before if t > Tier.HOST]
        if not below:
            return 0
        config = store.config
        for tier, section in ((Tier.SSD, config.ssd), (Tier.REMOTE, config.remote)):
            if tier in below and section is not None and not section.promote_on_hit:
                raise EngineError(
                    f"the store does not promote {tier.label} hits (`{section.PATH}.promote_on_hit`): "
                    "no prefetch"
                )
        staging = np.empty((lease.hit_blocks, store.block_bytes), dtype=np.uint8)
        store.load(lease, staging)
    after = store_tiers(store.lookup(keys).tiers)
    return sum(1 for i, t in enumerate(after[: len(before)]) if t < before[i])


class _TransferJobLoad(PendingLoad):
    def __init__(self, engine: TransferEngine, job: int, tiers: tuple[Tier, ...]) -> None:
        self.engine, self.job, self.tiers = engine, job, tiers
        self.result: LoadResult | None = None

    def wait_layer(self, layer: int) -> None:
        if self.result is None:
            self.engine.wait_layer(self.job, layer)

    def finish(self) -> LoadResult:
        if self.result is None:
            [job] = self.engine.wait(self.job)
            loaded = next(
                (i for i, outcome in enumerate(job.outcomes) if outcome != "done"), len(job.outcomes)
            )
            self.result = LoadResult(loaded, self.tiers[:loaded])
        return self.result
