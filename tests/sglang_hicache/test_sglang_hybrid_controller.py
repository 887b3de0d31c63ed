"""A hybrid model's pools (KV, SWA KV, Mamba state) through SGLang's own `HybridCacheController`
threads on CPU (hit query `batch_exists_v2`, prefetch IO `batch_get_v1` + `batch_get_v2`, backup
`batch_set_v2` + `batch_set_v1`): what SGLang counts as restored holds exactly the stored bytes of
every pool, a prefix restores the state taken at its own end, a page of any pool that fails ends
the hit, and a fresh backend finds the pages on SSD and Redis. docs/sglang.md "Hybrid models"."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from controller_harness import controller, page_hashes
from hicache_helpers import fill, host_pool, mamba_pool, page_bytes
from hybrid_harness import HybridPrefetch, Node, backup_node, pool_of, prefetch, release
from sglang.srt.mem_cache.hicache_storage import PoolName
from test_sglang_controller import prompt

from kvtier.testing.redis import LocalRedis

KV, SWA, MAMBA = PoolName.KV, PoolName.SWA, PoolName.MAMBA
WINDOW = 2  # SWA pages a prefix needs: the window ending at its last page
Expected = dict[tuple[str, str], bytes]  # (pool, page hash) -> page bytes


DRAM = {"dram": {"capacity_bytes": "1MiB"}}


def extra_for(tier: str, tmp_path: Path, redis: LocalRedis) -> dict[str, Any]:
    if tier == "ssd":  # written through, so a fresh backend reads every pool from SSD
        ssd = {"directory": str(tmp_path), "capacity_bytes": "4MiB", "probe_bytes": 0, "write_through": True}
        return {**DRAM, "ssd": ssd}
    if tier == "redis":
        return {**DRAM, "remote": {"urls": [redis.url], "connect_timeout_s": 0.5, "io_timeout_s": 5.0}}
    return DRAM


def hybrid_controller(extra: dict[str, Any], model: str, **config: Any) -> Any:
    pools = {SWA: host_pool(ratio=8.0, layers=1), MAMBA: mamba_pool()}
    return controller(host_pool(ratio=8.0), extra, extras=pools, model=model, **config)


def store_prompt(cc: Any, tokens: list[int], seed: int, expected: Expected) -> None:
    """Backs up a 6-page prompt as two 3-page nodes, each with its state (taken at its end) and
    its trailing SWA window, as SGLang's tree cache does; records every page's bytes."""
    page = cc.page_size
    hashes = page_hashes(tokens, page)
    kv, swa, mamba = cc.mem_pool_host.anchor_entry.host_pool, pool_of(cc, SWA), pool_of(cc, MAMBA)
    kv_slots, swa_slots, states = fill(kv, 6, seed), fill(swa, 2 * WINDOW, seed + 1), fill(mamba, 2, seed + 2)
    for j, h in enumerate(hashes):
        expected["kv", h] = page_bytes(kv, kv_slots, j)
    for node in range(2):
        end = 3 * node + 3
        expected["mamba", hashes[end - 1]] = page_bytes(mamba, states, node)
        for w in range(WINDOW):
            expected["swa", hashes[end - WINDOW + w]] = page_bytes(swa, swa_slots, node * WINDOW + w)
        n = Node(
            kv_slots[3 * node * page : end * page],
            hashes[3 * node : end],
            states[node : node + 1],
            swa_slots[node * WINDOW * page : (node + 1) * WINDOW * page],
        )
        ack = backup_node(cc, n, tokens[3 * node * page : end * page])
        assert ack.completed_tokens == 3 * page
        assert dict(ack.pool_storage_result.extra_pool_hit_pages) == {MAMBA: 1, SWA: WINDOW}
    kv.free(kv_slots)
    swa.free(swa_slots)
    mamba.free(states)


def assert_restored(cc: Any, p: HybridPrefetch, tokens: list[int], expected: Expected) -> None:
    """Every page SGLang counts as restored holds the stored bytes: the KV pages, the SWA window
    ending at the restored prefix's last page, and the state taken there."""
    page = cc.page_size
    n = p.completed_tokens // page
    hashes = page_hashes(tokens, page)[:n]
    assert p.host_indices is not None
    kv = cc.mem_pool_host.anchor_entry.host_pool
    assert [page_bytes(kv, p.host_indices, j) for j in range(n)] == [expected["kv", h] for h in hashes]
    assert p.pool_hits == {"mamba": 1, "swa": WINDOW}
    state = p.transfers[MAMBA]
    assert state.keys == hashes[-1:]
    assert page_bytes(pool_of(cc, MAMBA), state.host_indices, 0) == expected["mamba", hashes[-1]]
    window = p.transfers[SWA]
    assert window.keys == hashes[-WINDOW:]
    got = [page_bytes(pool_of(cc, SWA), window.host_indices, w) for w in range(WINDOW)]
    assert got == [expected["swa", h] for h in hashes[-WINDOW:]]


