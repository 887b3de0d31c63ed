"""SGLang's own HiCache controllers driving the kvtier backend on CPU, with their prefetch,
prefetch-IO, sync and backup threads: `HybridCacheController` over a `HostPoolGroup` with the KV
pool as its one entry (what SGLang 0.5.23 builds for a plain MHA/MLA model,
`build_kv_only_stack`), or its base `HiCacheController` over the host pool. The scheduler's side
is played here the way SGLang's tree cache plays it (`mem_cache/unified_radix_cache.py`).

Only two seams are set by hand: the controller's device pool (a stand-in with the three attributes
the controller reads; no device copy is made here) and `_generate_storage_config`, which SGLang
derives from its published parallel context; `HiCacheStorageConfig` comes from the test helper
instead. A single process has no TP group, so SGLang creates no sync groups and its rank
all-reduces are no-ops, as they are for TP=1.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from queue import Empty
from typing import Any

import torch
from hicache_helpers import LAYERS, storage_config
from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import get_parallel

WAIT_S = 60.0  # a queue that stays empty this long means a thread hung


class _DevicePool:
    device = torch.device("cpu")
    layer_num = LAYERS

    def register_layer_transfer_counter(self, counter: Any) -> None:
        pass


class _Allocator:
    def get_kvcache(self) -> _DevicePool:
        return _DevicePool()


@dataclass(frozen=True)
class _Handle:  # the tree cache's `CacheRequestHandle`: the hybrid controller reads its rid
    rid: str


def controller(
    pool: Any,
    extra: dict[str, Any],
    *,
    hybrid: bool = True,
    interface_v1: bool = True,
    tp_group: Any = None,
    extras: dict[PoolName, Any] | None = None,
    **config: Any,
) -> HiCacheController:
    """SGLang's controller over ``pool``, with kvtier attached as SGLang attaches a backend. With
    ``tp_group`` (a gloo group of the ranks), SGLang's rank all-reduces run over it. ``extras``:
    a hybrid model's other host pools (SWA, Mamba), entries of the hybrid controller's group."""
    entries = [PoolEntry(PoolName.KV, pool, _DevicePool(), lambda layer: layer, is_primary_index_anchor=True)]
    entries += [PoolEntry(name, p, _DevicePool(), lambda layer: layer) for name, p in (extras or {}).items()]
    assert hybrid or not extras, "only the hybrid controller has other host pools"
    group = HostPoolGroup(entries)
    if hybrid:
        cc: HiCacheController = HybridCacheController(
            _Allocator(), group, pool.page_size, tp_group, threading.Event(), transfer_layer_id_max=LAYERS
        )
    else:
        cc = HiCacheController(_Allocator(), pool, pool.page_size, tp_group, threading.Event())
    is_mla = isinstance(pool, MLATokenToKVPoolHost)
    cfg = storage_config(
        {**extra, "interface_v1": int(interface_v1)},
        is_mla=is_mla,
        page_first=pool.layout != "layer_first",
        **config,
    )
    cc._generate_storage_config = lambda *args, **kwargs: cfg
    with get_parallel().override(attn_dcp_size=1):
        attach: dict[str, Any] = {"host_pools": group.entries} if hybrid else {}
        cc.attach_storage_backend(
            "dynamic",
            prefetch_threshold=pool.page_size,
            storage_backend_extra_config=dict(cfg.extra_config),
            **attach,
        )
    return cc


def page_hashes(tokens: list[int], page_size: int) -> list[str]:
    """SGLang's page keys of a prompt (its sha256 chain)."""
    return list(get_storage_hash_str(tokens, None, page_size=page_size))


@dataclass
class Prefetch:
    """One prefetch as the tree cache tracks it (`ongoing_prefetch`)."""

    operation: PrefetchOperation
    host_indices: torch.Tensor | None = None
    completed_tokens: int = 0
    done: bool = False
    terminated_at: int | None = None  # completed_tokens when the scheduler terminated it
    acks: list[int] = field(default_factory=list)
    released: torch.Tensor | None = None  # the pages SGLang released at the last ack


