"""A hybrid model's SGLang host pools as kvtier stores, one per pool (docs/sglang.md "Hybrid
models"): the KV pool (SGLang's anchor, what the v0/v1 calls read and write) and the pools SGLang
registers beside it (``register_mem_host_pool_v2``: SWA KV, Mamba state, draft KV, ...).

A store holds objects of one size, and each pool's page is its own size, so each pool has its own
store and namespace: the KV pool's model id is the one it always had, every other pool's ends in
``|pool=<name>`` and names its own layout, so a page of one pool is never found under another's
key, nor under the KV's. Rank rules follow the pool's bytes: MLA-class pools (the same bytes on
every TP rank) drop the TP rank as MLA KV does; every other pool (MHA-class KV, Mamba state, which
SGLang backs up from every rank) keeps it.

The pools share the configured tiers: DRAM and SSD capacities are split in proportion to the host
pools' bytes (SGLang's own split of host memory between them); a pool other than KV keeps its SSD
pool in ``<ssd dir>/pool-<name>`` (its own file, even when ``ssd.devices`` hold the KV pool's) and
shares the remote tier under its own namespace.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvtier.config import StoreConfig
from kvtier.errors import ConfigError, KvtierError, LayoutError
from kvtier.integrations.sglang.config import BackendSettings, Parallelism, PoolPart
from kvtier.integrations.sglang.host_pool import HostPages
from kvtier.keys import KEY_BYTES, BlockKeys
from kvtier.store import Store

log = logging.getLogger("kvtier.sglang")

KV = "kv"


def page_keys(namespace_hash: bytes, keys: Sequence[str], shard_ranks: Sequence[int] = ()) -> BlockKeys:
    """SGLang's page hash strings as kvtier keys of a namespace (``blake2b`` keyed by its hash).
    With ``shard_ranks`` (head shards, ``Parallelism.shard_ranks``), each page's key for each of
    them in turn: the hash string, a NUL, and the virtual rank."""
    if isinstance(keys, str) or not isinstance(keys, Sequence):
        raise LayoutError(f"keys are {type(keys).__name__}; expected a list of page hash strings")
    raw = bytearray()
    for i, key in enumerate(keys):
        if not isinstance(key, str) or not key:
            raise LayoutError(f"keys[{i}] is {key!r}; expected a page hash string")
        material = key.encode()
        for shard in shard_ranks or (None,):
            named = material if shard is None else b"%s\x00%d" % (material, shard)
            raw += hashlib.blake2b(named, digest_size=KEY_BYTES, key=namespace_hash).digest()
    return BlockKeys(namespace_hash, bytes(raw))


@dataclass(frozen=True)
class PoolStore:
    """One SGLang host pool (by SGLang's pool name), its pages and the store that holds them."""

    name: str
    pages: HostPages
    store: Store
    #: The virtual ranks of a KV page's head shards (``Parallelism.shard_ranks``), or empty.
    shard_ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.shard_ranks and len(self.shard_ranks) != self.pages.split:
            raise LayoutError(
                f"{len(self.shard_ranks)} shard ranks for pages of {self.pages.split} head shards"
            )

    @property
    def split(self) -> int:
        """Stored objects per page (:attr:`HostPages.split`)."""
        return self.pages.split

    def keys(self, keys: Sequence[str]) -> BlockKeys:
        """SGLang's page hash strings as keys of this pool's namespace: one per page, or one per
        head shard of each page (in page order, then shard order: as ``pages.page_ids``)."""
        return page_keys(self.store.namespace.hash, keys, self.shard_ranks)

    def pages_done(self, objects: Sequence[bool]) -> list[bool]:
        """Per page, whether every one of its objects was (``objects``: one flag per key)."""
        split = self.split
        return [all(objects[i : i + split]) for i in range(0, len(objects), split)]


def _share(total: int, weight: int, weights: int) -> int:
    return total * weight // weights


def store_configs(
    settings: BackendSettings, model: str | None, parallel: Parallelism, pools: Mapping[str, HostPages]
) -> dict[str, StoreConfig]:
    """Each pool's StoreConfig (``pools`` holds ``"kv"``). With the KV pool alone, the backend's
    config unchanged; with others, each gets its share of the tiers (module docs)."""
    kv = pools[KV]
    kv_config = settings.store_config(kv.geometry, model, parallel, kv.layout_tag)
    if len(pools) == 1:
        return {KV: kv_config}
    weights = {name: pages.num_pages * pages.page_bytes for name, pages in pools.items()}
    total = sum(weights.values())
    ssd_total = kv_config.ssd.capacity_bytes if kv_config.ssd is not None else None
    if kv_config.ssd is not None and kv_config.ssd.devices:
        log.warning(
            "kvtier: `ssd.devices` hold the KV pool's SSD pool; SGLang's other host pools (%s) each "
            "keep theirs in a file under `ssd.directory`",
            ", ".join(name for name in pools if name != KV),
        )
    out = {}
    for name, pages in pools.items():
        part = PoolPart(
            name=None if name == KV else name,
            dram_bytes=_share(kv_config.dram.capacity_bytes, weights[name], total),
            ssd_bytes=None if ssd_total is None else _share(ssd_total, weights[name], total),
        )
        # MLA-class pages are the same on every TP rank (one copy for all); others are per rank.
        # Only the KV pool's pages are cut into head shards.
        rank_rule = (
            parallel if name == KV else dataclasses.replace(parallel, is_mla=pages.is_mla, tp_lcm_size=None)
        )
        try:
            out[name] = settings.store_config(pages.geometry, model, rank_rule, pages.layout_tag, part=part)
        except ConfigError as e:
            raise ConfigError(
                f"SGLang's {name!r} host pool ({weights[name]} of the host pools' {total} bytes, so "
                f"{part.dram_bytes} bytes of DRAM tier): {e}"
            ) from None
    return out


def open_stores(
    configs: Mapping[str, StoreConfig], pages: Mapping[str, HostPages], kv_shard_ranks: tuple[int, ...] = ()
) -> dict[str, PoolStore]:
    """Opens every pool's store (the KV pool's pages in head shards of ``kv_shard_ranks``, if
    any); if one fails, closes those already open and raises, naming it."""
    opened: dict[str, PoolStore] = {}
    try:
        for name, config in configs.items():
            try:
                shards = kv_shard_ranks if name == KV else ()
                opened[name] = PoolStore(name, pages[name], Store(config), shards)
            except KvtierError as e:
                e.add_note(f"kvtier: opening the store of SGLang's {name!r} host pool")
                raise
    except BaseException:
        close_stores(opened.values())
        raise
    return opened


def close_stores(pools: Iterable[PoolStore]) -> None:
    """Makes each store's SSD pages durable (``flush``); the stores close when dropped."""
    for pool in pools:
        pool.store.flush()