@pytest.mark.parametrize("tier", ["dram", "ssd", "redis"])
def test_sglang_threads_restore_every_pool_exactly(tier: str, tmp_path: Path, redis: LocalRedis) -> None:
    extra = extra_for(tier, tmp_path, redis)
    writer = hybrid_controller(extra, f"hy-{tier}")
    expected: Expected = {}
    prompts = {f"r{i}": prompt(6, writer.page_size, seed=500 + i) for i in range(3)}
    try:
        for i, tokens in enumerate(prompts.values()):
            store_prompt(writer, tokens, 50 + 10 * i, expected)
    finally:
        if tier != "dram":
            writer.detach_storage_backend()
    # DRAM: the same backend; SSD and Redis: a fresh backend (its DRAM empty) over fresh pools.
    cc = writer if tier == "dram" else hybrid_controller(extra, f"hy-{tier}")
    try:
        for rid, tokens in prompts.items():
            p = prefetch(cc, rid, tokens, mamba=True, swa_window=WINDOW)
            assert p.operation.storage_hit_count == len(tokens) and p.completed_tokens == len(tokens), rid
            assert_restored(cc, p, tokens, expected)
            release(cc, p)
        stats = cc.storage_backend.get_stats()
        if tier != "dram":  # every page came from the lower tier
            assert stats.kvtier_pools["mamba"]["loaded_blocks"] == 3
            assert stats.kvtier_pools["swa"]["loaded_blocks"] == 3 * WINDOW
            assert stats.kvtier_pools["mamba"]["put_blocks"] == stats.kvtier_pools["swa"]["put_blocks"] == 0
        miss = prefetch(cc, "miss", prompt(6, cc.page_size, seed=999), mamba=True, swa_window=WINDOW)
        assert miss.operation.storage_hit_count == 0 and miss.host_indices is None
    finally:
        cc.detach_storage_backend()


def test_a_prefix_restores_the_state_taken_at_its_own_end() -> None:
    # The state of a prefix is one snapshot, taken at that prefix's last page (SGLang stores it
    # under that page's hash). A prompt sharing 5 of the 6 stored pages has no state at page 5:
    # the longest prefix it can restore is 3 pages, with the state and SWA window taken there,
    # never the 6-page prefix's state (the KV of pages 4 and 5 is there, but no state for them).
    cc = hybrid_controller(DRAM, "hy-prefix")
    try:
        expected: Expected = {}
        tokens = prompt(6, cc.page_size, seed=600)
        store_prompt(cc, tokens, 60, expected)
        shorter = tokens[: 5 * cc.page_size]
        p = prefetch(cc, "five", shorter, mamba=True, swa_window=WINDOW)
        assert p.operation.storage_hit_count == p.completed_tokens == 3 * cc.page_size
        assert_restored(cc, p, shorter, expected)
        release(cc, p)
        longer = tokens + prompt(2, cc.page_size, seed=601)  # two pages more: restores all six
        p = prefetch(cc, "eight", longer, mamba=True, swa_window=WINDOW)
        assert p.operation.storage_hit_count == p.completed_tokens == 6 * cc.page_size
        assert_restored(cc, p, longer, expected)
        release(cc, p)
    finally:
        cc.detach_storage_backend()


