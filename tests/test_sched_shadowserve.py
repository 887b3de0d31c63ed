"""ShadowServe (``shadowserve_async``) and its CacheGen-Async baseline (``cachegen_async``): batch
interception on hand-built views (Fig. 6's example), the chunked-pipeline numbers (§6.3), CacheGen's
interference duty cycle (§2.2, §6.2.2), the fetch path as data-plane config (the sim config's
``fetch`` section, its deprecated policy parameters), the engine's ``preload_tier`` hook, short
end-to-end runs and the quick reproduction."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from kvtier.errors import ConfigError, SimError
from kvtier.sched import make_policy
from kvtier.sched.base import LoadMode, Phase, RequestView, SchedulerView
from kvtier.sched.cachegen_async import CacheGenAsync
from kvtier.sched.fetch_path import (
    BLUEFIELD3,
    COMPRESSION_RATIO,
    DECODE_INPUT_BYTES_PER_S,
    GBPS,
    INTERFERENCE,
    PLAIN_FETCH,
    ChunkedPipeline,
    FetchPath,
    fetch_engine,
    fetch_path,
)
from kvtier.sched.shadowserve import ShadowServeAsync
from kvtier.sim.cluster import Cluster
from kvtier.sim.config import SimConfig, resolve_deprecated
from kvtier.sim.core import EventLoop
from kvtier.sim.cost import RooflineCostModel
from kvtier.sim.engine import Engine, EngineConfig
from kvtier.sim.hardware import load_hardware
from kvtier.sim.metrics import Metrics
from kvtier.sim.models import load_model
from kvtier.sim.reproduce import experiments_dir
from kvtier.sim.reproduce.shadowserve import FETCH
from kvtier.sim.request import Request
from kvtier.sim.resources import Link
from kvtier.sim.run import run
from kvtier.tiers import Tier

BT = 256
KV = 131_072  # Llama-3.1-8B KV bytes per token (bf16)
PROMPT = 14_000


class FakeCost:
    """Loads take raw bytes over ``store_bytes_per_s``; prefills a fixed 10 ms."""

    def __init__(self, store_bytes_per_s: float) -> None:
        self.store_bytes_per_s = store_bytes_per_s

    def prefill_s(self, new_tokens: int, context_tokens: int) -> float:
        return 0.01

    def load_s(self, tokens: int, tier: Tier, mode: LoadMode) -> float:
        return tokens * KV / self.store_bytes_per_s


def remote_hit(rid: int, prompt: int = PROMPT) -> RequestView:
    cached = (prompt - 1) // BT * BT
    return RequestView(rid, float(rid), Phase.WAITING, prompt, 0, 0, cached_tokens=(0, 0, 0, cached))


def miss(rid: int, prompt: int = 2_000) -> RequestView:
    return RequestView(rid, float(rid), Phase.WAITING, prompt, 0, 0)


def view(
    waiting: tuple[RequestView, ...] = (),
    running: tuple[RequestView, ...] = (),
    fetching: tuple[RequestView, ...] = (),
    free_blocks: int = 10_000,
    max_batch_tokens: int = 65_536,
    store_gbps: float = 20.0,
    fetch: str = "bluefield3",
) -> SchedulerView:
    return SchedulerView(
        now_s=0.0,
        waiting=waiting,
        running=running,
        fetching=fetching,
        swapped=(),
        free_device_blocks=free_blocks,
        free_host_blocks=None,
        block_tokens=BT,
        max_batch_tokens=max_batch_tokens,
        max_running=256,
        num_layers=32,
        cost=FakeCost(store_gbps * GBPS),
        kv_bytes_per_token=KV,
        fetch=fetch_engine(fetch),
    )


# ------------------------------------------------------------------------------------------------
# Batch interception (§4.1, Fig. 6)


def test_fig6_interception_strips_stored_prefills_and_restores_fetched_ones() -> None:
    """Fig. 6 case 1: A and B are in the store, C is not; D decodes; E is back from its fetch."""
    a, b, c = remote_hit(1), remote_hit(2), miss(3)
    d = RequestView(4, 0.0, Phase.RUNNING, 5_000, 5_000, 3)
    e = RequestView(5, 0.0, Phase.RUNNING, PROMPT, PROMPT - 1, 0)  # fetched all but its last token
    decision = ShadowServeAsync().schedule(view(waiting=(a, b, c), running=(d, e)))
    assert decision.decode == [4]
    # E's last token (A' in Fig. 6) is piggybacked; C is an ordinary prefill; A and B are not.
    assert decision.prefill == [(5, 1), (3, 2_000)]
    assert [lo.req_id for lo in decision.loads] == [1, 2]
    for lo in decision.loads:
        assert lo.mode is LoadMode.ASYNC and lo.target is Tier.DEVICE
        assert lo.tokens == (PROMPT - 1) // BT * BT  # the whole stored prompt but its last token
        assert lo.compressed  # through the engine's fetch path (its slowdown is the engine's)
    assert decision.loads[0].priority < decision.loads[1].priority  # FIFO: A before B


def test_fetching_queue_is_fifo_across_iterations() -> None:
    policy = ShadowServeAsync()
    first = policy.schedule(view(waiting=(remote_hit(1),)))
    fetching_1 = RequestView(1, 1.0, Phase.FETCHING, PROMPT, 0, 0)
    second = policy.schedule(view(waiting=(remote_hit(2),), fetching=(fetching_1,)))
    assert first.loads[0].priority == 1
    assert second.loads[0].priority == 2  # waits behind request 1 on every stage
    # Once the queue has drained, the next fetch is at the head again.
    third = policy.schedule(view(waiting=(remote_hit(3),)))
    assert third.loads[0].priority == 1


def test_parallel_fetching_shares_the_links() -> None:
    decision = ShadowServeAsync(serial_fetch=False).schedule(view(waiting=(remote_hit(1), remote_hit(2))))
    assert [lo.priority for lo in decision.loads] == [1, 1]


def test_whole_prompt_blocks_bound_interception_fcfs() -> None:
    blocks = math.ceil(PROMPT / BT)
    decision = ShadowServeAsync().schedule(
        view(waiting=(remote_hit(1), remote_hit(2), miss(3, 16)), free_blocks=blocks)
    )
    assert [lo.req_id for lo in decision.loads] == [1]  # B does not fit, so C (behind it) waits too
    assert decision.prefill == []


def test_token_budget_counts_intercepted_prompts() -> None:
    decision = ShadowServeAsync().schedule(
        view(waiting=(remote_hit(1), remote_hit(2)), max_batch_tokens=16_384)
    )
    assert [lo.req_id for lo in decision.loads] == [1]  # one unchunked 14K prompt per iteration


def test_no_af_ablation_blocks_the_step() -> None:
    decision = ShadowServeAsync(fetch_mode="sync").schedule(view(waiting=(remote_hit(1),)))
    assert decision.loads[0].mode is LoadMode.SYNC
    assert decision.prefill == [(1, PROMPT - (PROMPT - 1) // BT * BT)]


def test_bad_parameters_raise() -> None:
    with pytest.raises(ConfigError):
        ShadowServeAsync(fetch_mode="eager")
    with pytest.raises(ConfigError):
        make_policy("shadowserve_async", rounds=3)
    with pytest.raises(ConfigError, match="compression_ratio"):
        fetch_path({"engine": "bluefield3", "compression_ratio": 0.5}, "plain")
    with pytest.raises(ConfigError, match="interference"):
        SimConfig(fetch={"engine": "cachegen_gpu", "interference": -0.1})
    with pytest.raises(ConfigError, match="unknown fetch engine"):
        SimConfig(fetch={"engine": "smartnic"})
    with pytest.raises(ConfigError, match="unknown fetch key"):
        SimConfig(fetch={"rounds": 3})
    with pytest.raises(ConfigError, match="not both"):
        FetchPath(decode_bytes_per_s=1e9, decode_input_bytes_per_s=1e9)


# ------------------------------------------------------------------------------------------------
# Data plane (§4.2, §6.3) and CacheGen's interference (§2.2, §6.2.2)


def test_bluefield3_pipeline_is_network_bound_at_20_6_gbps() -> None:
    assert BLUEFIELD3.compression_ratio == pytest.approx(32 / 6)
    assert BLUEFIELD3.bottleneck() == "network"
    assert BLUEFIELD3.raw_bytes_per_s() == pytest.approx(20.6 * GBPS * 32 / 6)
    # With the standalone 37.3 Gbps network stage, dequantization (167 Gbps out) would bind.
    standalone = ChunkedPipeline(network_bytes_per_s=37.3 * GBPS)
    assert standalone.bottleneck() == "dequantize"
    assert standalone.raw_bytes_per_s() == pytest.approx(167 * GBPS)


def test_cachegen_decodes_on_the_gpu_with_duty_cycled_interference() -> None:
    gpu = fetch_engine("cachegen_gpu")
    assert gpu.decode_on_device
    assert gpu.compression_ratio == pytest.approx(COMPRESSION_RATIO)
    assert pytest.approx(32 / 6 * 502.2 / 600.5) == COMPRESSION_RATIO
    assert gpu.decoder_bytes_per_s() == pytest.approx(DECODE_INPUT_BYTES_PER_S * COMPRESSION_RATIO)
    # The engine works the slowdown out from its fetch path when it starts the fetch (the order
    # carries none): at 20 Gbps the 32 Gbps decoder is busy 20/32 of the fetch; at 40 Gbps it is
    # the bottleneck; a path without the duty cycle slows by its whole ``interference``.
    order = CacheGenAsync().schedule(view(waiting=(remote_hit(1),), fetch="cachegen_gpu")).loads[0]
    assert order.compressed and order.mode is LoadMode.ASYNC
    blocks = [(k, Tier.REMOTE) for k in range(order.tokens // BT)]
    at_20 = _engine("cachegen_async", 10_000, None, remote_gbps=20.0, fetch=gpu)[1].load_paths
    assert at_20.slowdown(order, blocks) == pytest.approx(INTERFERENCE * 20 / 32, rel=1e-3)
    at_40 = _engine("cachegen_async", 10_000, None, remote_gbps=40.0, fetch=gpu)[1].load_paths
    assert at_40.slowdown(order, blocks) == pytest.approx(INTERFERENCE)
    flat = dataclasses.replace(gpu, duty_cycle=False)
    at_10 = _engine("cachegen_async", 10_000, None, remote_gbps=10.0, fetch=flat)[1].load_paths
    assert at_10.slowdown(order, blocks) == pytest.approx(INTERFERENCE)
    # An uncompressed load does not decode: only the (plain) load path's copies, which slow nothing.
    assert at_20.slowdown(dataclasses.replace(order, compressed=False), blocks) == 0.0
    # The control planes are one: on the same data plane the two policies decide the same.
    same = view(waiting=(remote_hit(1), remote_hit(2)), fetch="cachegen_gpu")
    assert ShadowServeAsync().schedule(same) == CacheGenAsync().schedule(same)


def test_fetch_section_names_a_path_and_overrides_its_keys() -> None:
    assert fetch_path(None, "bluefield3") == fetch_engine("bluefield3")  # the policy's default
    assert fetch_path({"interference": 0.1}, "cachegen_gpu") == dataclasses.replace(
        fetch_engine("cachegen_gpu"), interference=0.1
    )
    # A decoder rate given the other way replaces the engine's.
    raw = fetch_path({"engine": "cachegen_gpu", "decode_bytes_per_s": 5e9}, "plain")
    assert raw.decoder_bytes_per_s() == 5e9 and raw.decode_input_bytes_per_s is None
    compressed = fetch_path({"engine": "bluefield3", "decode_input_bytes_per_s": 1e9}, "plain")
    assert compressed.decoder_bytes_per_s() == pytest.approx(1e9 * BLUEFIELD3.compression_ratio)
    assert fetch_engine("plain").decoder_bytes_per_s() is None


def test_deprecated_fetch_parameters_move_to_the_fetch_section() -> None:
    old = SimConfig(policy={"name": "cachegen_async", "interference": 0.0, "duty_cycle": False})
    with pytest.warns(DeprecationWarning, match="fetch.interference: 0.0"):
        new = resolve_deprecated(old)
    assert new.policy == {"name": "cachegen_async"}
    assert new.fetch == {"interference": 0.0, "duty_cycle": False}
    # The section's own keys win; other policies' parameters are left alone.
    both = SimConfig(
        policy={"name": "shadowserve_async", "compression_ratio": 4.0}, fetch={"compression_ratio": 2.0}
    )
    with pytest.warns(DeprecationWarning):
        assert resolve_deprecated(both).fetch == {"compression_ratio": 2.0}
    plain = SimConfig(policy={"name": "fcfs"})
    assert resolve_deprecated(plain) is plain


# ------------------------------------------------------------------------------------------------
# Engine hooks: preload_tier, kv_bytes_per_token in the view


def _engine(
    policy: str,
    remote_blocks: int,
    preload: Tier | None,
    remote_gbps: float = 20.0,
    fetch: FetchPath = PLAIN_FETCH,
) -> tuple[EventLoop, Engine, Metrics, Cluster]:
    loop, metrics = EventLoop(), Metrics()
    hw = load_hardware("l40s")
    cost = RooflineCostModel(hw, load_model("llama-3.1-8b"))
    host = Link(loop, "host", 25e9, 25e9, True, 5e-6)
    remote = Link(loop, "remote", remote_gbps * GBPS, remote_gbps * GBPS)
    config = EngineConfig(
        block_tokens=BT,
        device_blocks=2_000,
        remote_blocks=remote_blocks,
        max_batch_tokens=16_384,
        preload_tier=preload,
        fetch=fetch,
    )
    engine = Engine(loop, "e0", config, cost, make_policy(policy), metrics, host, remote_link=remote)
    return loop, engine, metrics, Cluster(loop, metrics, [engine])


def test_preload_tier_serves_every_prompt_from_the_store() -> None:
    loop, engine, metrics, cluster = _engine("shadowserve_async", 10_000, Tier.REMOTE)
    assert engine.view().kv_bytes_per_token == KV
    prompt = 55 * BT + 10
    requests = [Request(i, 5.0 * i, prompt, 4, tuple(range(100 * i, 100 * i + 56))) for i in range(3)]
    cluster.feed(iter(requests))
    loop.run()
    assert metrics.requests == 3
    assert metrics.hit_tokens[Tier.REMOTE] == 3 * 55 * BT  # all but the last (partial) block
    assert metrics.hit_tokens[Tier.DEVICE] == 0


def test_without_preload_the_store_starts_empty() -> None:
    loop, _, metrics, cluster = _engine("shadowserve_async", 10_000, None)
    cluster.feed(iter([Request(0, 0.0, 20 * BT, 2, tuple(range(20)))]))
    loop.run()
    assert metrics.hit_tokens[Tier.REMOTE] == 0


def test_preload_of_a_missing_tier_raises() -> None:
    with pytest.raises(SimError, match="preloads tier"):
        _engine("shadowserve_async", 0, Tier.REMOTE)
    with pytest.raises(ConfigError, match="preload_tier"):
        SimConfig(preload_tier="disk")


# ------------------------------------------------------------------------------------------------
# End to end on the paper's setup (20 Gbps, Llama-8B, L40S + BlueField-3)


def _config(
    policy: dict[str, object], requests: int, rate: float, output: int = 8, **fetch: object
) -> SimConfig:
    """The experiment with ``policy`` on its paper's fetch path (``fetch`` keys changed)."""
    base = SimConfig.from_yaml(experiments_dir() / "shadowserve" / "narrativeqa_l40s.yaml")
    hardware = str(experiments_dir() / "shadowserve" / "l40s-bf3.yaml")
    workload = {**base.workload, "num_requests": requests, "rate_per_s": rate}
    workload.update(output_tokens_min=output, output_tokens_max=output)
    path = {"engine": FETCH[str(policy["name"])], **fetch}
    return base.with_overrides(hardware=hardware, policy=policy, workload=workload, fetch=path)


