"""Global schedulers: which engine of a cluster serves a request (beside the per-engine
:class:`~kvtier.sched.base.Policy`, which decides what one engine does each step).

One interface for every cluster shape. A :class:`GlobalScheduler` sees arriving requests as
:class:`PendingRequest` and the engines as :class:`EngineLoad` reports, grouped by role
(:class:`Role`: colocated or prefill engines, and decode engines of a P/D cluster), through a
:class:`ClusterState` the simulator implements; it places a request by calling
:meth:`ClusterState.place`. It places each arrival at once (``fetch_interval_s is None``: the
routers below) or queues arrivals and places them when the cluster calls :meth:`GlobalScheduler.fetch`,
at most every ``fetch_interval_s`` while something changed (DualPath §6.1's group fetches,
:class:`kvtier.sched.dualpath.DualPathScheduler`).

Routers (colocated engines, or the prefill side of a P/D cluster):

- ``round_robin``: engines in turn.
- ``least_loaded``: the engine with the fewest outstanding tokens (its report's ``unfinished_tokens``).
- ``prefix_aware``: the engine holding the longest cached prefix of the request, least loaded among
  equals; least loaded when no engine holds any.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from kvtier.errors import ConfigError


class Role(Enum):
    PREFILL = "prefill"  # colocated engines, or the prefill engines of a P/D cluster
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What an engine reports to the global scheduler (DualPath §6.1's ``r``, ``t``, ``q``)."""

    engine_id: int
    group: int
    unfinished_requests: int  # r_e: requests assigned to it and not finished
    unfinished_tokens: int  # t_e: their total tokens (a router's load)
    read_queue_tokens: int  # q: the disk read queue of its node, in tokens
    free_hbm_tokens: int = 0  # DEs: KV tokens its free HBM holds


@dataclass(frozen=True, slots=True)
class PendingRequest:
    """A request waiting for an engine: its prompt tokens (the load proxy, §6.1), hit tokens and
    output tokens (with the prompt, what it takes on a decode engine)."""

    req_id: int
    tokens: int
    hit_tokens: int = 0
    output_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Placement:
    """``req_id`` goes to ``engine_id`` in ``role``; ``read_side`` ("pe" or "de"): where its
    stored KV is read to (DualPath §4.1), None where the cluster has one read path."""

    req_id: int
    engine_id: int
    role: Role = Role.PREFILL
    read_side: str | None = None


class ClusterState(Protocol):
    """What a global scheduler reads of a cluster and asks of it."""

    def groups(self, role: Role) -> int:
        """How many groups the engines of ``role`` form (1 where the cluster has no groups)."""
        ...

    def loads(self, role: Role, group: int | None = None) -> Sequence[EngineLoad]:
        """The reports, now, of the engines of ``role``: of one group, or all (in group order)."""
        ...

    def read_queue_tokens(self, engine_id: int) -> int:
        """The disk read queue, in tokens, of the node of ``engine_id`` now."""
        ...

    def prefix_blocks(self, req_id: int, engine_id: int) -> int:
        """Blocks of the request's prefix cached on ``engine_id``."""
        ...

    def place(self, placement: Placement) -> None: ...


class GlobalScheduler:
    """Places requests on a cluster's engines (see the module docs)."""

    name = "global"
    #: None: every arrival is placed when it arrives; else arrivals queue and :meth:`fetch` places
    #: them, called at most this often while something changed.
    fetch_interval_s: float | None = None
    #: The cluster shape it needs: "engines" (colocated or P/D engines, each with its own links) or
    #: "node_groups" (DualPath: engines grouped by node, storage and compute NICs,
    #: :class:`kvtier.sim.topology.Topology`).
    topology = "engines"

    def arrive(self, req: PendingRequest, cluster: ClusterState) -> None:
        raise NotImplementedError

    def fetch(self, cluster: ClusterState) -> None:
        """Places queued requests (schedulers with a ``fetch_interval_s``)."""

    def pending(self) -> int:
        """Requests queued and not yet placed."""
        return 0


class RoundRobin(GlobalScheduler):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def arrive(self, req: PendingRequest, cluster: ClusterState) -> None:
        engines = _engines(cluster)
        if len(engines) > 1:
            self._next = (self._next + 1) % len(engines)
            engines = engines[self._next :]
        cluster.place(Placement(req.req_id, engines[0].engine_id))


class LeastLoaded(GlobalScheduler):
    name = "least_loaded"

    def arrive(self, req: PendingRequest, cluster: ClusterState) -> None:
        cluster.place(Placement(req.req_id, least_loaded(_engines(cluster))))


class PrefixAware(GlobalScheduler):
    name = "prefix_aware"

    def arrive(self, req: PendingRequest, cluster: ClusterState) -> None:
        engines = _engines(cluster)
        chosen = least_loaded(engines)
        if len(engines) > 1:
            hits = {e.engine_id: cluster.prefix_blocks(req.req_id, e.engine_id) for e in engines}
            best = max(engines, key=lambda e: (hits[e.engine_id], -e.unfinished_tokens))
            if hits[best.engine_id] > 0:
                chosen = best.engine_id
        cluster.place(Placement(req.req_id, chosen))


def least_loaded(engines: Sequence[EngineLoad]) -> int:
    """The engine with the fewest unfinished tokens (the first of equals)."""
    return min(engines, key=lambda e: e.unfinished_tokens).engine_id


def _engines(cluster: ClusterState) -> Sequence[EngineLoad]:
    engines = cluster.loads(Role.PREFILL)
    if not engines:
        raise ConfigError("a cluster needs at least one engine")
    return engines


ROUTERS: dict[str, type[GlobalScheduler]] = {cls.name: cls for cls in (RoundRobin, LeastLoaded, PrefixAware)}


def make_router(name: str) -> GlobalScheduler:
    if name not in ROUTERS:
        raise ConfigError(f"unknown router {name!r}; expected one of {list(ROUTERS)}")
    return ROUTERS[name]()
