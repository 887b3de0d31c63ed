"""kvtier under SGLang's own HiCache controller threads (`HiCacheController`: hit query, prefetch
IO, sync, backup), on CPU: what SGLang counts as prefetched holds exactly the stored bytes, a
page that fails ends SGLang's prefix there, and backups, prefetches and terminated prefetches
running at once never leave wrong bytes in a page SGLang keeps, nor write a page SGLang freed.
docs/sglang.md "Page lifetimes and concurrency"."""

from __future__ import annotations

import json
import subprocess
import sys
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


def prefetch_each_whole(cc: Any, prompts: dict[str, list[int]], expected: dict[str, bytes]) -> None:
    """Prefetches each prompt in turn: every page of it comes back with its stored bytes."""
    for rid, tokens in prompts.items():
        p = start_prefetch(cc, rid, tokens)
        drain_acks(cc, {rid: p}, until_done=True)
        assert p.completed_tokens == len(tokens), (rid, p.acks)
        assert_kept_pages(cc, p, tokens, expected)
        assert p.host_indices is not None
        host(cc).free(p.host_indices)


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
        prefetch_each_whole(cc, prompts, expected)
        unseen = start_prefetch(cc, "miss", prompt(4, pool.page_size, seed=999))
        assert unseen.done and unseen.host_indices is None  # a miss allocates nothing
    finally:
        cc.detach_storage_backend()


@CONTROLLERS
@pytest.mark.parametrize("interface_v1", [True, False], ids=["v1", "v0"])
def test_head_shards_of_tp_lcm_size_back_up_and_prefetch_exact_pages(
    interface_v1: bool, hybrid: bool, tmp_path: Path, redis: LocalRedis
) -> None:
    # SGLang's tp_lcm_size with a page_head pool: every page stored as two head shards.
    pool = host_pool(layout="page_head", ratio=8.0)
    extra = extra_for("redis", tmp_path, redis)
    split = {"tp_lcm_size": 2, "should_split_heads": True}
    cc = controller(pool, extra, hybrid=hybrid, interface_v1=interface_v1, model="cc-split", **split)
    try:
        backend = cc.storage_backend
        assert backend.store.config.model_id == "sglang|cc-split|tp=lcm2|layout=mha-page_head-bfloat16"
        prompts = {f"r{i}": prompt(3, pool.page_size, seed=200 + i) for i in range(3)}
        expected: dict[str, bytes] = {}
        store_prompts(cc, prompts, expected, seed=20)
        assert backend.get_stats().kvtier["put_blocks"] == 2 * len(expected)
        prefetch_each_whole(cc, prompts, expected)
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


RANK = """
import json, sys
sys.path.insert(0, sys.argv[1])
rank, rendezvous = int(sys.argv[2]), sys.argv[3]
import torch.distributed as dist
dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
from controller_harness import backup, controller, drain_acks, host, page_hashes, start_prefetch
from hicache_helpers import fill, host_pool, page_bytes
from test_sglang_controller import prompt
pool = host_pool(ratio=8.0)
cc = controller(pool, {"dram": {"capacity_bytes": "4MiB"}}, tp_group=dist.group.WORLD,
                tp_rank=rank, tp_size=2, model="tp2")
out = {}
# A: rank 0 stored all 6 pages, rank 1 only the first 3. B: both stored 6; rank 1's page 4 is corrupt.
for name, stored, corrupt in (("A", 6 if rank == 0 else 3, None), ("B", 6, 4 if rank == 1 else None)):
    tokens = prompt(6, pool.page_size, seed=ord(name))
    keys = page_hashes(tokens, pool.page_size)
    slots = fill(pool, 6, seed=10 * ord(name) + rank)  # each rank's shard of the KV differs
    expected = [page_bytes(pool, slots, j) for j in range(6)]
    backup(cc, slots[: stored * pool.page_size], tokens[: stored * pool.page_size])
    if corrupt is not None:
        made = cc.storage_backend
        assert made.store._corrupt_for_test(made.keys(keys)[corrupt], 32)
    p = start_prefetch(cc, name, tokens)
    drain_acks(cc, {name: p}, until_done=True)
    kept = p.completed_tokens // pool.page_size
    right = all(page_bytes(pool, p.host_indices, j) == expected[j] for j in range(kept))
    out[name] = [p.operation.storage_hit_count, p.completed_tokens, right]
cc.detach_storage_backend()
print("RESULT", json.dumps(out))
"""


def test_tp_ranks_agree_when_one_rank_misses_or_fails_a_page(tmp_path: Path) -> None:
    # Two TP ranks (processes, gloo), each with its own kvtier store and shard: SGLang's MIN
    # all-reduces of the hit count and of every progress ack make both keep the same prefix,
    # so no rank uses a page another rank has not loaded (mixed KV across the TP shards).
    here = str(Path(__file__).resolve().parent)
    rendezvous = tmp_path / "rendezvous"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, here, str(rank), str(rendezvous)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-4000:]
        results.append(json.loads(stdout.split("RESULT", 1)[1]))
    page = 4  # tokens per page (hicache_helpers.PAGE)
    for rank_result in results:
        assert rank_result["A"] == [3 * page, 3 * page, True]  # rank 1 has 3: both fetch 3
        assert rank_result["B"] == [6 * page, 4 * page, True]  # rank 1 fails page 4: both keep 4
