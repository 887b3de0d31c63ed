"""A cluster's topology (kvtier.sim.topology), the shared arrivals (kvtier.sim.arrivals) and a
node-group engine as the decision executor's backend (kvtier.sim.gpu_engine)."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError, SimError
from kvtier.sched import make_policy
from kvtier.sched.base import SchedulerDecision, SchedulerView
from kvtier.sched.executor import execute
from kvtier.sched.placement import Role
from kvtier.sim.arrivals import Arrivals
from kvtier.sim.config import SimConfig
from kvtier.sim.core import EventLoop
from kvtier.sim.ep_cost import EpCost, PrefillEstimates
from kvtier.sim.gpu_engine import GpuEngine, GroupRequest, StepPlan, ViewShape
from kvtier.sim.hardware import load_hardware
from kvtier.sim.models import load_model
from kvtier.sim.request import Request
from kvtier.sim.topology import Topology


def config(**changes: object) -> SimConfig:
    base = SimConfig(hardware="h100-sxm", model="deepseek-v3.2", prefill_engines=16, decode_engines=32)
    return base.with_overrides(**changes)


def test_gpus_pack_into_nodes_one_group_per_node_prefill_first() -> None:
    hw = load_hardware("h100-sxm")
    topo = Topology.from_config(config(), hw, EventLoop())
    assert [len(topo.groups[r]) for r in (Role.PREFILL, Role.DECODE)] == [2, 4]
    assert all(len(g.engines) == hw.gpus_per_node for r in topo.groups for g in topo.groups[r])
    nodes = [g.engines[0].node.index for r in (Role.PREFILL, Role.DECODE) for g in topo.groups[r]]
    assert nodes == list(range(6))
    ids = [e.engine_id for r in (Role.PREFILL, Role.DECODE) for e in topo.engines(r)]
    assert len(set(ids)) == 48
    assert [link.name for link in topo.storage_nics()] == [
        "p0.snic",
        "p1.snic",
        "d0.snic",
        "d1.snic",
        "d2.snic",
        "d3.snic",
    ]
    assert topo.storage_nics()[0].bandwidth_bytes_per_s[0] == hw.storage_nic_bytes_per_s * hw.gpus_per_node


def test_engine_counts_must_fill_whole_nodes_and_need_both_roles() -> None:
    hw = load_hardware("h100-sxm")
    with pytest.raises(ConfigError, match="multiple of 8"):
        Topology.from_config(config(prefill_engines=12), hw, EventLoop())
    with pytest.raises(ConfigError):
        Topology.from_config(config(prefill_engines=0, decode_engines=0), hw, EventLoop())


def test_a_node_serves_its_reads_fifo_and_reports_the_queue_in_tokens() -> None:
    loop = EventLoop()
    node = (
        Topology.from_config(config(), load_hardware("h100-sxm"), loop)
        .groups[Role.PREFILL][0]
        .engines[0]
        .node
    )
    rate = node.snic.bandwidth_bytes_per_s[0]
    landed: list[tuple[str, float, int]] = []
    node.read(100, int(rate), int(rate), 1, lambda: landed.append(("a", loop.now_s, node.read_queue_tokens)))
    node.read(50, int(rate), int(rate), 1, lambda: landed.append(("b", loop.now_s, node.read_queue_tokens)))
    assert node.read_queue_tokens == 150 and node.reads_in_flight == 1
    loop.run()
    assert [(n, round(t, 6), q) for n, t, q in landed] == [("a", 1.0, 50), ("b", 2.0, 0)]


def test_arrivals_stream_one_ahead_and_turns_follow_their_parent() -> None:
    loop = EventLoop()
    seen: list[tuple[int, float]] = []
    arrivals = Arrivals(loop, lambda r: seen.append((r.req_id, loop.now_s)))
    reqs = [
        Request(1, 0.5, 10, 1, (1,)),
        Request(2, 0.0, 10, 1, (2,), parent_id=1, think_time_s=2.0),
        Request(3, 1.0, 10, 1, (3,)),
    ]
    arrivals.feed(iter(reqs))
    assert loop.pending() == 1  # only the first open-loop arrival is scheduled
    loop.run()
    assert seen == [(1, 0.5), (3, 1.0)]  # request 2 waits for its parent
    arrivals.finished(1, 3.0)
    loop.run()
    assert seen[-1] == (2, 5.0)


class Decodes:
    """A policy that decodes whatever runs (and names one request twice when asked)."""

    name = "decodes"

    def __init__(self, twice: bool = False) -> None:
        self.twice = twice

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        decision = SchedulerDecision(decode=[r.req_id for r in view.running])
        if self.twice:
            decision.decode *= 2
        return decision


def engine(role: Role, policy: object) -> tuple[GpuEngine, GroupRequest]:
    hw, model = load_hardware("h100-sxm"), load_model("deepseek-v3.2")
    slot = Topology.from_config(config(), hw, EventLoop()).engines(role)[0]
    shape = ViewShape(
        100, 64, model.num_layers, model.kv_bytes_per_token, PrefillEstimates(EpCost(hw, model))
    )
    requests: dict[int, GroupRequest] = {}
    e = GpuEngine(slot, role, policy, requests, shape)  # type: ignore[arg-type]
    r = GroupRequest(Request(1, 0.0, 128, 8, (1, 2)), hit_tokens=64, computed_tokens=128)
    r.pe = r.de = e.engine_id
    requests[1] = r
    e.queue.append(r)
    return e, r


def test_a_decode_engine_decodes_the_policys_batch_through_the_executor() -> None:
    de, r = engine(Role.DECODE, Decodes())
    assert de.plan(0.0).decode == [r]
    with pytest.raises(SimError, match="twice"):
        engine(Role.DECODE, Decodes(twice=True))[0].plan(0.0)


def test_a_prefill_engine_cannot_decode_nor_preempt() -> None:
    pe, r = engine(Role.PREFILL, Decodes())
    with pytest.raises(SimError, match="prefill engine cannot decode"):
        pe.plan(0.0)
    with pytest.raises(SimError, match="cannot preempt"):
        execute(SchedulerDecision(preempt=[1]), pe, StepPlan())
    dp = make_policy("dualpath")
    pe.policy = dp
    r.computed_tokens = r.hit_tokens  # waiting, its hit KV read: the policy prefills the rest
    assert pe.plan(0.0).prefill == [(r, 64)]
