"""The engine model against closed-form expectations, and the simulator's bad-input handling."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest

from kvtier.errors import ConfigError, SimError, TraceError
from kvtier.sched import make_policy
from kvtier.sched.base import (
    LoadMode,
    Phase,
    Policy,
    RequestView,
    SchedulerDecision,
    SchedulerView,
    policy_names,
    register,
)
from kvtier.sched.batching import admit_fcfs, schedule_running
from kvtier.sim.cluster import Cluster
from kvtier.sim.config import SimConfig
from kvtier.sim.core import EventLoop
from kvtier.sim.cost import BatchShape, PrefillChunk, RooflineCostModel
from kvtier.sim.engine import Engine, EngineConfig
from kvtier.sim.hardware import load_hardware
from kvtier.sim.metrics import Metrics
from kvtier.sim.models import load_model
from kvtier.sim.request import Request
from kvtier.sim.resources import Direction, Link
from kvtier.sim.run import run, workload
from kvtier.sim.state import SimRequest
from kvtier.sim.view import WaitingViews, admitted_view
from kvtier.sim.workload import mooncake_block_hit_rate
from kvtier.tiers import NO_TOKENS, Tier

BT = 16  # block tokens


def cost() -> RooflineCostModel:
    return RooflineCostModel(load_hardware("h100-sxm"), load_model("llama-3.1-8b"))


def make_engine(
    policy: str = "fcfs", device_blocks: int = 10_000, host_blocks: int = 0, **kw: Any
) -> tuple[EventLoop, Engine, Metrics, Cluster]:
    loop = EventLoop()
    metrics = Metrics()
    hw = load_hardware("h100-sxm")
    link = Link(
        loop,
        "host",
        hw.host_link.h2d_bytes_per_s,
        hw.host_link.d2h_bytes_per_s,
        True,
        hw.host_link.per_segment_overhead_s,
    )
    config = EngineConfig(block_tokens=BT, device_blocks=device_blocks, host_blocks=host_blocks, **kw)
    engine = Engine(loop, "e0", config, cost(), make_policy(policy), metrics, link)
    return loop, engine, metrics, Cluster(loop, metrics, [engine])


def req(
    rid: int, arrival_s: float, keys: tuple[int, ...], prompt: int | None = None, output: int = 1
) -> Request:
    return Request(rid, arrival_s, prompt if prompt is not None else len(keys) * BT, output, keys)


def run_requests(cluster: Cluster, loop: EventLoop, requests: list[Request]) -> None:
    cluster.feed(iter(requests))
    loop.run()


def test_one_request_alone_has_the_cost_models_prefill_time() -> None:
    loop, _, metrics, cluster = make_engine()
    run_requests(cluster, loop, [req(0, 1.0, tuple(range(100)))])  # 1600 tokens, one chunk
    assert metrics.requests == 1
    assert metrics.ttft_s.total == pytest.approx(cost().prefill_time_s(1600))


def test_chunked_prefill_sums_its_chunks() -> None:
    loop, _, metrics, cluster = make_engine(max_batch_tokens=1024)
    run_requests(cluster, loop, [req(0, 0.0, tuple(range(100)))])
    c = cost()
    expected = sum(c.prefill_time_s(n, ctx) for n, ctx in ((1024, 0), (576, 1024)))
    assert metrics.ttft_s.total == pytest.approx(expected)


def test_decode_steps_cost_one_token_each() -> None:
    loop, _, metrics, cluster = make_engine()
    run_requests(cluster, loop, [req(0, 0.0, tuple(range(10)), output=4)])
    c = cost()
    steps = [c.step_time_s(BatchShape((), (160 + i,))) for i in range(1, 4)]
    assert metrics.tpot_s.total == pytest.approx(sum(steps) / 3)
    assert metrics.tbt_s.count == 3


def test_device_prefix_hit_skips_the_cached_blocks() -> None:
    loop, _, metrics, cluster = make_engine()
    keys = tuple(range(100))
    run_requests(cluster, loop, [req(0, 0.0, keys), req(1, 100.0, keys)])
    c = cost()
    # Whole blocks are reused, and at least one prompt token is computed: 99 of 100 blocks hit.
    second = c.prefill_time_s(16, 1584)
    assert metrics.ttft_s.min == pytest.approx(second)
    assert metrics.hit_tokens[0] == 1584


@pytest.mark.parametrize("with_finish_keys", [False, True])
def test_finish_keys_keep_the_reply_blocks_cached(with_finish_keys: bool) -> None:
    """A first turn of 10 blocks + 40 output tokens; the second turn re-sends prompt + reply + 8 new
    blocks. With ``finish_keys`` the reply's two full blocks stay cached: 12 blocks hit, not 10."""
    loop, _, metrics, cluster = make_engine()
    prompt = tuple(range(10))
    sequence = (*prompt, 500, 501)  # prompt + reply: 12 full blocks (the reply's last 8 tokens partial)
    first = Request(0, 0.0, 10 * BT, 40, prompt, finish_keys=sequence if with_finish_keys else ())
    second_keys = (*sequence, *range(600, 608))
    run_requests(cluster, loop, [first, req(1, 100.0, second_keys)])
    assert metrics.hit_tokens[0] == (12 if with_finish_keys else 10) * BT


