"""Strata (Strata §4.2-4.3, Algorithm 1): the paper's scheduling examples on hand-built views, the
I/O model of the policy and its ablations, a short end-to-end simulation, the engine/cluster hooks
it relies on, and the quick reproduction."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.sched import make_policy
from kvtier.sched.base import LoadMode, Phase, RequestView, SchedulerDecision, SchedulerView
from kvtier.sched.load_path import DECODE_INTERFERENCE, PREFILL_INTERFERENCE, LoadPath, load_engine
from kvtier.sched.strata import Batch, Candidate, Strata, defer_delay_hits
from kvtier.sim.cluster import Cluster
from kvtier.sim.config import SimConfig
from kvtier.sim.core import EventLoop
from kvtier.sim.cost import RooflineCostModel
from kvtier.sim.engine import Engine, EngineConfig
from kvtier.sim.hardware import load_hardware
from kvtier.sim.metrics import Metrics
from kvtier.sim.models import load_model
from kvtier.sim.request import Request
from kvtier.sim.resources import Link
from kvtier.sim.run import run
from kvtier.tiers import Tier

BT = 32
DOC = 4096  # tokens of a document context: 128 blocks


class Cost:
    """Llama-8B-like estimates on an H200: 50 GB/s whole-object loads, ~22% of it per page, priced
    on the engine's load path (Strata's GPU-assisted kernels unless given another)."""

    def __init__(self, path: LoadPath) -> None:
        self.path = path

    def prefill_s(self, new_tokens: int, context_tokens: int) -> float:
        return 1e-3 + 3e-5 * new_tokens + 1e-9 * new_tokens * context_tokens

    def load_s(self, tokens: int, tier: Tier, mode: LoadMode) -> float:
        segment_tokens = self.path.segment_tokens(mode, tokens)
        per_token = 2.6e-6 if segment_tokens is None or segment_tokens >= 256 else 1.2e-5
        return tokens * per_token


def doc_keys(doc: int, blocks: int = DOC // BT) -> tuple[int, ...]:
    return tuple(doc * 10_000 + i for i in range(blocks))


def hit(rid: int, doc: int, host: int = DOC, device: int = 0, question: int = 32, **kw: int) -> RequestView:
    """A query on ``doc``: its context cached on host (and/or device), ``question`` new tokens."""
    keys = (*doc_keys(doc), 1_000_000 + rid)
    return RequestView(
        rid,
        float(rid),
        Phase.WAITING,
        DOC + question,
        0,
        0,
        cached_tokens=(device, host, 0, 0),
        block_keys=keys,
        **kw,
    )


def miss(rid: int, doc: int, tokens: int = DOC, **kw: int) -> RequestView:
    keys = (*doc_keys(doc, tokens // BT), 1_000_000 + rid)
    return RequestView(rid, float(rid), Phase.WAITING, tokens + 32, 0, 0, block_keys=keys, **kw)


def view(
    waiting: tuple[RequestView, ...] = (),
    running: tuple[RequestView, ...] = (),
    fetching: tuple[RequestView, ...] = (),
    max_batch_tokens: int = 8192,
    free_device_blocks: int = 100_000,
    load: str = "gpu_kernel",
) -> SchedulerView:
    return SchedulerView(
        now_s=0.0,
        waiting=waiting,
        running=running,
        fetching=fetching,
        swapped=(),
        free_device_blocks=free_device_blocks,
        free_host_blocks=None,
        block_tokens=BT,
        max_batch_tokens=max_batch_tokens,
        max_running=256,
        num_layers=32,
        cost=Cost(load_engine(load)),
    )


def prefilled(d: SchedulerDecision) -> list[int]:
    return [rid for rid, _ in d.prefill]


def loads(d: SchedulerDecision) -> dict[int, tuple[LoadMode, int]]:
    return {o.req_id: (o.mode, o.tokens) for o in d.loads}


# ------------------------------------------------------------------------------------------------
# Balanced batch formation (§4.3.2, Algorithm 1, Fig. 7)


def test_fig7_batch_pairs_a_host_hit_with_a_miss_not_with_another_load() -> None:
    """Fig. 7: (C, D0) would stall on two loads; Strata forms (C, F), overlapping C's load with F."""
    c, d0, f = hit(0, doc=1), hit(1, doc=2), miss(2, doc=3)
    v = view((c, d0, f), max_batch_tokens=32 + DOC + 32)  # C's question and F fill the budget
    strata = make_policy("strata").schedule(v)
    assert prefilled(strata) == [0, 2]
    assert loads(strata) == {0: (LoadMode.LAYERWISE, DOC)}  # F's compute hides C's load: no bubble
    fcfs = make_policy("hicache").schedule(v)
    assert prefilled(fcfs) == [0, 1, 2]  # FCFS takes C and D0 first: two loads, little compute


