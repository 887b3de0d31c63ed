"""kvtier under SGLang's own HiCache controller threads (`HiCacheController`: hit query, prefetch
IO, sync, backup), on CPU: what SGLang counts as prefetched holds exactly the stored bytes, a
page that fails ends SGLang's prefix there, and backups, prefetches and terminated prefetches
running at once never leave wrong bytes in a page SGLang keeps, nor write a page SGLang freed.
docs/sglang.md "Page lifetimes and concurrency"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from controller_harness import (
    Prefetch,
    backup,
    controller,
    drain_acks,
    host,
    page_hashes,
    start_prefetch,
    terminate,
)
from hicache_helpers import fill, host_pool, page_bytes
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

from kvtier.testing.redis import LocalRedis

DRAM = {"dram": {"capacity_bytes": "4MiB"}}
POISON = 0x5A
#: SGLang's controller for plain models (`HybridCacheController`) and its base class.
CONTROLLERS = pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "base"])


def extra_for(tier: str, tmp_path: Path, redis: LocalRedis) -> dict[str, Any]:
    if tier == "ssd":  # DRAM holds 16 pages (a 4 KiB extent each): most loads come from SSD
        return {
            "dram": {"capacity_bytes": "64KiB"},
            "ssd": {"directory": str(tmp_path), "capacity_bytes": "4MiB", "probe_bytes": 0},
        }
    if tier == "redis":
        return {**DRAM, "remote": {"urls": [redis.url], "connect_timeout_s": 0.5, "io_timeout_s": 5.0}}
    return DRAM


def prompt(n_pages: int, page_size: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32000, (n_pages * page_size,), generator=gen).tolist()


def store_prompts(cc: Any, prompts: dict[str, list[int]], expected: dict[str, bytes], seed: int) -> None:
    """Fills host pages for each prompt, backs them up through SGLang's backup thread and frees
    them after the ack, as the tree cache does once the host node is unlocked and evicted."""
    pool = host(cc)
    for i, (rid, tokens) in enumerate(prompts.items()):
        n = len(tokens) // pool.page_size
        slots = fill(pool, n, seed=seed + i)
        for j, key in enumerate(page_hashes(tokens, pool.page_size)):
            expected[key] = page_bytes(pool, slots, j)
        assert backup(cc, slots, tokens) == len(tokens), rid
        pool.free(slots)


def assert_kept_pages(cc: Any, p: Prefetch, tokens: list[int], expected: dict[str, bytes]) -> None:
    pool = host(cc)
    keys = page_hashes(tokens, pool.page_size)
    assert p.host_indices is not None
    for j in range(p.completed_tokens // pool.page_size):
        assert page_bytes(pool, p.host_indices, j) == expected[keys[j]], (p.operation.request_id, j)


@CONTROLLERS
@pytest.mark.parametrize("interface_v1", [True, False], ids=["v1", "v0"])
@pytest.mark.parametrize("tier", ["dram", "ssd", "redis"])
def test_sglang_threads_back_up_and_prefetch_exact_pages(
    tier: str, interface_v1: bool, hybrid: bool, tmp_path: Path, redis: LocalRedis
) -> None:
    pool = host_pool(ratio=8.0)
    extra = extra_for(tier, tmp_path, redis)
    cc = controller(pool, extra, hybrid=hybrid, interface_v1=interface_v1, model=f"cc-{tier}")
    try:
        prompts = {f"r{i}": prompt(6, pool.page_size, seed=100 + i) for i in range(6)}
        expected: dict[str, bytes] = {}
        store_prompts(cc, prompts, expected, seed=10)
        for rid, tokens in prompts.items():
            p = start_prefetch(cc, rid, tokens)
            drain_acks(cc, {rid: p}, until_done=True)
            assert p.completed_tokens == len(tokens), (rid, p.acks)
            assert_kept_pages(cc, p, tokens, expected)
            assert p.host_indices is not None
            pool.free(p.host_indices)
        unseen = start_prefetch(cc, "miss", prompt(4, pool.page_size, seed=999))
        assert unseen.done and unseen.host_indices is None  # a miss allocates nothing
    finally:
        cc.detach_storage_backend()


@pytest.mark.parametrize("tier", ["dram", "ssd", "redis"])
def test_clear_means_no_page_stored_before_it_loads_again(
    tier: str, tmp_path: Path, redis: LocalRedis
) -> None:
    # SGLang's `/clear_hicache_storage_backend` (and a PD role switch) call the backend's clear()
    # and report success; after a weight update that is how L3 drops the old weights' KV. The
    # same prompt stored again then holds other bytes: only those may load. Before clear() was
    # implemented it did nothing: the prefetch still hit, and the new backup was skipped as
    # already present, so SGLang loaded the old bytes.
    pool = host_pool(ratio=8.0)
    cc = controller(pool, extra_for(tier, tmp_path, redis), model=f"clear-{tier}")
    try:
        tokens = prompt(4, pool.page_size, seed=60)
        before: dict[str, bytes] = {}
        store_prompts(cc, {"old": tokens}, before, seed=61)
        assert isinstance(cc, HybridCacheController)
        assert cc.clear_storage_backend()  # SGLang's own call, as on its scheduler thread
        p = start_prefetch(cc, "after-clear", tokens)
        assert p.done and p.operation.storage_hit_count == 0
        after: dict[str, bytes] = {}
        store_prompts(cc, {"new": tokens}, after, seed=62)
        assert after != before
        p = start_prefetch(cc, "new", tokens)
        drain_acks(cc, {"new": p}, until_done=True)
        assert p.completed_tokens == len(tokens)
        assert_kept_pages(cc, p, tokens, after)
    finally:
        cc.detach_storage_backend()


@CONTROLLERS
@pytest.mark.parametrize("interface_v1", [True, False], ids=["v1", "v0"])
def test_a_page_that_fails_ends_sglangs_prefix_there(interface_v1: bool, hybrid: bool) -> None:
    # kvtier answers per page (pages after a corrupt one still load); SGLang's counters stop at
    # the first page that is not there (`_page_get_zero_copy`, `_generic_page_get`).
    pool = host_pool(ratio=8.0)
    cc = controller(pool, DRAM, hybrid=hybrid, interface_v1=interface_v1, model="cc-corrupt")
    try:
        tokens = prompt(8, pool.page_size, seed=7)
        expected: dict[str, bytes] = {}
        store_prompts(cc, {"c": tokens}, expected, seed=20)
        made = cc.storage_backend
        assert made.store._corrupt_for_test(made.keys(page_hashes(tokens, pool.page_size))[3], 64)
        p = start_prefetch(cc, "c", tokens)
        assert p.operation.storage_hit_count == len(tokens)  # a lookup reads no payload
        drain_acks(cc, {"c": p}, until_done=True)
        assert p.completed_tokens == 3 * pool.page_size
        assert_kept_pages(cc, p, tokens, expected)
    finally:
        cc.detach_storage_backend()


@CONTROLLERS
@pytest.mark.parametrize("interface_v1", [True, False], ids=["v1", "v0"])
@pytest.mark.parametrize("tier", ["dram", "ssd", "redis"])
def test_backups_prefetches_and_terminations_at_once_keep_every_page_right(
    tier: str, interface_v1: bool, hybrid: bool, tmp_path: Path, redis: LocalRedis
) -> None:
    # The backup thread stores new prompts while the prefetch threads load stored ones; every
    # third prefetch is terminated right after it was queued (a stop policy firing, or an abort),
    # while the IO thread may be inside kvtier for its pages. SGLang keeps what was acked then,
    # and releases the rest at the last ack: those pages are poisoned at that moment and must
    # still hold the poison at the end (no backend write lands after SGLang released a page).
    pool = host_pool(ratio=8.0)
    extra = extra_for(tier, tmp_path, redis)
    cc = controller(pool, extra, hybrid=hybrid, interface_v1=interface_v1, model=f"mix-{tier}")
    try:
        stored = {f"s{i}": prompt(4, pool.page_size, seed=200 + i) for i in range(6)}
        expected: dict[str, bytes] = {}
        store_prompts(cc, stored, expected, seed=30)
        released: list[torch.Tensor] = []
        for round_ in range(3):
            fresh = {
                f"n{round_}-{i}": prompt(4, pool.page_size, seed=300 + 10 * round_ + i) for i in range(3)
            }
            backups = []
            for i, tokens in enumerate(fresh.values()):
                slots = fill(pool, len(tokens) // pool.page_size, seed=400 + 10 * round_ + i)
                keys = page_hashes(tokens, pool.page_size)
                expected.update((key, page_bytes(pool, slots, j)) for j, key in enumerate(keys))
                backups.append((cc.write_storage(slots, tokens, hash_value=keys), slots))
            prefetches: dict[str, Prefetch] = {}
            for i, (rid, tokens) in enumerate(stored.items()):
                name = f"{rid}@{round_}"
                p = prefetches[name] = start_prefetch(cc, name, tokens)
                if i % 3 == 0 and not p.done:
                    terminate(cc, p)
                drain_acks(cc, prefetches, until_done=False, poison=POISON)
            drain_acks(cc, prefetches, until_done=True, poison=POISON)
            for name, p in prefetches.items():
                tokens = stored[name.split("@")[0]]
                if p.terminated_at is None:
                    assert p.completed_tokens == len(tokens), (name, p.acks)
                assert_kept_pages(cc, p, tokens, expected)
                assert p.host_indices is not None and p.released is not None
                released.append(p.released)
                pool.free(p.host_indices[: p.completed_tokens])
            for (op_id, slots), tokens in zip(backups, fresh.values(), strict=True):
                ack = cc.ack_backup_queue.get(timeout=60)
                assert ack.id == op_id and ack.completed_tokens == len(tokens)
                pool.free(slots)
            stored.update(fresh)
        assert sum(r.numel() for r in released) > 0  # some terminations left pages to release
        for pages in released:
            for j in range(pages.numel() // pool.page_size):
                assert set(page_bytes(pool, pages, j)) == {POISON}
    finally:
        cc.detach_storage_backend()