def _host_hit_scenario(policy: str) -> tuple[Metrics, Engine, float]:
    """A's prompt is computed and written through to host, B's evicts it from device, A again hits host."""
    loop, engine, metrics, cluster = make_engine(policy, device_blocks=120, host_blocks=1000)
    a = tuple(range(100))
    b = tuple(range(1000, 1110))
    run_requests(cluster, loop, [req(0, 0.0, a), req(1, 50.0, b), req(2, 100.0, a, prompt=1600)])
    return metrics, engine, loop.now_s


def test_lmcache_loads_host_prefix_synchronously() -> None:
    metrics, engine, _ = _host_hit_scenario("lmcache")
    assert metrics.hit_tokens[1] > 0, "the third request must hit host"
    c = cost()
    loaded_blocks = metrics.hit_tokens[1] // BT
    device_tokens = metrics.hit_tokens[0]
    load_s = engine.host_link.work_s(loaded_blocks * engine.block_bytes, engine.block_bytes, Direction.IN)
    compute_s = c.step_time_s(
        BatchShape(
            (PrefillChunk(1600 - device_tokens - loaded_blocks * BT, device_tokens + loaded_blocks * BT),)
        )
    )
    assert metrics.blocked_io_s == pytest.approx(load_s)
    assert metrics.ttft_s.max >= compute_s + load_s - 1e-9


def test_hicache_overlaps_the_load_layer_by_layer() -> None:
    metrics, engine, _ = _host_hit_scenario("hicache")
    assert metrics.hit_tokens[1] > 0
    c = cost()
    loaded_blocks = metrics.hit_tokens[1] // BT
    reused = metrics.hit_tokens[0] + metrics.hit_tokens[1]
    # Per-page, per-layer copies: 32-token pages, K and V separately (Strata §3.1).
    segment = 32 * engine.block_bytes // BT // c.num_layers // 2
    load_s = engine.host_link.work_s(loaded_blocks * engine.block_bytes, segment, Direction.IN)
    compute_s = c.step_time_s(BatchShape((PrefillChunk(1600 - reused, reused),)))
    # Layer l computes once its KV is in: the step ends at max(compute, load + compute / layers).
    expected_blocked = max(0.0, load_s + compute_s / c.num_layers - compute_s)
    assert metrics.blocked_io_s == pytest.approx(expected_blocked)
    lm, _, _ = _host_hit_scenario("lmcache")
    assert lm.hit_tokens[1] == metrics.hit_tokens[1]


def test_layerwise_overlap_hides_a_load_shorter_than_compute() -> None:
    """A long prompt whose small cached prefix loads faster than the rest computes: no blocking."""
    loop, _, metrics, cluster = make_engine("hicache", device_blocks=400, host_blocks=1000)
    a = tuple(range(20))
    b = tuple(range(1000, 1390))
    long_a = a + tuple(range(5000, 5300))  # same 20-block prefix, then 300 new blocks
    run_requests(cluster, loop, [req(0, 0.0, a), req(1, 50.0, b), req(2, 100.0, long_a)])
    assert metrics.hit_tokens[1] > 0
    assert metrics.blocked_io_s == pytest.approx(0.0, abs=1e-12)


def test_fcfs_has_no_host_tier_and_recomputes() -> None:
    loop, _, metrics, cluster = make_engine("fcfs", device_blocks=120)
    a = tuple(range(100))
    run_requests(cluster, loop, [req(0, 0.0, a), req(1, 50.0, tuple(range(1000, 1110))), req(2, 100.0, a)])
    assert metrics.hit_tokens[1] == 0 and metrics.hit_tokens[0] < 1584