def test_unloaded_ttft_is_one_fetch_plus_the_last_token_step() -> None:
    ss = run(_config({"name": "shadowserve_async"}, 4, 0.05))
    cg = run(_config({"name": "cachegen_async"}, 4, 0.05))
    assert ss["hit_rate_tokens"]["remote"] > 0.98 and ss["hit_rate_tokens"]["device"] == 0
    # 14K tokens x 128 KiB / 5.33 over 20 Gbps is ~0.14 s; the last-token step adds ~0.03 s.
    assert 0.13 < ss["ttft_s"]["mean"] < 0.2
    assert cg["ttft_s"]["mean"] / ss["ttft_s"]["mean"] > 1.1  # CacheGen's larger bitstream
    # The comparison is a data-plane difference: ShadowServe's policy on CacheGen's path is CacheGen.
    ablation = _config({"name": "shadowserve_async"}, 4, 0.05).with_overrides(
        fetch={"engine": "cachegen_gpu"}
    )
    assert run(ablation)["ttft_s"] == cg["ttft_s"]


def test_serial_fetching_finishes_a_burst_in_arrival_order() -> None:
    serial = run(_config({"name": "shadowserve_async"}, 6, 1000.0))
    shared = run(_config({"name": "shadowserve_async", "serial_fetch": False}, 6, 1000.0))
    # Same fetch throughput, but FIFO finishes the first fetches early: lower mean TTFT.
    # Processor sharing finishes all six fetches together, at ~6 fetch times; FIFO at 1, 2, ..., 6.
    assert serial["ttft_s"]["mean"] < 0.7 * shared["ttft_s"]["mean"]
    assert serial["ttft_s"]["max"] == pytest.approx(shared["ttft_s"]["max"], rel=0.1)