@pytest.mark.parametrize("pool", ["mamba", "swa"])
def test_a_corrupt_page_of_any_pool_ends_the_hit(pool: str) -> None:
    # A hit query reads no payload, so the 6-page prefix is found; its load then fails that
    # pool's page (checksum), and SGLang, told fewer pages than the window, discards the whole
    # hybrid hit (`_check_hybrid_prefetch_result`). The corrupt copy is dropped: the next query
    # stops at the 3-page prefix, restored exactly.
    cc = hybrid_controller(DRAM, "hy-corrupt")
    try:
        expected: Expected = {}
        tokens = prompt(6, cc.page_size, seed=700)
        store_prompt(cc, tokens, 70, expected)
        hashes = page_hashes(tokens, cc.page_size)
        made = cc.storage_backend.pools[pool]
        assert made.store._corrupt_for_test(made.keys([hashes[5]])[0], 40)
        p = prefetch(cc, "bad", tokens, mamba=True, swa_window=WINDOW)
        assert p.operation.storage_hit_count == 6 * cc.page_size
        assert p.pool_hits.get(pool, 0) < (1 if pool == "mamba" else WINDOW)
        assert cc.storage_backend.get_stats().kvtier_pools[pool]["checksum_failures"] == 1
        release(cc, p)
        p = prefetch(cc, "again", tokens, mamba=True, swa_window=WINDOW)
        assert p.operation.storage_hit_count == p.completed_tokens == 3 * cc.page_size
        assert_restored(cc, p, tokens, expected)
        release(cc, p)
    finally:
        cc.detach_storage_backend()


@pytest.mark.parametrize("tier", ["dram", "redis"])
def test_clear_drops_every_pools_pages(tier: str, tmp_path: Path, redis: LocalRedis) -> None:
    cc = hybrid_controller(extra_for(tier, tmp_path, redis), f"hy-clear-{tier}")
    try:
        tokens = prompt(6, cc.page_size, seed=800)
        store_prompt(cc, tokens, 80, {})
        assert cc.clear_storage_backend()  # SGLang's own call (admin API, PD role switch)
        hashes = page_hashes(tokens, cc.page_size)
        for name, made in cc.storage_backend.pools.items():
            assert set(made.store.lookup_each(made.keys(hashes))) == {None}, name
        p = prefetch(cc, "after", tokens, mamba=True, swa_window=WINDOW)
        assert p.operation.storage_hit_count == 0
    finally:
        cc.detach_storage_backend()


RANK = """
import json, sys
sys.path.insert(0, sys.argv[1])
rank, rendezvous = int(sys.argv[2]), sys.argv[3]
import torch.distributed as dist
dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
from controller_harness import page_hashes
from hybrid_harness import Node, backup_node, pool_of, prefetch
from hicache_helpers import fill, page_bytes
from sglang.srt.mem_cache.hicache_storage import PoolName
from test_sglang_controller import prompt
from test_sglang_hybrid_controller import hybrid_controller
cc = hybrid_controller({"dram": {"capacity_bytes": "1MiB"}}, "hy-tp2", tp_group=dist.group.WORLD,
                       tp_rank=rank, tp_size=2)
page = cc.page_size
tokens = prompt(6, page, seed=900)
hashes = page_hashes(tokens, page)
kv = fill(cc.mem_pool_host.anchor_entry.host_pool, 6, seed=rank)
states = fill(pool_of(cc, PoolName.MAMBA), 2, seed=10 + rank)
expected = page_bytes(pool_of(cc, PoolName.MAMBA), states, 0)
# Rank 0 keeps states at the ends of pages 3 and 6; rank 1 at page 3 only.
backup_node(cc, Node(kv[: 3 * page], hashes[:3], states[:1]), tokens[: 3 * page])
backup_node(cc, Node(kv[3 * page :], hashes[3:], states[1:] if rank == 0 else None), tokens[3 * page :])
p = prefetch(cc, "r", tokens, mamba=True)
got = page_bytes(pool_of(cc, PoolName.MAMBA), p.transfers[PoolName.MAMBA].host_indices, 0)
print("RESULT", json.dumps([p.operation.storage_hit_count, p.completed_tokens, p.pool_hits, got == expected]))
cc.detach_storage_backend()
"""


def test_tp_ranks_agree_on_a_prefix_every_rank_can_restore(tmp_path: Path) -> None:
    # Each rank answers every restorable prefix length, and SGLang intersects the sets over the
    # ranks (`_sync_prefetch_hit_query`): rank 0 can restore 3 or 6 pages, rank 1 only 3, so both
    # restore 3, each with its own state taken there. A rank answering only its longest (6 and 3)
    # would leave no common length, and no hit.
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
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-4000:]
        hit, completed, pool_hits, right = json.loads(stdout.split("RESULT", 1)[1])
        assert (hit, completed, pool_hits, right) == (12, 12, {"mamba": 1}, True)