def test_preemption_under_pressure_still_finishes_everything() -> None:
    loop, engine, metrics, cluster = make_engine("fcfs", device_blocks=40, max_batch_tokens=256)
    requests = [req(i, 0.01 * i, tuple(range(1000 * i, 1000 * i + 10)), output=200) for i in range(12)]
    run_requests(cluster, loop, requests)
    assert metrics.requests == 12
    assert metrics.preemptions > 0
    assert engine.private_blocks == 0 and engine.reserved_blocks == 0
    engine.tree.check_integrity()
    # Every transient mark was cleared: nothing is queued or in flight any more.
    assert all(engine.tree.match(r.block_keys).transient_blocks == 0 for r in requests)


def test_closed_loop_child_arrives_after_parent_plus_think_time() -> None:
    loop, _, metrics, cluster = make_engine()
    parent = req(0, 0.0, tuple(range(10)), output=2)
    child = Request(1, 0.0, 200, 1, tuple(range(12)), parent_id=0, think_time_s=5.0)
    run_requests(cluster, loop, [parent, child])
    assert metrics.requests == 2
    assert metrics.first_arrival_s == 0.0
    assert metrics.hit_tokens[0] == 160  # the child reuses its parent's prompt


def test_runs_are_deterministic() -> None:
    config = SimConfig(
        name="det",
        model="llama-3.1-8b",
        policy={"name": "hicache"},
        block_tokens=16,
        workload={"name": "multiturn", "num_sessions": 30, "rate_per_s": 2.0},
        host_capacity_bytes="20GiB",
    )
    a, b = run(config), run(config)
    for key in ("ttft_s", "tpot_s", "hit_rate_tokens", "events", "sim_time_s"):
        assert a[key] == b[key]


def test_pd_disaggregation_runs_and_transfers_kv() -> None:
    config = SimConfig(
        name="pd",
        policy={"name": "fcfs"},
        prefill_engines=1,
        decode_engines=2,
        block_tokens=16,
        host_capacity_bytes=0,
        workload={"name": "multiturn", "num_sessions": 20, "rate_per_s": 2.0},
    )
    result = run(config)
    assert result["unfinished_requests"] == 0
    assert result["requests"] > 20
    assert result["links"]["pd"]["bytes_out"] > 0


def test_infinite_capacity_reproduces_the_traces_block_hit_rate() -> None:
    config = SimConfig(
        name="inf",
        policy={"name": "fcfs"},
        block_tokens=512,
        device_blocks=10**7,
        host_capacity_bytes=0,
        workload={"name": "mooncake", "max_requests": 600, "time_scale": 1000.0},
    )
    assert run(config)["hit_rate_blocks"] == pytest.approx(
        mooncake_block_hit_rate(max_requests=600), abs=1e-12
    )


class _Echo(Policy):
    name = "test-bad-decoder"

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        return SchedulerDecision(decode=[r.req_id for r in view.waiting])


def test_a_policy_that_decodes_before_prefill_is_caught() -> None:
    if "test-bad-decoder" not in policy_names():
        register(_Echo)
    loop, engine, _, cluster = make_engine()
    engine.policy = make_policy("test-bad-decoder")
    with pytest.raises(SimError, match="before its prefill"):
        run_requests(cluster, loop, [req(0, 0.0, tuple(range(4)))])


def test_duplicate_policy_name_is_rejected() -> None:
    with pytest.raises(ConfigError, match="twice"):
        register(type("Again", (_Echo,), {"name": "fcfs"}))


