"""`KvtierHiCacheStorage`: kvtier as SGLang's HiCache storage backend (L3), docs/sglang.md.

SGLang's factory constructs it as ``cls(storage_config, kwargs)`` and then hands it the host KV
pool (``register_mem_pool_host``); the store opens then, with the pool's page as its block. A page
key is SGLang's hash string of the page (chained over the prefix), mapped to a 16-byte kvtier key
inside this backend's namespace (``blake2b`` keyed by the namespace hash): another model, TP rank,
pipeline stage or host layout hashes the same string to another key, so it misses. ``clear()``
(SGLang's `/clear_hicache_storage_backend`, e.g. after a weight update, and a PD role switch)
drops every page of the namespace from every tier (``Store.clear``).

Invariants: a page reported loaded holds exactly the bytes stored under its key (every object is
verified on load; a checksum failure, an evicted page or a server that is down is a miss,
counted in ``get_stats``); inputs (tensor dtype, shape, contiguity, slot indices) are checked
before any byte moves; a whole prefix is one store call (``batch_exists`` is one lookup).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found, unused-ignore]
    HiCacheStorage,
)
from sglang.srt.observability.metrics_collector import (  # type: ignore[import-not-found, unused-ignore]
    StorageMetrics,
)

from kvtier.errors import BufferError, ConfigError, LayoutError
from kvtier.integrations.sglang.config import BackendSettings, Parallelism
from kvtier.integrations.sglang.host_pool import HostPages
from kvtier.keys import KEY_BYTES, BlockKeys
from kvtier.store import Store

log = logging.getLogger("kvtier.sglang")


@dataclasses.dataclass
class KvtierStorageMetrics(StorageMetrics):  # type: ignore[misc]
    """SGLang's storage metrics (pages and GB/s per batch call), plus kvtier's counters
    (:class:`kvtier.store.StoreStats` as a dict) in ``kvtier``."""

    kvtier: dict[str, int] = dataclasses.field(default_factory=dict)


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
        self.model_name: str | None = storage_config.model_name
        self._metrics_on = bool(getattr(storage_config, "enable_storage_metrics", False))
        self._metrics = KvtierStorageMetrics()
        self._metrics_lock = threading.Lock()
        self._store: Store | None = None
        self._pages: HostPages | None = None
        self.mem_pool_host: Any = None

    # ------------------------------------------------------------------ setup
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Opens the store for this pool's pages (closing one opened for an earlier pool)."""
        pages = HostPages.from_host_pool(mem_pool_host, self.settings.kv_cache_dtype)
        config = self.settings.store_config(pages.geometry, self.model_name, self.parallel, pages.layout_tag)
        if self.parallel.is_mla and self.parallel.tp_size > 1 and config.remote is None:
            # SGLang backs up MLA pages from one writer rank only (`is_storage_writer`), and a DRAM
            # or SSD tier belongs to one process: every other rank would miss on every page.
            raise ConfigError(
                f"an MLA model with tp_size={self.parallel.tp_size} needs a remote tier "
                "(`remote.urls`): SGLang stores MLA pages from rank 0 only, and the other ranks "
                "read them through the one tier processes share"
            )
        self.close()
        self._store = Store(config)
        self._pages = pages
        self.mem_pool_host = mem_pool_host
        log.info("kvtier HiCache storage: %s, %d-byte pages", config.model_id, pages.page_bytes)

    @property
    def store(self) -> Store:
        if self._store is None:
            raise LayoutError("no host pool registered yet: SGLang calls register_mem_pool_host first")
        return self._store

    @property
    def pages(self) -> HostPages:
        if self._pages is None:
            raise LayoutError("no host pool registered yet: SGLang calls register_mem_pool_host first")
        return self._pages

    def keys(self, keys: Sequence[str]) -> BlockKeys:
        """SGLang's page hash strings as kvtier keys of this backend's namespace."""
        if isinstance(keys, str) or not isinstance(keys, Sequence):
            raise LayoutError(f"keys are {type(keys).__name__}; expected a list of page hash strings")
        namespace = self.store.namespace.hash
        raw = bytearray()
        for i, key in enumerate(keys):
            if not isinstance(key, str) or not key:
                raise LayoutError(f"keys[{i}] is {key!r}; expected a page hash string")
            raw += hashlib.blake2b(key.encode(), digest_size=KEY_BYTES, key=namespace).digest()
        return BlockKeys(namespace, bytes(raw))

    # ------------------------------------------------------- zero-copy (v1)
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Loads the stored prefix of ``keys`` straight into the host pool pages at
        ``host_indices``; ``True`` for each page that now holds its verified bytes."""
        ids = self.pages.page_ids(host_indices, len(keys))
        block_keys = self.keys(keys)
        start = time.perf_counter()
        with self.store.lease(block_keys) as lease:
            hit = lease.hit_blocks
            failed: tuple[int, ...] = ()
            if hit:
                report = self.store.load_into_pool(lease, self.pages.pool, ids[:hit])
                failed = report.failed
        done = [i < hit and i not in failed for i in range(len(keys))]
        self._record(prefetch=True, pages=sum(done), seconds=time.perf_counter() - start)
        return done

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Stores the host pool pages at ``host_indices`` under ``keys`` (pages already stored are
        skipped); ``True`` for each page the store holds afterwards."""
        ids = self.pages.page_ids(host_indices, len(keys))
        block_keys = self.keys(keys)
        start = time.perf_counter()
        report = self.store.put_from_pool(block_keys, self.pages.pool, ids) if len(keys) else None
        self._record(prefetch=False, pages=len(keys), seconds=time.perf_counter() - start)
        if report is None or report.rejected == 0:
            return [True] * len(keys)
        return self._present(block_keys)

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
        pages = self.pages
        if target_locations is None:
            target_locations = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        if len(target_locations) != len(keys):
            raise BufferError(f"{len(keys)} keys but {len(target_locations)} target locations")
        views = [pages.page_view(t, f"target_locations[{i}]") for i, t in enumerate(target_locations)]
        block_keys = self.keys(keys)
        with self.store.lease(block_keys) as lease:
            loaded = (
                self.store.load(lease, views[: lease.hit_blocks]).loaded_blocks if lease.hit_blocks else 0
            )
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
        views = [self.pages.page_view(v, f"values[{i}]") for i, v in enumerate(values)]
        block_keys = self.keys(keys)
        report = self.store.put(block_keys, [v[0] for v in views])
        return report.rejected == 0 or all(self._present(block_keys))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Pages present, consecutive from the first: one lookup over every tier."""
        return self.store.lookup(self.keys(keys)).hit_blocks if keys else 0

    # ----------------------------------------------------------------- admin
    def get_stats(self) -> KvtierStorageMetrics:
        """SGLang's per-call metrics since the last call (when ``enable_storage_metrics``) and
        kvtier's counters (cumulative)."""
        with self._metrics_lock:
            metrics, self._metrics = self._metrics, KvtierStorageMetrics()
        if self._store is not None:
            metrics.kvtier = self._store.stats().as_dict()
        return metrics

    def clear(self) -> None:
        """Drops every page of this backend's namespace from every tier: DRAM, the SSD pool (synced,
        so a restart does not bring them back) and the remote tier, where ranks and instances
        sharing the namespace lose them too (as SGLang's Mooncake backend's `remove_all` does).
        SGLang calls it after a weight update (its admin API) and on a PD role switch. Raises if
        a tier could not be cleared (Redis down), after clearing the others."""
        if self._store is None:
            return  # no pool registered: nothing was stored
        dropped = self._store.clear()
        log.info("kvtier HiCache storage cleared: %d blocks dropped", dropped)

    def close(self) -> None:
        """Makes the SSD tier's pages durable and closes the store (a later register reopens)."""
        store, self._store = self._store, None
        if store is not None:
            store.flush()

    def _present(self, block_keys: BlockKeys) -> list[bool]:
        return [self.store.lookup(block_keys[i : i + 1]).hit_blocks == 1 for i in range(len(block_keys))]

    def _record(self, *, prefetch: bool, pages: int, seconds: float) -> None:
        if not self._metrics_on or not pages or self._pages is None:
            return
        gb_per_s = pages * self._pages.page_bytes / 1e9 / max(seconds, 1e-9)
        with self._metrics_lock:
            if prefetch:
                self._metrics.prefetch_pgs.append(pages)
                self._metrics.prefetch_bandwidth.append(gb_per_s)
            else:
                self._metrics.backup_pgs.append(pages)
                self._metrics.backup_bandwidth.append(gb_per_s)