def test_bundle_hit_joins_its_leader_and_shares_its_load() -> None:
    """Fig. 7's (D0, D1): same context, loaded once. The follower waits for the shared load and
    prefills with its leader; the unrelated host hit C is deprioritised, then fills the batch."""
    d0, c, d1 = hit(0, doc=1), hit(1, doc=2), hit(2, doc=1)
    policy = Strata()
    d = policy.schedule(view((d0, c, d1)))
    assert prefilled(d) == [0, 1]  # D1 rides on D0's load: not dispatched with a load of its own
    assert loads(d) == {0: (LoadMode.ASYNC, DOC), 1: (LoadMode.ASYNC, DOC)}
    assert 2 not in loads(d)


def test_deprioritised_requests_keep_their_order_and_fill_the_batch() -> None:
    """No starvation: the batch starts with the queue's head even if it is loading-bound, and the
    deprioritised list is appended in arrival order when the batch has room."""
    q = (hit(0, doc=1), hit(1, doc=2), hit(2, doc=3), miss(3, doc=4, tokens=1024))
    d = make_policy("strata").schedule(view(q))
    assert prefilled(d) == [0, 3, 1, 2]


def test_a_request_without_load_is_never_loading_bound() -> None:
    v = view()
    batch = Batch(v, 8192, 256, 100_000, 1.0, "tokens", 100)
    batch.add(Candidate.of(hit(0, doc=1), BT))  # 4096 loaded over 32 new: far over a bound of 1
    assert not batch.loading_bound(Candidate.of(hit(1, doc=2, host=0, device=DOC), BT))  # device hit
    assert not batch.loading_bound(Candidate.of(miss(2, doc=3), BT))
    assert batch.loading_bound(Candidate.of(hit(3, doc=4), BT))


def test_bundle_hits_join_right_after_their_leader() -> None:
    """AddBundleHit: D1 joins with D0 before the miss F behind D0 is considered, so F gets the
    budget left after both questions."""
    d0, f, d1 = hit(0, doc=1), miss(1, doc=3), hit(2, doc=1)
    d = make_policy("strata").schedule(view((d0, f, d1), max_batch_tokens=64 + 100))
    assert d.prefill == [(0, 32), (1, 100)]  # D1 counted in the batch, dispatched after the load
    assert loads(d) == {0: (LoadMode.ASYNC, DOC)}


def test_the_ratio_bound_is_in_tokens_loaded_per_new_token() -> None:
    """Fig. 1's x-axis: with a bound above the batch's ratio (128 + 128 over 64), nothing waits."""
    q = (hit(0, doc=1), hit(1, doc=2), miss(2, doc=3))
    budget = 64 + DOC
    assert prefilled(
        make_policy("strata", load_compute_ratio=200.0).schedule(view(q, max_batch_tokens=budget))
    ) == [0, 1, 2]
    assert prefilled(
        make_policy("strata", load_compute_ratio=100.0).schedule(view(q, max_batch_tokens=budget))
    ) == [0, 2]


def test_a_request_that_does_not_fit_ends_formation() -> None:
    big = miss(0, doc=1, tokens=8192)  # 257 blocks
    d = make_policy("strata").schedule(view((big, hit(1, doc=2)), free_device_blocks=200))
    assert d.prefill == []