class TestBadInput:
    def test_request_larger_than_the_device(self) -> None:
        loop, _, _, cluster = make_engine(device_blocks=5)
        with pytest.raises(SimError, match="capacity too small"):
            run_requests(cluster, loop, [req(0, 0.0, tuple(range(10)))])

    def test_unknown_names_list_the_known_ones(self) -> None:
        with pytest.raises(ConfigError, match="expected one of"):
            run(SimConfig(policy={"name": "magic"}, workload={"name": "longdoc", "num_requests": 2}))
        with pytest.raises(ConfigError, match="known"):
            run(SimConfig(hardware="tpu-v9"))
        with pytest.raises(ConfigError, match="known"):
            run(SimConfig(model="gpt-9"))
        with pytest.raises(ConfigError, match="known"):
            run(SimConfig(workload={"name": "nope"}))

    def test_bad_rates_and_keys(self) -> None:
        with pytest.raises(ConfigError, match="rate_per_s"):
            run(SimConfig(workload={"name": "longdoc", "rate_per_s": 0}))
        with pytest.raises(ConfigError, match="rate_per_s"):
            run(SimConfig(workload={"name": "longdoc", "rate_per_s": -1.0}))
        with pytest.raises(ConfigError, match="unknown sim config key"):
            SimConfig.from_dict({"enginez": 2})
        with pytest.raises(ConfigError, match="P/D"):
            SimConfig(prefill_engines=1)

    def test_missing_and_malformed_traces(self, tmp_path: Path) -> None:
        with pytest.raises(TraceError, match=r"missing\.jsonl"):
            run(
                SimConfig(
                    block_tokens=512, workload={"name": "mooncake", "path": str(tmp_path / "missing.jsonl")}
                )
            )
        bad = tmp_path / "bad.jsonl"
        bad.write_text(
            '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n{oops\n'
        )
        with pytest.raises(TraceError, match=r":2"):
            run(SimConfig(block_tokens=512, workload={"name": "mooncake", "path": str(bad)}))

    def test_model_too_big_for_the_gpu(self) -> None:
        with pytest.raises(SimError, match="no HBM"):
            run(
                SimConfig(
                    hardware="l40s", model="llama-3.1-70b", workload={"name": "longdoc", "num_requests": 2}
                )
            )


class _SwapOnce(Policy):
    """FCFS, but swaps the newest decoding request out once, and back in when it can."""

    name = "test-swap-once"

    def __init__(self) -> None:
        self.swapped_out = False

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        decision = SchedulerDecision()
        decoding = [r for r in view.running if r.computed_tokens >= r.prompt_tokens]
        if not self.swapped_out and len(decoding) >= 2:
            self.swapped_out = True
            decision.swap_out.append(decoding[-1].req_id)
            decision.decode = [r.req_id for r in decoding[:-1]]
            return decision
        decision.swap_in = [r.req_id for r in view.swapped]
        budget = schedule_running(view, decision)
        admit_fcfs(view, decision, budget, load_mode=None)
        return decision


class _WriteBack(Policy):
    name = "test-write-back"

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        decision = SchedulerDecision()
        budget = schedule_running(view, decision)
        admit_fcfs(view, decision, budget, load_mode=LoadMode.SYNC)
        return decision


def _register(cls: type[Policy]) -> None:
    if cls.name not in policy_names():
        register(cls)


def test_swap_out_and_in_keeps_the_request_and_moves_its_kv() -> None:
    _register(_SwapOnce)
    loop, engine, metrics, cluster = make_engine(host_blocks=1000)
    engine.policy = make_policy("test-swap-once")
    requests = [req(i, 0.0, tuple(range(100 * i, 100 * i + 8)), output=20) for i in range(3)]
    run_requests(cluster, loop, requests)
    assert metrics.requests == 3 and metrics.preemptions == 0
    swapped_bytes = math.ceil((128 + 2) / BT) * engine.block_bytes  # prompt + tokens at swap time
    assert engine.host_link.bytes_moved[Direction.OUT] >= swapped_bytes
    assert engine.host_link.bytes_moved[Direction.IN] == engine.host_link.bytes_moved[Direction.OUT]
    assert engine.lower_tiers.swap_host_blocks == 0 and not engine.swapped
    assert engine.private_blocks == 0


def test_write_back_offloads_evicted_blocks_and_they_hit_later() -> None:
    _register(_WriteBack)
    loop, engine, metrics, cluster = make_engine(device_blocks=120, host_blocks=1000, offload="write_back")
    engine.policy = make_policy("test-write-back")
    a = tuple(range(100))
    run_requests(cluster, loop, [req(0, 0.0, a), req(1, 50.0, tuple(range(1000, 1110))), req(2, 100.0, a)])
    assert engine.host_link.bytes_moved[Direction.OUT] > 0, "evicted blocks were written back"
    assert metrics.hit_tokens[1] > 0, "and the third request loads them from host"


def test_remote_tier_serves_what_host_and_ssd_dropped() -> None:
    config = SimConfig(
        name="remote",
        policy={"name": "lmcache"},
        block_tokens=16,
        device_blocks=4000,  # ~3 documents
        host_capacity_bytes="300MiB",  # a fraction of one document
        remote_capacity_bytes="inf",
        workload={"name": "longdoc", "num_requests": 40, "rate_per_s": 0.5, "num_documents": 8},
    )
    result = run(config)
    assert result["hit_rate_tokens"]["remote"] > 0
    assert result["links"]["remote"]["bytes_out"] > 0 and result["links"]["remote"]["bytes_in"] > 0
    assert result["unfinished_requests"] == 0


