"""Global schedulers (kvtier.sched.placement): the routers and DualPath's, on a hand-built cluster."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvtier.errors import ConfigError
from kvtier.sched import make_policy
from kvtier.sched.dualpath import FETCH_INTERVAL_S, DualPath, DualPathScheduler
from kvtier.sched.placement import (
    EngineLoad,
    PendingRequest,
    Placement,
    Role,
    make_router,
)


class FakeCluster:
    """Engines with fixed loads by role and group; records placements, and a placed request adds
    its tokens to its engine (as a cluster's report would show next)."""

    def __init__(self, groups: dict[Role, list[list[int]]], queues: dict[int, int] | None = None) -> None:
        self.tokens = {eid: 0 for role in groups.values() for group in role for eid in group}
        self.groups_by_role = groups
        self.queues = queues or {}
        self.hits: dict[tuple[int, int], int] = {}
        self.placed: list[Placement] = []
        self.sizes: dict[int, int] = {}

    def groups(self, role: Role) -> int:
        return len(self.groups_by_role[role])

    def loads(self, role: Role, group: int | None = None) -> Sequence[EngineLoad]:
        chosen = range(self.groups(role)) if group is None else (group,)
        return [
            EngineLoad(eid, g, 0, self.tokens[eid], self.queues.get(eid, 0), free_hbm_tokens=10**9)
            for g in chosen
            for eid in self.groups_by_role[role][g]
        ]

    def read_queue_tokens(self, engine_id: int) -> int:
        return self.queues.get(engine_id, 0)

    def prefix_blocks(self, req_id: int, engine_id: int) -> int:
        return self.hits.get((req_id, engine_id), 0)

    def place(self, placement: Placement) -> None:
        self.placed.append(placement)
        self.tokens[placement.engine_id] += self.sizes.get(placement.req_id, 0)


def engines(*ids: int) -> FakeCluster:
    return FakeCluster({Role.PREFILL: [list(ids)], Role.DECODE: [[]]})


def test_least_loaded_takes_the_engine_with_fewest_tokens_first_of_equals() -> None:
    cluster = engines(0, 1, 2)
    cluster.tokens.update({0: 5, 1: 3, 2: 3})
    router = make_router("least_loaded")
    assert router.fetch_interval_s is None  # places on arrival
    router.arrive(PendingRequest(7, 100), cluster)
    assert cluster.placed == [Placement(7, 1, Role.PREFILL)]


def test_round_robin_cycles_from_the_second_engine_as_the_cluster_always_did() -> None:
    cluster, router = engines(0, 1, 2), make_router("round_robin")
    for rid in range(4):
        router.arrive(PendingRequest(rid, 1), cluster)
    assert [p.engine_id for p in cluster.placed] == [1, 2, 0, 1]


def test_prefix_aware_prefers_the_longest_cached_prefix_then_the_least_loaded() -> None:
    cluster, router = engines(0, 1, 2), make_router("prefix_aware")
    cluster.tokens.update({0: 0, 1: 9, 2: 4})
    cluster.hits.update({(1, 1): 3, (1, 2): 3})  # request 1: equal hits on engines 1 and 2
    router.arrive(PendingRequest(1, 10), cluster)
    router.arrive(PendingRequest(2, 10), cluster)  # request 2: no hit anywhere
    assert [p.engine_id for p in cluster.placed] == [2, 0]


def test_unknown_router_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown router"):
        make_router("random")


def dualpath(**params: object) -> DualPath:
    policy = make_policy("dualpath", **params)
    assert isinstance(policy, DualPath)
    return policy


def test_dualpath_scheduler_queues_arrivals_and_places_pe_then_de_at_a_fetch() -> None:
    """§6.1: a fetch gives each request a PE (least tokens), then a DE, and reads on the side
    whose node has the shorter queue (here the DE's)."""
    cluster = FakeCluster({Role.PREFILL: [[1, 2]], Role.DECODE: [[11, 12]]}, queues={1: 500, 2: 500})
    cluster.sizes = {1: 100, 2: 100}
    scheduler = DualPathScheduler(dualpath(), short_queue_tokens=1_000, unfinished_limit_tokens=10**6)
    assert scheduler.fetch_interval_s == FETCH_INTERVAL_S
    for rid in (1, 2):
        scheduler.arrive(PendingRequest(rid, 100, 90, 10), cluster)
    assert cluster.placed == [] and scheduler.pending() == 2
    scheduler.fetch(cluster)
    assert scheduler.pending() == 0
    prefill = [(p.req_id, p.engine_id) for p in cluster.placed if p.role is Role.PREFILL]
    decode = [(p.req_id, p.engine_id, p.read_side) for p in cluster.placed if p.role is Role.DECODE]
    assert prefill == [(1, 1), (2, 2)]
    assert sorted(e for _, e, _ in decode) == [11, 12] and {s for *_, s in decode} == {"de"}


def test_dualpath_round_robin_ablation_places_at_once_alternating_read_sides() -> None:
    cluster = FakeCluster({Role.PREFILL: [[1, 2]], Role.DECODE: [[11, 12, 13]]})
    scheduler = DualPathScheduler(dualpath(scheduler="round_robin"), 0, 1)
    assert scheduler.fetch_interval_s is None
    for rid in range(3):
        scheduler.arrive(PendingRequest(rid, 10), cluster)
    pairs = [(p.engine_id, p.role, p.read_side) for p in cluster.placed]
    assert pairs == [
        (1, Role.PREFILL, None),
        (11, Role.DECODE, "pe"),
        (2, Role.PREFILL, None),
        (12, Role.DECODE, "de"),
        (1, Role.PREFILL, None),
        (13, Role.DECODE, "pe"),
    ]


def test_the_global_scheduler_is_read_from_the_policy_class_without_building_it() -> None:
    from kvtier.sched.base import policy_class
    from kvtier.sim.config import SimConfig
    from kvtier.sim.run import global_scheduler

    assert policy_class("dualpath") is DualPath and DualPath.global_scheduler == "dualpath"
    assert global_scheduler(SimConfig(), policy_class("dualpath")) == "dualpath"
    router = global_scheduler(SimConfig(), policy_class("fcfs"))
    assert not isinstance(router, str) and router.name == "least_loaded"
    named = global_scheduler(SimConfig(router="round_robin"), policy_class("dualpath"))
    assert not isinstance(named, str) and named.name == "round_robin"
    with pytest.raises(ConfigError, match="unknown policy"):
        policy_class("no_such_policy")
