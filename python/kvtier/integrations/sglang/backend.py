"""`KvtierHiCacheStorage`: kvtier as SGLang's HiCache storage backend (L3), docs/sglang.md.

SGLang's factory constructs it as ``cls(storage_config, kwargs)`` and then hands it the host KV
pool (``register_mem_pool_host``: its config is checked then) and, for a hybrid model, its other
host pools (``register_mem_host_pool_v2``); the stores open once every pool is known
(``on_host_pools_registered``, or the first call), each with its pool's page as its block. A page
key is SGLang's hash string of the page (chained over the prefix), mapped to a 16-byte kvtier key
inside this backend's namespace (``blake2b`` keyed by the namespace hash): another model, TP rank,
pipeline stage or host layout hashes the same string to another key, so it misses. ``clear()``
(SGLang's `/clear_hicache_storage_backend`, e.g. after a weight update, and a PD role switch)
drops every page of the namespace from every tier (``Store.clear``).

A hybrid model's other host pools (SWA KV, Mamba state, draft KV: ``register_mem_host_pool_v2``)
are read and written by the v2 calls, each pool in its own store and namespace (``pools.py``);
``batch_exists_v2`` answers which prefixes every pool can restore (``hybrid.py``). A pool kvtier
cannot store (a sparse indexer, DeepSeek V4's compressed pools) is refused with a warning at
registration, and every query that needs it is a miss.

Invariants: a page reported loaded holds exactly the bytes stored under its key (every object is
verified on load; a checksum failure, an evicted page or a server that is down is a miss,
counted in ``get_stats``); inputs (tensor dtype, shape, contiguity, slot indices) are checked
before any byte moves; a whole prefix is one store call (``batch_exists`` is one lookup).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found, unused-ignore]
    HiCacheStorage,
    PoolTransferResult,
)
from sglang.srt.observability.metrics_collector import (  # type: ignore[import-not-found, unused-ignore]
    StorageMetrics,
)

from kvtier.errors import BufferError, ConfigError, KvtierError, LayoutError
from kvtier.integrations.sglang.config import BackendSettings, Parallelism
from kvtier.integrations.sglang.host_pool import HostPages
from kvtier.integrations.sglang.hybrid import PoolPresence, hit_verdict
from kvtier.integrations.sglang.pools import KV, PoolStore, close_stores, open_stores, store_configs
from kvtier.keys import BlockKeys
from kvtier.store import Store

log = logging.getLogger("kvtier.sglang")


@dataclasses.dataclass
class KvtierStorageMetrics(StorageMetrics):  # type: ignore[misc]
    """SGLang's storage metrics (pages and GB/s per batch call), plus kvtier's counters
    (:class:`kvtier.store.StoreStats` as a dict) in ``kvtier`` (the KV pool's store) and in
    ``kvtier_pools`` (a hybrid model's other host pools' stores, by SGLang's pool name)."""

    kvtier: dict[str, int] = dataclasses.field(default_factory=dict)
    kvtier_pools: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)


class KvtierHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """A kvtier Store (DRAM, SSD, remote tiers as configured) behind SGLang's HiCacheStorage API."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        self.settings = BackendSettings.from_extra_config(getattr(storage_config, "extra_config", None))
        self.parallel = Parallelism(
            tp_rank=storage_config.tp_rank,
            tp_size=storage_config.tp_size,
            pp_rank=storage_config.pp_rank,
            pp_size=storage_config.pp_size,
            cp_rank=storage_config.attn_cp_rank,
            cp_size=storage_config.attn_cp_size,
            is_mla=bool(storage_config.is_mla_model),
            dp_rank=getattr(storage_config, "dp_rank", 0),
        )
        # SGLang's tp_lcm_size: the KV pool's pages are stored as head shards where it can be cut so
        # (register_mem_pool_host decides), else whole as without it.
        self._tp_lcm_size: int | None = getattr(storage_config, "tp_lcm_size", None)
        self._parallel_whole = self.parallel
        self.model_name: str | None = storage_config.model_name
        self._metrics_on = bool(getattr(storage_config, "enable_storage_metrics", False))
        self._metrics = KvtierStorageMetrics()
        self._metrics_lock = threading.Lock()
        # SGLang's pool name -> its pages and store, "kv" the anchor's, once laid out: every pool
        # registered so far gets its store and its share of the tiers at once (an SSD pool keeps
        # the size it was created with, so no store opens before the shares are known).
        self._pools: dict[str, PoolStore] = {}
        self._registered: dict[str, HostPages] = {}  # "kv" first, then the other pools
        self._refused: dict[str, str] = {}  # pool name -> why kvtier does not store it
        self._laid_out = False
        self._layout_lock = threading.Lock()
        self.mem_pool_host: Any = None

    # ------------------------------------------------------------------ setup
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Takes SGLang's KV pool and checks its store's config (closing the stores opened for
        earlier pools); the stores open once SGLang registered every pool."""
        parallel = self._kv_parallel(mem_pool_host)
        pages = HostPages.from_host_pool(mem_pool_host, self.settings.kv_cache_dtype, parallel.head_split)
        config = store_configs(self.settings, self.model_name, parallel, {KV: pages})[KV]
        if self.parallel.is_mla and self.parallel.tp_size > 1 and config.remote is None:
            # SGLang backs up MLA pages from one writer rank only (`is_storage_writer`), and a DRAM
            # or SSD tier belongs to one process: every other rank would miss on every page.
            raise ConfigError(
                f"an MLA model with tp_size={self.parallel.tp_size} needs a remote tier "
                "(`remote.urls`): SGLang stores MLA pages from rank 0 only, and the other ranks "
                "read them through the one tier processes share"
            )
        self.close()
        self._registered, self._refused, self._laid_out = {KV: pages}, {}, False
        self.mem_pool_host, self.parallel = mem_pool_host, parallel
        log.info("kvtier HiCache storage: %s, %d-byte pages", config.model_id, pages.page_bytes)

    def _kv_parallel(self, mem_pool_host: Any) -> Parallelism:
        """The parallel layout the KV pool's pages are stored under: with SGLang's ``tp_lcm_size``
        and an MHA pool in the ``page_head`` layout, in head shards of ``tp_lcm_size`` virtual
        ranks, which every TP size dividing it shares (as SGLang's Mooncake backend splits heads);
        otherwise whole: MLA pages, the same on every rank, are shared by every TP size already;
        MHA pages in another layout only with the same TP size (a warning says so)."""
        whole, lcm = self._parallel_whole, self._tp_lcm_size
        if lcm is None or whole.is_mla:
            return whole
        layout = getattr(mem_pool_host, "layout", None)
        if layout != "page_head":
            log.warning(
                "kvtier: tp_lcm_size=%s shares MHA pages between TP sizes in SGLang's page_head host "
                "layout only (their heads are cut into shards); this pool's pages (layout %s) are "
                "shared with tp_size=%d only",
                lcm,
                layout,
                whole.tp_size,
            )
            return whole
        return dataclasses.replace(whole, tp_lcm_size=lcm)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Takes one of a hybrid model's host pools (SGLang registers every pool of its group,
        the KV anchor too, before ``on_host_pools_registered``). A pool kvtier cannot store, or one
        registered after the pools were laid out, is refused with a warning: its queries miss."""
        name = _pool_name(host_pool_name)
        if name == KV:
            if host_pool is not self.mem_pool_host:
                raise LayoutError(
                    f"SGLang registered a {type(host_pool).__name__} as its KV pool; the KV pool "
                    f"registered first is a {type(self.mem_pool_host).__name__}"
                )
            return
        if self._laid_out:
            self._refuse(name, "registered after SGLang's host pools were laid out over the tiers")
            return
        try:
            self._registered[name] = HostPages.from_host_pool(host_pool, self.settings.kv_cache_dtype)
        except (LayoutError, ConfigError, BufferError) as e:
            self._refuse(name, str(e))

    def on_host_pools_registered(self) -> None:
        """Lays the registered pools over the tiers: opens every pool's store, with its share of
        them when there are several (``pools.py``). SGLang calls it once its pools are registered,
        before any transfer; a call before it does it first (and one while it runs waits)."""
        with self._layout_lock:
            if self._laid_out or KV not in self._registered:
                return
            pages = dict(self._registered)
            configs = store_configs(self.settings, self.model_name, self.parallel, pages)
            self._pools = open_stores(configs, pages, self.parallel.shard_ranks)
            self._laid_out = True
        if len(pages) > 1:
            for name, config in configs.items():
                log.info(
                    "kvtier HiCache storage, SGLang's %r pool: %s, %d-byte pages, %d bytes of DRAM",
                    name,
                    config.model_id,
                    pages[name].page_bytes,
                    config.dram.capacity_bytes,
                )

    def _refuse(self, name: str, why: str) -> None:
        self._refused[name] = why
        log.warning(
            "kvtier does not store SGLang's %r host pool (%s): every prefix that needs it misses "
            "L3, and its backups report failure",
            name,
            why,
        )

    @property
    def store(self) -> Store:
        """The KV pool's store."""
        return self._kv().store

    @property
    def pages(self) -> HostPages:
        """The KV pool's pages."""
        return self._kv().pages

    @property
    def pools(self) -> Mapping[str, PoolStore]:
        """Every host pool kvtier stores, by SGLang's pool name (``"kv"``, ``"mamba"``, ...)."""
        self._lay_out()
        return dict(self._pools)

    @property
    def refused_pools(self) -> Mapping[str, str]:
        """The host pools SGLang registered that kvtier does not store, and why."""
        return dict(self._refused)

    def _kv(self) -> PoolStore:
        self._lay_out()
        pool = self._pools.get(KV)
        if pool is None:
            raise LayoutError("no host pool registered yet: SGLang calls register_mem_pool_host first")
        return pool

    def _lay_out(self) -> None:
        if not self._laid_out:
            self.on_host_pools_registered()

    def _pool(self, name: Any) -> PoolStore | None:
        """The pool SGLang names in a v2 call, or None for one kvtier does not store."""
        self._kv()
        return self._pools.get(_pool_name(name))

    def keys(self, keys: Sequence[str]) -> BlockKeys:
        """SGLang's page hash strings as kvtier keys of the KV pool's namespace."""
        return self._kv().keys(keys)

    # ------------------------------------------------------- zero-copy (v1)
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Loads the stored prefix of ``keys`` straight into the host pool pages at
        ``host_indices``; ``True`` for each page that now holds its verified bytes."""
        kv = self._kv()
        ids = kv.pages.page_ids(host_indices, len(keys))
        return self._load(kv, kv.keys(keys), ids)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Stores the host pool pages at ``host_indices`` under ``keys`` (pages already stored are
        skipped); ``True`` for each page the store holds afterwards."""
        kv = self._kv()
        ids = kv.pages.page_ids(host_indices, len(keys))
        return self._save(kv, kv.keys(keys), ids)

    def _load(self, pool: PoolStore, block_keys: BlockKeys, ids: Any) -> list[bool]:
        """Loads the stored prefix of ``block_keys`` into ``pool``'s pages ``ids`` (both checked
        by the caller); ``True`` for each page that now holds its verified bytes."""
        if not len(block_keys):
            return []
        start = time.perf_counter()
        with pool.store.lease(block_keys) as lease:
            hit = lease.hit_blocks
            failed: tuple[int, ...] = ()
            if hit:
                report = pool.store.load_into_pool(lease, pool.pages.pool, ids[:hit])
                failed = report.failed
        done = pool.pages_done([i < hit and i not in failed for i in range(len(block_keys))])
        self._record(
            prefetch=True,
            pages=sum(done),
            page_bytes=pool.pages.page_bytes,
            seconds=time.perf_counter() - start,
        )
        return done

    def _save(self, pool: PoolStore, block_keys: BlockKeys, ids: Any) -> list[bool]:
        """Stores ``pool``'s pages ``ids`` under ``block_keys`` (both checked by the caller);
        ``True`` for each page the store holds afterwards."""
        if not len(block_keys):
            return []
        start = time.perf_counter()
        report = pool.store.put_from_pool(block_keys, pool.pages.pool, ids)
        self._record(
            prefetch=False,
            pages=len(block_keys) // pool.split,
            page_bytes=pool.pages.page_bytes,
            seconds=time.perf_counter() - start,
        )
        if report.rejected == 0:
            return [True] * (len(block_keys) // pool.split)
        return pool.pages_done([tier is not None for tier in pool.store.lookup_each(block_keys)])

    # ----------------------------------------------------- hybrid pools (v2)
    def batch_exists_v2(
        self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None
    ) -> PoolTransferResult:
        """Which prefixes of ``keys`` (the KV pages' hashes) the KV pool and every pool in
        ``pool_transfers`` can restore (``hybrid.py``): one KV lookup, one ``lookup_each`` per pool."""
        kv = self._kv()
        kv_pages = kv.store.lookup(kv.keys(keys)).hit_blocks // kv.split if len(keys) else 0
        presence = []
        for transfer in pool_transfers or []:
            pool = self._pool(transfer.name)
            present: tuple[bool, ...] = (False,) * kv_pages
            if pool is not None and kv_pages:
                found = pool.store.lookup_each(pool.keys(keys[:kv_pages]))
                present = tuple(tier is not None for tier in found)
            window = max(1, len(transfer.keys or ()))
            policy = str(getattr(transfer.hit_policy, "value", transfer.hit_policy))
            presence.append(PoolPresence(_pool_name(transfer.name), policy, window, present))
        verdict = hit_verdict(kv_pages, presence)
        return PoolTransferResult(verdict.hit_pages, verdict.pool_hit_pages, list(verdict.restorable))

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[str, list[bool]]:
        """Loads each transfer's pages (its ``keys`` into its pool's ``host_indices``); per pool,
        ``True`` for each page that now holds its verified bytes. Every transfer is checked
        before any page moves; a pool kvtier does not store answers ``False``."""
        return {
            t.name: self._load(t.pool, t.keys, t.ids) if t.pool and t.keys is not None else [False] * t.pages
            for t in self._prepare(transfers)
        }

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[str, list[bool]]:
        """Stores each transfer's pages; per pool, ``True`` for each page stored afterwards."""
        return {
            t.name: self._save(t.pool, t.keys, t.ids) if t.pool and t.keys is not None else [False] * t.pages
            for t in self._prepare(transfers)
        }

    def _prepare(self, transfers: Any) -> list[_Transfer]:
        """Each transfer's pool, kvtier keys and page ids, every transfer's keys and indices
        checked before any page moves; a pool kvtier does not store has none."""
        if isinstance(transfers, str | bytes) or not isinstance(transfers, Sequence):
            raise LayoutError(f"transfers are {type(transfers).__name__}; expected a list of PoolTransfer")
        out = []
        for transfer in transfers:
            pool = self._pool(transfer.name)
            keys = list(transfer.keys or [])
            if pool is None:
                out.append(_Transfer(transfer.name, len(keys)))
                continue
            indices = transfer.host_indices
            empty = not keys and (indices is None or int(indices.numel()) == 0)
            ids = None if empty else pool.pages.page_ids(indices, len(keys))
            out.append(_Transfer(transfer.name, len(keys), pool, pool.keys(keys), ids))
        return out

    # ------------------------------------------------------ tensor pages (v0)
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """The page stored under ``key``, loaded into ``target_location`` (a flat page tensor; a
        new one if None), or None on a miss."""
        out = self.batch_get([key], None if target_location is None else [target_location])
        return out[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Each key's page in its target (or a new flat page), or None from the first miss on."""
        kv = self._kv()
        if target_locations is None:
            target_locations = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        if len(target_locations) != len(keys):
            raise BufferError(f"{len(keys)} keys but {len(target_locations)} target locations")
        views = [kv.pages.page_view(t, f"target_locations[{i}]") for i, t in enumerate(target_locations)]
        block_keys, split = kv.keys(keys), kv.split
        with kv.store.lease(block_keys) as lease:
            hit = lease.hit_blocks // split  # whole pages: every head shard of each
            if split == 1:
                loaded = kv.store.load(lease, views[:hit]).loaded_blocks if hit else 0
            else:
                shards = np.empty((hit * split, kv.pages.object_bytes), dtype=np.uint8)
                loaded = kv.store.load(lease, shards).loaded_blocks // split if hit else 0
                for i in range(loaded):
                    kv.pages.fill_page(views[i], shards[i * split : (i + 1) * split])
        return [t if i < loaded else None for i, t in enumerate(target_locations)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Stores one flat page tensor under ``key``."""
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Stores flat page tensors under ``keys``; True when the store holds all of them."""
        if values is None or len(values) != len(keys):
            raise BufferError(f"{len(keys)} keys but {0 if values is None else len(values)} values")
        if not keys:
            return True
        kv = self._kv()
        views = [kv.pages.page_view(v, f"values[{i}]") for i, v in enumerate(values)]
        block_keys = kv.keys(keys)
        report = kv.store.put(block_keys, [obj for v in views for obj in kv.pages.page_objects(v)])
        return report.rejected == 0 or None not in kv.store.lookup_each(block_keys)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Pages present, consecutive from the first: one lookup over every tier."""
        kv = self._kv()
        return kv.store.lookup(kv.keys(keys)).hit_blocks // kv.split if keys else 0

    # ----------------------------------------------------------------- admin
    def get_stats(self) -> KvtierStorageMetrics:
        """SGLang's per-call metrics since the last call (when ``enable_storage_metrics``) and
        kvtier's counters (cumulative): the KV pool's store, and each other pool's."""
        with self._metrics_lock:
            metrics, self._metrics = self._metrics, KvtierStorageMetrics()
        for name, pool in self._pools.items():
            stats = pool.store.stats().as_dict()
            if name == KV:
                metrics.kvtier = stats
            else:
                metrics.kvtier_pools[name] = stats
        return metrics

    def clear(self) -> None:
        """Drops every page of this backend's namespaces (every host pool's) from every tier: DRAM,
        the SSD pool (synced, so a restart does not bring them back) and the remote tier, where
        ranks and instances sharing the namespace lose them too (as SGLang's Mooncake backend's
        `remove_all` does). SGLang calls it after a weight update (its admin API) and on a PD role
        switch. Raises if a tier could not be cleared (Redis down), after clearing the others."""
        self._lay_out()  # pages stored by an earlier process are cleared too
        failures: list[KvtierError] = []
        for name, pool in list(self._pools.items()):
            try:
                dropped = pool.store.clear()
            except KvtierError as e:
                failures.append(e)
                continue
            log.info("kvtier HiCache storage cleared SGLang's %r pool: %d blocks dropped", name, dropped)
        if failures:
            raise failures[0]

    def close(self) -> None:
        """Makes the SSD tiers' pages durable and closes the stores (a later register reopens)."""
        pools, self._pools = self._pools, {}
        close_stores(pools.values())

    def _record(self, *, prefetch: bool, pages: int, page_bytes: int, seconds: float) -> None:
        if not self._metrics_on or not pages:
            return
        gb_per_s = pages * page_bytes / 1e9 / max(seconds, 1e-9)
        with self._metrics_lock:
            if prefetch:
                self._metrics.prefetch_pgs.append(pages)
                self._metrics.prefetch_bandwidth.append(gb_per_s)
            else:
                self._metrics.backup_pgs.append(pages)
                self._metrics.backup_bandwidth.append(gb_per_s)


class _Transfer(NamedTuple):
    """One ``PoolTransfer`` of a v2 call, checked: SGLang's pool name (as given: the result's
    key), its page count, and (for a pool kvtier stores) the pool, kvtier keys and page ids."""

    name: Any
    pages: int
    pool: PoolStore | None = None
    keys: BlockKeys | None = None
    ids: Any = None


def _pool_name(name: Any) -> str:
    """SGLang's pool name (a ``PoolName``, a ``str`` enum) as its plain string value."""
    value = getattr(name, "value", name)
    if not isinstance(value, str) or not value:
        raise LayoutError(f"host pool name {name!r}; expected one of SGLang's PoolName values")
    return value