# ------------------------------------------------------------------------------------------------
# Deferral on delay hit (§4.3.1)


def test_in_flight_context_defers_beyond_the_threshold_only() -> None:
    deferred = view((miss(0, doc=1, in_flight_tokens=128),))
    assert defer_delay_hits(deferred, 100) == ([], [0])
    small = view((miss(0, doc=1, in_flight_tokens=96),))  # 96 <= 100 active token matches
    assert [r.req_id for r in defer_delay_hits(small, 100)[0]] == [0]
    assert make_policy("strata").schedule(deferred).prefill == []


def test_in_queue_marks_defer_the_later_request_of_a_shared_new_context() -> None:
    """Two queued requests on one uncached document: the first computes it, the second waits for
    the soon-hot cache instead of computing it again in the same batch."""
    a = miss(0, doc=1, in_queue_tokens=DOC)
    b = miss(1, doc=1, in_queue_tokens=DOC)
    other = miss(2, doc=2, in_queue_tokens=DOC)  # its mate queues behind it: not a delay hit
    mate = miss(3, doc=2, in_queue_tokens=DOC)
    ready, deferred = defer_delay_hits(view((a, b, other, mate)), 100)
    assert [r.req_id for r in ready] == [0, 2]
    assert deferred == [1, 3]
    d = make_policy("strata").schedule(view((a, b), max_batch_tokens=16_384))
    assert prefilled(d) == [0]
    assert prefilled(make_policy("hicache").schedule(view((a, b), max_batch_tokens=16_384))) == [0, 1]


def test_a_delay_hit_needs_more_claimed_tokens_than_the_threshold_below_and_above_a_block() -> None:
    """The keys a request ahead claimed count in blocks: ``b`` shares 2 new blocks (64 tokens) with
    ``a``, so thresholds below 64 defer it and 64 or more do not (one claimed key decides below
    one block, a count above it); a request with in-flight tokens over the threshold is deferred
    whatever it shares."""
    a = miss(0, doc=1, tokens=2 * BT, in_queue_tokens=DOC)
    b = miss(1, doc=1, tokens=2 * BT, in_queue_tokens=DOC)
    c = miss(2, doc=2, tokens=2 * BT, in_queue_tokens=DOC, in_flight_tokens=DOC)
    for threshold in (0, 1, BT - 1, BT, 2 * BT - 1):
        assert defer_delay_hits(view((a, b, c)), threshold)[1] == [1, 2], threshold
    for threshold in (2 * BT, 3 * BT):
        assert defer_delay_hits(view((a, b, c)), threshold)[1] == [2], threshold


def test_deferral_can_be_switched_off() -> None:
    d = make_policy("strata", defer=False).schedule(view((miss(0, doc=1, in_flight_tokens=DOC),)))
    assert prefilled(d) == [0]


# ------------------------------------------------------------------------------------------------
# Bubble filling (§4.3.3) and the I/O model (§4.2, Fig. 5)


def test_loading_bound_batch_loads_async_while_decodes_run() -> None:
    decoding = RequestView(9, 0.0, Phase.RUNNING, 100, 100, 3)
    d = make_policy("strata").schedule(view((hit(0, doc=1),), running=(decoding,)))
    assert d.decode == [9]
    (order,) = d.loads
    assert order.mode is LoadMode.ASYNC
    kernels = load_engine("gpu_kernel")  # Strata's load path carries it
    assert kernels.segment_tokens(order.mode, order.tokens) is None  # whole page-first objects
    assert kernels.slowdown(order.mode) == DECODE_INTERFERENCE
    off = make_policy("strata", bubble_filling=False).schedule(view((hit(0, doc=1),), running=(decoding,)))
    assert off.loads[0].mode is LoadMode.LAYERWISE


def test_compute_bound_batch_overlaps_its_load_layer_by_layer() -> None:
    d = make_policy("strata").schedule(view((hit(0, doc=1), miss(1, doc=2, tokens=8000))))
    (order,) = d.loads
    assert order.mode is LoadMode.LAYERWISE
    kernels = load_engine("gpu_kernel")
    assert kernels.segment_tokens(order.mode, order.tokens) == DOC  # one gather kernel per layer
    assert kernels.slowdown(order.mode) == PREFILL_INTERFERENCE
    assert order.priority == 0  # ahead of queued asynchronous batches