def test_ssd_tier_is_striped_over_the_nodes_ssds() -> None:
    config = SimConfig(
        name="ssd",
        tp=2,  # two GPUs' share of the node: two SSDs
        policy={"name": "lmcache"},
        block_tokens=16,
        device_blocks=4000,
        host_capacity_bytes="300MiB",
        ssd_capacity_bytes="2TiB",
        workload={"name": "longdoc", "num_requests": 40, "rate_per_s": 0.5, "num_documents": 8},
    )
    result = run(config)
    assert result["hit_rate_tokens"]["ssd"] > 0
    ssd_links = [v for k, v in result["links"].items() if k.startswith("ssd")]
    assert len(ssd_links) >= 2
    reads = [link["bytes_in"] for link in ssd_links]
    assert max(reads) - min(reads) <= len(ssd_links)  # even split, to the byte


def test_waiting_views_are_built_as_read_and_closed_after_the_step() -> None:
    """Issue 20: a step costs what the policy reads; the head's views are built lazily, match the
    prefix index at the step, and cannot be read once the step's decision is taken."""
    _, engine, _, _ = make_engine()
    requests = [req(i, 0.0, (1, 2, 100 + i)) for i in range(5)]
    for r in requests:
        engine.requests[r.req_id] = SimRequest(r)
        engine._enqueue(engine.requests[r.req_id])
    engine.tree.insert((1, 2), Tier.DEVICE, 0.0)
    view = engine.view()
    assert isinstance(view.waiting, WaitingViews)
    assert len(view.waiting) == 5
    head = view.waiting[0]
    assert head.req_id == 0 and head.cached_tokens == (2 * BT, 0, 0, 0)
    assert view.waiting[0] is head  # built once
    assert [r.req_id for r in view.waiting[1:3]] == [1, 2]
    assert view.waiting[-1].req_id == 4
    with pytest.raises(IndexError):
        view.waiting[5]
    view.waiting.close()
    assert view.waiting[2].req_id == 2  # already built: still readable
    with pytest.raises(SimError, match="after the step"):
        view.waiting[3]


def test_an_admitted_requests_view_is_rebuilt_only_when_it_changes() -> None:
    r = SimRequest(req(7, 0.0, (1, 2)), phase=Phase.SWAPPED, computed_tokens=2 * BT, admitted=True)
    first = admitted_view(r)
    assert admitted_view(r) is first
    r.generated_tokens += 1
    second = admitted_view(r)
    assert second is not first and second.generated_tokens == 1
    r.phase = Phase.RUNNING
    assert admitted_view(r).phase is Phase.RUNNING


def test_a_built_view_is_the_frozen_request_view_of_its_fields() -> None:
    """Views are filled through a twin class and become RequestViews: equal to the constructor's,
    of its type, hashable and frozen like it."""
    r = SimRequest(req(7, 1.5, (1, 2)), phase=Phase.RUNNING, computed_tokens=2 * BT, admitted=True)
    r.generated_tokens = 3
    view = admitted_view(r)
    expected = RequestView(7, 1.5, Phase.RUNNING, r.req.prompt_tokens, 2 * BT, 3, NO_TOKENS, 0, 0, (1, 2))
    assert type(view) is RequestView and view == expected and repr(view) == repr(expected)
    assert hash(view) == hash(expected)
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.generated_tokens = 4  # type: ignore[misc]


def test_the_run_has_one_block_size() -> None:
    """The config's ``block_tokens`` cuts the workload's block keys; a workload section may not set
    another (it used to win silently over the engines' block size)."""
    base = SimConfig(block_tokens=32, workload={"name": "longdoc", "num_requests": 3})
    requests = list(workload(base))
    assert all(len(r.block_keys) == math.ceil(r.prompt_tokens / 32) for r in requests)
    with pytest.raises(ConfigError, match="top level"):
        list(workload(base.with_overrides(workload={**base.workload, "block_tokens": 16})))
    same = base.with_overrides(workload={**base.workload, "block_tokens": 32})
    with pytest.warns(DeprecationWarning, match="top-level `block_tokens`"):
        assert [r.block_keys for r in workload(same)] == [r.block_keys for r in requests]