def backup(cc: HiCacheController, slots: torch.Tensor, tokens: list[int]) -> int:
    """`write_backup_storage`: one backup operation; returns tokens SGLang counts as stored, once
    its ack arrives (the host pages stay locked until then, as `ongoing_backup` keeps them)."""
    op_id = cc.write_storage(slots, tokens, hash_value=page_hashes(tokens, cc.page_size))
    ack = cc.ack_backup_queue.get(timeout=WAIT_S)
    assert ack.id == op_id
    return int(ack.completed_tokens)


def start_prefetch(cc: HiCacheController, rid: str, tokens: list[int]) -> Prefetch:
    """`prefetch` then, once the hit query answered, the tree cache's `_try_alloc_storage_hit`:
    host pages for the hit, handed to the prefetch-IO thread. No hit: nothing is queued."""
    handle = _Handle(rid) if isinstance(cc, HybridCacheController) else rid
    operation = cc.prefetch(handle, tokens, None)
    hit = cc.prefetch_hit_queue.get(timeout=WAIT_S)
    assert hit is operation
    p = Prefetch(operation)
    if operation.storage_hit_count == 0:
        p.done = True
        return p
    host_indices = cc.mem_pool_host.alloc(operation.storage_hit_count)
    assert host_indices is not None, "the test's host pool is too small"
    operation.host_indices = p.host_indices = host_indices
    cc.prefetch_buffer.put(operation)
    return p


def drain_acks(
    cc: HiCacheController, prefetches: dict[str, Prefetch], *, until_done: bool, poison: int | None = None
) -> None:
    """`_drain_ack_prefetch`: progress acks raise `completed_tokens`; the last ack of an operation
    releases its pages past what SGLang kept (`ack_releases_incomplete_host_indices`). With
    ``poison``, those pages are overwritten with that byte at once and kept out of the pool (so a
    backend write landing after the release would show), instead of going back to the pool."""
    while True:
        pending = [p for p in prefetches.values() if not p.done]
        if not pending or (not until_done and cc.ack_prefetch_queue.empty()):
            return
        try:
            ack = cc.ack_prefetch_queue.get(timeout=WAIT_S)
        except Empty:
            raise AssertionError(f"no prefetch ack in {WAIT_S} s: {pending}") from None
        p = prefetches[ack.rid]
        if ack.completed_tokens is not None:
            p.acks.append(int(ack.completed_tokens))
            if p.terminated_at is None:  # a terminated prefetch was already handled
                assert p.completed_tokens <= ack.completed_tokens
                p.completed_tokens = int(ack.completed_tokens)
        if ack.completed_req:
            p.done = True
            assert p.host_indices is not None
            kept = p.completed_tokens if p.terminated_at is None else p.terminated_at
            p.released = p.host_indices[kept:]
            if poison is None:
                cc.mem_pool_host.free(p.released)
            else:
                fill_pages(host(cc), p.released, poison)


def host(cc: HiCacheController) -> Any:
    """The host KV pool whose pages the backend reads and writes (the hybrid group's anchor)."""
    return cc.storage_host_pool


def fill_pages(pool: Any, slots: torch.Tensor, byte: int) -> None:
    """Every byte of the pages at ``slots`` set to ``byte`` (SGLang's flat page writer)."""
    for j in range(slots.numel() // pool.page_size):
        start = int(slots[j * pool.page_size])
        page = pool.get_data_page(start, flat=True)
        pool.set_from_flat_data_page(start, torch.full_like(page.view(torch.uint8), byte).view(pool.dtype))


def terminate(cc: HiCacheController, p: Prefetch) -> int:
    """`check_prefetch_progress` with a stop policy that fired (or `release_aborted_request`): the
    operation is marked terminated and its acked pages are what SGLang inserts (or releases) now,
    while the IO thread may still be inside a backend call for the pages after them."""
    completed, _ = cc.terminate_prefetch(p.operation)
    p.terminated_at = int(completed)
    p.completed_tokens = int(completed)
    return p.terminated_at