def test_asynchronous_batches_queue_in_order_and_at_most_two() -> None:
    policy = Strata()
    first = policy.schedule(view((hit(0, doc=1),)))
    assert first.loads[0].priority == 1
    fetching0 = RequestView(0, 0.0, Phase.FETCHING, DOC + 32, 0, 0)
    second = policy.schedule(view((hit(1, doc=2),), fetching=(fetching0,)))
    assert second.loads[0].priority == 2  # lands after the first batch, not sharing the link
    fetching1 = RequestView(1, 1.0, Phase.FETCHING, DOC + 32, 0, 0)
    third = policy.schedule(view((hit(2, doc=3), miss(3, doc=4)), fetching=(fetching0, fetching1)))
    assert third.loads == []  # the I/O queue is full: no new load
    assert prefilled(third) == [3]  # a miss still fills the bubble


def test_ablations_vary_only_the_io_or_only_the_schedule() -> None:
    """Fig. 9's ablations: the same decisions as Strata / HiCache, priced on the other load path."""
    q = (hit(0, doc=1), hit(1, doc=2), miss(2, doc=3))
    v = view(q, max_batch_tokens=32 + DOC + 32, load="per_page")
    sched = make_policy("strata_sched").schedule(v)
    assert prefilled(sched) == [0, 2]  # Strata's batch
    assert sched == make_policy("strata").schedule(v)  # the schedule is Strata's
    io = make_policy("strata_io").schedule(view(q, max_batch_tokens=32 + DOC + 32))
    assert prefilled(io) == [0, 1, 2]  # FCFS
    assert {o.mode for o in io.loads} == {LoadMode.LAYERWISE}
    assert io == make_policy("hicache").schedule(view(q, max_batch_tokens=32 + DOC + 32))


def test_storage_prefix_of_a_queued_request_is_prefetched_to_host() -> None:
    stored = RequestView(
        5, 0.0, Phase.WAITING, DOC + 32, 0, 0, cached_tokens=(0, 0, DOC, 0), block_keys=doc_keys(7)
    )
    chunk = RequestView(9, 0.0, Phase.RUNNING, 20_000, 1000, 0)  # takes the whole token budget
    d = make_policy("strata").schedule(view((stored,), running=(chunk,)))
    (order,) = d.loads
    assert (order.req_id, order.target, order.tokens) == (5, Tier.HOST, DOC)
    assert make_policy("strata", prefetch=False).schedule(view((stored,), running=(chunk,))).loads == []


def test_bad_parameters_are_rejected() -> None:
    with pytest.raises(ConfigError):
        make_policy("strata", io="dma")
    with pytest.raises(ConfigError):
        make_policy("strata", ratio_unit="bytes")
    with pytest.raises(ConfigError):
        make_policy("strata", max_loading_batches=0)


# ------------------------------------------------------------------------------------------------
# Engine and cluster hooks (block keys in views, the client's concurrency cap)


def _engine(policy: str, loop: EventLoop, metrics: Metrics) -> Engine:
    hw = load_hardware("h200")
    link = Link(loop, "host", hw.host_link.h2d_bytes_per_s, hw.host_link.d2h_bytes_per_s, True, 5e-6)
    cost = RooflineCostModel(hw, load_model("llama-3.1-8b"))
    config = EngineConfig(block_tokens=BT, device_blocks=20_000, host_blocks=100_000)
    return Engine(loop, "e0", config, cost, make_policy(policy), metrics, link)


def test_views_carry_the_prompts_block_keys() -> None:
    loop, metrics = EventLoop(), Metrics()
    engine = _engine("strata", loop, metrics)
    keys = (11, 12, 13)
    engine.stepping = True  # hold the step loop: only the view is wanted
    engine.submit(Request(0, 0.0, 3 * BT, 1, keys))
    assert engine.view().waiting[0].block_keys == keys


