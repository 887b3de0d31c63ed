"""A request reaches the cluster: route it to an engine (colocated or prefill) and queue it there."""

from __future__ import annotations

from typing import Protocol

from kvtier.sim.request import Request


class Queue(Protocol):
    def submit(self, req: Request) -> None: ...


class Router(Protocol):
    """What an arrival needs of the cluster (:class:`kvtier.sim.cluster.Cluster`): so that this module
    sits below the cluster that imports it."""

    def route(self, req: Request) -> Queue: ...


def deliver(cluster: Router, req: Request) -> None:
    cluster.route(req).submit(req)
