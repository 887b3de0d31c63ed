"""Unified KV pooling (paper 003): Algorithm 1's counts, the policies on hand-built views, the pool
in the simulator (serial LMCache path vs pooled devices, filesystem vs passthrough) against closed
forms, the long-doc QA workload, and the quick reproduction."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.errors import ConfigError
from kvtier.sched import make_policy, policy_names
from kvtier.sched.base import LoadMode, Phase, RequestView, SchedulerView
from kvtier.sched.unified_pool import (
    bandwidth_aware_counts,
    bandwidth_aware_partition,
    layerwise_items,
    placement_ratios,
)
from kvtier.sim.config import SimConfig, resolve_deprecated
from kvtier.sim.core import EventLoop
from kvtier.sim.hardware import load_hardware
from kvtier.sim.models import load_model
from kvtier.sim.pool import PLACEMENTS, PoolSpec
from kvtier.sim.reproduce import experiments_dir
from kvtier.sim.reproduce import run as run_reproduction
from kvtier.sim.reproduce.unified_pool import PROFILES, load_config, query_round
from kvtier.sim.resources import Direction, Link, Transfer, WeightedStripedLink
from kvtier.sim.run import run
from kvtier.sim.workload import make_workload
from kvtier.sim.workload.long_doc_qa import query_order
from kvtier.tiers import Tier

SERVER = [10.65e9, 10.65e9, 31.5e9, 31.5e9]  # §III-A: two DDR4 modules, two SSDs (peaks)

# --- Algorithm 1 -----------------------------------------------------------------------------------


def test_placement_ratios_are_eq_1() -> None:
    assert placement_ratios([1.0, 3.0]) == [0.25, 0.75]
    assert sum(placement_ratios(SERVER)) == 1


@pytest.mark.parametrize(
    ("items", "bandwidths", "counts"),
    [
        (7, [1.0, 2.0, 4.0], [1, 2, 4]),  # floors are exact, nothing remains
        (10, [1.0, 1.0, 1.0], [4, 3, 3]),  # one left: the largest share, ties to the lower index
        # floors 12, 12, 37, 37; two left: one each to the two largest shares (the SSDs), not both
        # to one device (Algorithm 1 line 10 read literally) nor by fractional part.
        (100, SERVER, [12, 12, 38, 38]),
        # shares .6/.3/.1 of 5 -> floors 3, 1, 0; the one left goes to the largest share (device 0),
        # where largest-remainder rounding would pick device 1 (fraction .5 vs 0).
        (5, [6.0, 3.0, 1.0], [4, 1, 0]),
        (0, SERVER, [0, 0, 0, 0]),
        (1, [2.0, 1.0], [1, 0]),
    ],
)
def test_bandwidth_aware_counts_are_algorithm_1(
    items: int, bandwidths: list[float], counts: list[int]
) -> None:
    assert bandwidth_aware_counts(items, bandwidths) == counts


def test_counts_sum_to_the_offload_set_and_track_bandwidth() -> None:
    for n in (1, 31, 32 * 500, 12_345):
        counts = bandwidth_aware_counts(n, SERVER)
        assert sum(counts) == n
        for count, share in zip(counts, placement_ratios(SERVER), strict=True):
            assert abs(count - share * n) < 1 + 1e-9


def test_partition_fills_devices_in_layerwise_order() -> None:
    items = layerwise_items(num_blocks=2, num_layers=4)
    assert items[:3] == [(0, 0), (0, 1), (1, 0)]
    sets = bandwidth_aware_partition(items, [1.0, 3.0])  # counts 2, 6
    assert sets == [[(0, 0), (0, 1)], [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]]


def test_bad_bandwidths_and_counts_raise() -> None:
    with pytest.raises(ConfigError):
        bandwidth_aware_counts(4, [])
    with pytest.raises(ConfigError):
        bandwidth_aware_counts(4, [1.0, 0.0])
    with pytest.raises(ConfigError):
        bandwidth_aware_counts(-1, [1.0])


# --- the policies on hand-built views -------------------------------------------------------------


class _NoCost:
    def prefill_s(self, new_tokens: int, context_tokens: int) -> float:
        return 0.0

    def load_s(self, tokens: int, tier: Tier, mode: LoadMode) -> float:
        return 0.0


def request(
    rid: int, prompt: int, cached: tuple[int, int, int, int] = (0, 0, 0, 0), computed: int = 0
) -> RequestView:
    return RequestView(rid, float(rid), Phase.WAITING, prompt, computed, 0, cached)


def view(
    waiting: tuple[RequestView, ...], running: tuple[RequestView, ...] = (), budget: int = 8192
) -> SchedulerView:
    return SchedulerView(
        now_s=0.0,
        waiting=waiting,
        running=running,
        fetching=(),
        swapped=(),
        free_device_blocks=10_000,
        free_host_blocks=None,
        block_tokens=256,
        max_batch_tokens=budget,
        max_running=256,
        num_layers=32,
        cost=_NoCost(),
    )


def test_lmcache_lp_loads_layerwise_with_the_prefill() -> None:
    d = make_policy("lmcache_lp").schedule(view((request(0, 1000, cached=(0, 512, 256, 0)),)))
    assert d.prefill == [(0, 1000 - 768)]
    assert [(lo.req_id, lo.tokens, lo.mode) for lo in d.loads] == [(0, 768, LoadMode.LAYERWISE)]


def test_lmcache_is_synchronous_and_lp_is_not() -> None:
    v = view((request(0, 1000, cached=(0, 768, 0, 0)),))
    assert make_policy("lmcache").schedule(v).loads[0].mode is LoadMode.SYNC
    assert make_policy("lmcache_lp").schedule(v).loads[0].mode is LoadMode.LAYERWISE


@pytest.mark.parametrize("name", ["lmcache_lp_async"])
def test_async_fetches_a_queued_hit_without_compute_budget(name: str) -> None:
    # A running prefill takes the whole token budget: FCFS admission (LP) would wait, async loading
    # still starts the waiting request's fetch now (§II-B2); a miss behind it waits for budget.
    busy = RequestView(9, 0.0, Phase.RUNNING, 20_000, 0, 0)
    hit = request(1, 128_000, cached=(0, 0, 127_744, 0))
    miss = request(2, 4000)
    d = make_policy(name).schedule(view((hit, miss), running=(busy,)))
    assert d.prefill == [(9, 8192)]
    assert [(lo.req_id, lo.tokens, lo.mode) for lo in d.loads] == [(1, 127_744, LoadMode.ASYNC)]
    lp = make_policy("lmcache_lp").schedule(view((hit, miss), running=(busy,)))
    assert lp.loads == [] and lp.prefill == [(9, 8192)]


def test_async_admits_a_miss_by_budget() -> None:
    d = make_policy("lmcache_lp_async").schedule(view((request(0, 3000),)))
    assert d.prefill == [(0, 3000)] and d.loads == []


def test_old_policy_names_warn_and_keep_their_runs() -> None:
    # The names that carried the data plane build lmcache_lp_async and say which pool keys to set;
    # in a sim config with a `pool` section they fill the layout they meant (same run as before).
    for old, (layout, passthrough) in {
        "unified_pool": ("pooled", True),
        "unified_pool_orchestrator": ("pooled", False),
        "unified_pool_passthrough": ("serial", True),
    }.items():
        with pytest.warns(DeprecationWarning, match=f"layout: '{layout}'"):
            assert make_policy(old).name == "lmcache_lp_async"
        config = load_config("fig10_ablation.yaml").with_overrides(
            policy={"name": old}, pool={"dram_modules": 2}
        )
        with pytest.warns(DeprecationWarning, match="lmcache_lp_async"):
            resolved = resolve_deprecated(config)
        assert resolved.policy == {"name": "lmcache_lp_async"}
        assert resolved.pool == {"dram_modules": 2, "layout": layout, "passthrough": passthrough}
        # Keys the config sets win over what the old name implied.
        explicit = config.with_overrides(pool={"layout": "serial"})
        with pytest.warns(DeprecationWarning):
            assert resolve_deprecated(explicit).pool == {"layout": "serial", "passthrough": passthrough}
    assert "unified_pool" not in policy_names()


def test_pool_section_holds_layout_passthrough_and_placement() -> None:
    spec = PoolSpec.from_mapping({"layout": "pooled", "passthrough": True})
    assert (spec.layout, spec.passthrough, spec.placement) == ("pooled", True, "bandwidth_aware")
    assert PoolSpec.from_mapping({}) == PoolSpec(1, 0.0, "serial", False, "bandwidth_aware")
    assert PLACEMENTS["bandwidth_aware"](100, tuple(SERVER)) == [12, 12, 38, 38]
    for bad in ({"layout": "striped"}, {"passthrough": "yes"}, {"placement": "random"}):
        with pytest.raises(ConfigError, match=f"pool `{next(iter(bad))}`"):
            PoolSpec.from_mapping(bad)


# --- the pooled link --------------------------------------------------------------------------------


def test_weighted_striped_link_splits_by_counts_and_runs_parts_in_parallel() -> None:
    loop = EventLoop()
    slow = Link(loop, "dram", 1e9, 1e9, duplex=False)
    fast = Link(loop, "ssd", 3e9, 3e9, duplex=False)
    pool = WeightedStripedLink("pool", [slow, fast], lambda n: bandwidth_aware_counts(n, [1e9, 3e9]), 10**6)
    assert pool.parts(8 * 10**6) == [2 * 10**6, 6 * 10**6]
    assert pool.parts(7_500_000) == [2 * 10**6, 5_500_000]  # the partial last item
    done: list[float] = []

    def landed(t: Transfer) -> None:
        done.append(loop.now_s)

    pool.submit(8 * 10**6, Direction.IN, landed)
    loop.run()
    assert done == [pytest.approx(2e-3)]  # 2 MB at 1 GB/s alongside 6 MB at 3 GB/s
    assert pool.work_s(8 * 10**6, 10**6, Direction.IN) == pytest.approx(2e-3)
    assert slow.bytes_moved[0] == 2 * 10**6 and fast.bytes_moved[0] == 6 * 10**6


def test_weighted_striped_link_rejects_a_bad_split() -> None:
    loop = EventLoop()
    pool = WeightedStripedLink("pool", [Link(loop, "a", 1e9, 1e9)], lambda n: [n + 1], 100)
    with pytest.raises(Exception, match="split"):
        pool.parts(1000)


# --- the pool in the simulator: closed forms ---------------------------------------------------------

BLOCK_BYTES = 256 * 131_072  # one 256-token chunk of Llama-3.1-8B
FS_S = 4.194e-3


def small_config(system: str, **overrides: Any) -> SimConfig:
    """One 2,048-token document (8 chunks), warmed up then queried once, one request at a time;
    ``system`` is a key of PROFILES (a policy and the pool's layout and SSD path)."""
    base = load_config("fig9_llama8b.yaml")
    policy, profile = PROFILES[system]
    workload = {
        "name": "long_doc_qa",
        "num_documents": 1,
        "document_tokens": 2048,
        "output_tokens": 2,
        "repeat_count": 1,
        "max_inflight_requests": 1,
        "sleep_after_warmup_s": 1.0,  # the warm-up's write-through lands first
    }
    pool = {**(base.pool or {}), **profile}
    return base.with_overrides(policy={"name": policy}, workload=workload, pool=pool, **overrides)


def loaded_blocks() -> int:
    return (2048 - 1) // 256  # the last prompt token is computed: 7 of 8 blocks load


def test_serial_host_hit_is_bound_by_one_memory_module() -> None:
    r = run(small_config("lmcache"))
    assert r["hit_rate_tokens"]["host"] > 0 and r["hit_rate_tokens"]["ssd"] == 0
    module_s = loaded_blocks() * BLOCK_BYTES / (21.3e9 / 2)  # one of two modules, not PCIe's 50 GB/s
    assert r["blocked_io_s"] == pytest.approx(module_s, rel=1e-3)


# The host tier holds the first block only: 6 blocks come from ssd0, all 7 cross module dram0.
SSD_FS_S = 6 * (BLOCK_BYTES / 31.5e9 + FS_S)  # one SSD through the filesystem: the SSD bounds it
MODULE_S = 7 * BLOCK_BYTES / (21.3e9 / 2)  # without the filesystem the one module bounds it


@pytest.mark.parametrize(
    ("policy", "expected_s"), [("lmcache", SSD_FS_S), ("unified_pool_passthrough", MODULE_S)]
)
def test_serial_ssd_hit_pays_the_filesystem_per_object(policy: str, expected_s: float) -> None:
    r = run(small_config(policy, host_capacity_bytes=BLOCK_BYTES))
    assert r["hit_rate_tokens"]["ssd"] > 0 and r["hit_rate_tokens"]["host"] > 0
    assert r["blocked_io_s"] + r["fetch_stall_s"] == pytest.approx(expected_s, rel=2e-3)


def test_pooled_load_splits_across_devices_and_is_bound_by_pcie() -> None:
    r = run(small_config("unified_pool"))
    assert r["hit_rate_tokens"]["host"] > 0  # the pool is the engine's one lower tier
    nbytes = loaded_blocks() * BLOCK_BYTES
    pcie_s = nbytes / 50e9 + loaded_blocks() * 5e-6  # one copy per block, 5 us each
    assert r["fetch_stall_s"] == pytest.approx(pcie_s, rel=1e-3)  # the 84 GB/s pool waits on PCIe
    links = r["links"]
    moved = [links[name]["bytes_in"] for name in ("dram0", "dram1", "ssd0", "ssd1")]
    items = bandwidth_aware_counts(loaded_blocks() * 32, SERVER)
    assert moved == [c * BLOCK_BYTES // 32 for c in items]
    slow = run(small_config("unified_pool_orchestrator"))
    assert slow["fetch_stall_s"] > r["fetch_stall_s"] * 1.5  # the SSD parts pay the filesystem


def test_device_prefix_cache_off_sends_every_query_to_the_lower_tiers() -> None:
    on = run(small_config("lmcache", device_prefix_cache=True))
    off = run(small_config("lmcache"))
    assert on["hit_rate_tokens"]["device"] > 0 and on["blocked_io_s"] == 0
    assert off["hit_rate_tokens"]["device"] == 0 and off["blocked_io_s"] > 0


def test_fetch_stall_counts_only_async_fetches() -> None:
    assert run(small_config("lmcache_lp"))["fetch_stall_s"] == 0
    assert run(small_config("lmcache_lp_async"))["fetch_stall_s"] > 0


def test_pool_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="unknown pool"):
        SimConfig(pool={"modules": 2})
    with pytest.raises(ConfigError, match="dram_modules"):
        SimConfig(pool={"dram_modules": 0})
    with pytest.raises(ConfigError, match="device_prefix_cache"):
        SimConfig(device_prefix_cache="no")  # type: ignore[arg-type]


def test_filesystem_overhead_is_derived_from_section_iii_c() -> None:
    """fs / (fs + device) = 84% for one 256-token chunk of the profiled model (Qwen3-30B-A3B)."""
    directory = experiments_dir() / "unified_pool"
    hw = load_hardware(str(directory / "server.yaml"))
    chunk = 256 * load_model("qwen3-30b-a3b").kv_bytes_per_token_per_gpu(1)
    derived = 0.84 / (1 - 0.84) * chunk / hw.ssd_read_bytes_per_s
    for name in ("fig9_llama8b.yaml", "fig10_ablation.yaml"):
        pool = yaml.safe_load((directory / name).read_text())["pool"]
        assert pool["filesystem_object_overhead_s"] == pytest.approx(derived, rel=1e-3)
    assert hw.dram_bytes_per_s == 21.3e9 and hw.ssd_count * hw.ssd_read_bytes_per_s == 63e9


# --- workload, end to end, reproduction ------------------------------------------------------------------


def test_query_order_is_the_benchmarks() -> None:
    expected = list(range(8)) * 2
    random.Random(0).shuffle(expected)
    assert query_order(8, 2, "random", 0) == expected
    assert query_order(3, 2, "tile", 0) == [0, 1, 2, 0, 1, 2]
    assert query_order(3, 2, "interleave", 0) == [0, 0, 1, 1, 2, 2]


def test_long_doc_qa_chains_requests_by_inflight_slots() -> None:
    reqs = list(
        make_workload(
            "long_doc_qa",
            block_tokens=256,
            num_documents=3,
            document_tokens=1000,
            repeat_count=2,
            repeat_mode="tile",
            max_inflight_requests=2,
            sleep_after_warmup_s=5.0,
        )
    )
    assert [r.parent_id for r in reqs] == [None, None, 0, 2, 2, 3, 4, 5, 6]
    assert [r.think_time_s for r in reqs[3:5]] == [5.0, 5.0]
    assert reqs[3].block_keys == reqs[0].block_keys and reqs[4].block_keys == reqs[1].block_keys
    assert len(reqs[0].block_keys) == 4
    warmup = list(make_workload("long_doc_qa", block_tokens=256, num_documents=3, query_round=False))
    assert len(warmup) == 3


def test_unified_pool_beats_every_baseline_at_32k() -> None:
    config = load_config("fig9_llama8b.yaml")
    points = {p: query_round(config, p, 32_000) for p in ("lmcache", "lmcache_lp_async", "unified_pool")}
    assert points["unified_pool"].ttft_s < points["lmcache_lp_async"].ttft_s <= points["lmcache"].ttft_s
    assert points["unified_pool"].blocked_io_s < points["lmcache_lp_async"].blocked_io_s
    assert all(p.hit_fraction > 0.99 for p in points.values())


def test_quick_reproduction_returns_rows(tmp_path: Path) -> None:
    rows = run_reproduction("unified_pool", tmp_path, quick=True)
    metrics = [r.metric for r in rows]
    assert (
        len(rows) == 9 and any("blocked I/O" in m for m in metrics) and any("ablation" in m for m in metrics)
    )
    assert all(r.kvtier_ratio > 1 for r in rows)  # unified pooling is fastest; SSD slower than host
    assert (tmp_path / "unified_pool_fig9_fig10.png").is_file()