def test_client_cap_sends_a_held_request_when_one_finishes() -> None:
    loop, metrics = EventLoop(), Metrics()
    engine = _engine("strata", loop, metrics)
    cluster = Cluster(loop, metrics, [engine], max_outstanding=1)
    reqs = [Request(i, 0.0, 2 * BT, 2, (100 * i, 100 * i + 1)) for i in range(2)]
    cluster.feed(iter(reqs))
    loop.run()
    assert metrics.requests == 2
    assert reqs[1].arrival_s > 0.0  # sent when request 0 finished: its TTFT starts then
    assert metrics.ttft_s.max < 0.1
    with pytest.raises(ConfigError):
        Cluster(loop, metrics, [engine], max_outstanding=0)
    with pytest.raises(ConfigError):
        SimConfig(max_outstanding_requests=0)


# ------------------------------------------------------------------------------------------------
# End to end


def _burst(policy: str, **overrides: object) -> dict[str, object]:
    """Four queries on one new 8K-token document arriving together, then more later."""
    config = SimConfig.from_dict(
        {
            "hardware": "h200",
            "model": "llama-3.1-8b",
            "policy": {"name": policy},
            "block_tokens": BT,
            "host_capacity_bytes": "100GB",
            "workload": {
                "name": "longdoc",
                "num_requests": 40,
                "rate_per_s": 50.0,
                "num_documents": 2,
                "doc_tokens_mean": 8000,
                "doc_tokens_min": 4000,
            },
            **overrides,
        }
    )
    return run(config)


def test_strata_runs_a_longdoc_burst_and_avoids_delay_hit_recomputation() -> None:
    strata, hicache = _burst("strata"), _burst("hicache")
    assert strata["requests"] == hicache["requests"] == 40
    assert strata["unfinished_requests"] == 0
    hit_strata = strata["hit_rate_tokens"]["total"]  # type: ignore[index]
    hit_hicache = hicache["hit_rate_tokens"]["total"]  # type: ignore[index]
    # HiCache computes a document again for requests admitted while it is being computed (~6K of
    # 320K prompt tokens); Strata's deferred requests hit it instead.
    assert hit_strata > hit_hicache + 0.015
    assert strata["ttft_s"]["mean"] < hicache["ttft_s"]["mean"]  # type: ignore[index]
    for name in ("strata_io", "strata_sched"):
        assert _burst(name)["requests"] == 40


def test_quick_reproduction_returns_rows(tmp_path: Path) -> None:
    from kvtier.sim import reproduce

    rows = reproduce.run("strata", tmp_path, quick=True)
    assert all(r.paper == "strata" and math.isfinite(r.kvtier_ratio) for r in rows)
    ratio = {r.metric.rpartition(", ")[2]: r for r in rows}
    assert set(ratio) == {
        "Strata / hicache",
        "Strata / lmcache",
        "strata_io / hicache",
        "strata_sched / hicache",
    }
    # The headline (§5.2, Fig. 8 LooGLE Llama-8B: "up to 3.2x, 2.6x higher throughput at the same TTFT"
    # than SGLang-HiCache, vLLM-LMCache; §5.3.1, Fig. 9: Strata-IO and Strata-Schedule-Only "up to
    # 2.3x and 1.8x higher peak throughput" than HiCache): every ratio above 1, and none above the
    # paper's "up to". The quick run (one overload rate, a fifth of the queries) gives 1.07-1.26
    # today; 1.03 leaves margin without accepting a tie.
    for metric, row in ratio.items():
        assert row.paper_ratio is not None
        assert 1.03 < row.kvtier_ratio <= row.paper_ratio, (metric, row.kvtier_ratio, row.paper_ratio)
    # LMCache is the stronger baseline on LooGLE (the paper's 2.6x against HiCache's 3.2x).
    assert ratio["Strata / hicache"].kvtier_ratio > ratio["Strata / lmcache"].kvtier_ratio
    assert (tmp_path / "strata_llama-3.1-8b.png").exists()
