"""A hybrid model's backups and prefetches through SGLang's own `HybridCacheController` threads on
CPU, with the tree cache's side played as SGLang 0.5.23 plays it (paths under `sglang/srt/mem_cache/`):

- a backup is one radix node: its KV pages, plus, per component, what the component's
  `build_hicache_transfers(BACKUP_STORAGE)` hands the controller (`unified_cache/components/`
  `mamba.py` 917-928: the node's one state slot under the node's last page hash; `swa.py`
  1207-1221: the node's trailing SWA pages under their page hashes), `unified_radix_cache.py`
  `write_backup_storage` 1990-2020;
- a prefetch carries the components' PREFETCH placeholders (`mamba.py` 930-941: one key;
  `swa.py` 1223-1235: one key per window page), and once the hit query answered, the KV staging
  plus each component's staging of ``min(window, hit pages)`` pages (`unified_radix_cache.py`
  `_alloc_prefetch_aux_staging` 2914-2948); SGLang's IO thread re-keys the window to the hit's
  end (`_sync_trailing_keys`) and loads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from controller_harness import WAIT_S, _Handle
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

TRAILING = PoolHitPolicy.TRAILING_PAGES


def pool_of(cc: Any, name: PoolName) -> Any:
    return cc.mem_pool_host.entry_map[name].host_pool


@dataclass(frozen=True)
class Node:
    """One radix node's host copy: its KV slots, its tokens' page hashes (chained from the
    prompt's start), its Mamba state slot and its trailing SWA slots (either may be None)."""

    kv: torch.Tensor
    hashes: list[str]
    mamba: torch.Tensor | None = None
    swa: torch.Tensor | None = None


def backup_node(cc: Any, node: Node, tokens: list[int]) -> Any:
    """`write_backup_storage` of one node; returns SGLang's ack (the operation) once the backup
    thread finished it."""
    extra = []
    if node.mamba is not None:
        extra.append(
            PoolTransfer(
                name=PoolName.MAMBA, host_indices=node.mamba, keys=[node.hashes[-1]], hit_policy=TRAILING
            )
        )
    if node.swa is not None:
        pages = node.swa.numel() // cc.page_size
        extra.append(
            PoolTransfer(
                name=PoolName.SWA, host_indices=node.swa, keys=node.hashes[-pages:], hit_policy=TRAILING
            )
        )
    op_id = cc.write_storage(node.kv, tokens, hash_value=node.hashes, extra_pools=extra or None)
    ack = cc.ack_backup_queue.get(timeout=WAIT_S)
    assert ack.id == op_id
    return ack


@dataclass
class HybridPrefetch:
    """One prefetch of KV plus the components' pools, as the tree cache tracks it."""

    operation: Any
    transfers: dict[PoolName, PoolTransfer]
    host_indices: torch.Tensor | None = None
    completed_tokens: int = 0
    pool_hits: dict[str, int] = field(default_factory=dict)


def prefetch(cc: Any, rid: str, tokens: list[int], *, mamba: bool, swa_window: int = 0) -> HybridPrefetch:
    """A prefetch with the components' placeholders; on a hit, the staging SGLang allocates, then
    every ack until the last. Returns what SGLang counts as loaded (KV tokens, pages per pool)."""
    transfers = {}
    if mamba:
        transfers[PoolName.MAMBA] = PoolTransfer(
            name=PoolName.MAMBA, keys=["__placeholder__"], hit_policy=TRAILING
        )
    if swa_window:
        transfers[PoolName.SWA] = PoolTransfer(
            name=PoolName.SWA, keys=["__placeholder__"] * swa_window, hit_policy=TRAILING
        )
    operation = cc.prefetch(_Handle(rid), tokens, None, None, extra_pools=list(transfers.values()) or None)
    assert cc.prefetch_hit_queue.get(timeout=WAIT_S) is operation
    p = HybridPrefetch(operation, transfers)
    hit_tokens = operation.storage_hit_count
    if hit_tokens == 0:
        return p
    p.host_indices = cc.mem_pool_host.alloc(hit_tokens)
    assert p.host_indices is not None, "the test's KV host pool is too small"
    for name, transfer in transfers.items():
        pool = pool_of(cc, name)
        transfer.host_indices = pool.alloc(
            min(len(transfer.keys), hit_tokens // cc.page_size) * pool.page_size
        )
        assert transfer.host_indices is not None, f"the test's {name} host pool is too small"
    operation.host_indices = p.host_indices
    cc.prefetch_buffer.put(operation)
    while True:
        ack = cc.ack_prefetch_queue.get(timeout=WAIT_S)
        if ack.completed_tokens is not None:
            p.completed_tokens = int(ack.completed_tokens)
        if ack.pool_hits is not None:
            p.pool_hits = {str(getattr(k, "value", k)): int(v) for k, v in ack.pool_hits.items() if v}
        if ack.completed_req:
            return p


def release(cc: Any, p: HybridPrefetch) -> None:
    """Frees the prefetch's host pages (the test has read them)."""
    if p.host_indices is not None:
        cc.mem_pool_host.free(p.host_indices)
    for name, transfer in p.transfers.items():
        if transfer.host_indices is not None:
            pool_of(cc, name).free(transfer.host_indices)