def test_loaded_tpot_is_lower_without_gpu_decompression() -> None:
    ss = run(_config({"name": "shadowserve_async"}, 30, 100.0, output=16))
    cg = run(_config({"name": "cachegen_async"}, 30, 100.0, output=16))
    no_interference = run(_config({"name": "cachegen_async"}, 30, 100.0, output=16, interference=0.0))
    assert cg["tpot_s"]["mean"] > ss["tpot_s"]["mean"]
    assert cg["tpot_s"]["mean"] > no_interference["tpot_s"]["mean"]


def test_no_af_stalls_decodes() -> None:
    asynchronous = run(_config({"name": "shadowserve_async"}, 20, 100.0, output=32))
    blocking = run(_config({"name": "shadowserve_async", "fetch_mode": "sync"}, 20, 100.0, output=32))
    assert blocking["tpot_s"]["mean"] > 1.2 * asynchronous["tpot_s"]["mean"]


def test_quick_reproduction_returns_rows(tmp_path: Path) -> None:
    from kvtier.sim import reproduce

    rows = reproduce.run("shadowserve", tmp_path, quick=True)
    assert len(rows) >= 10
    assert all(r.paper == "shadowserve" and math.isfinite(r.kvtier_ratio) for r in rows)
    assert (tmp_path / "fig10_gain_over_cachegen_async.png").is_file()
    by_metric = {r.metric: r for r in rows}
    ttft_40 = next(r for m, r in by_metric.items() if m.startswith("unloaded TTFT") and "40 Gbps" in m)
    assert ttft_40.kvtier_ratio < 1.0  # above 20 Gbps CacheGen-Async fetches faster (§6.2.2)
