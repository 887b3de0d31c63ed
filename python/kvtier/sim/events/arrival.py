"""A request reaches the cluster: route it to an engine (colocated or prefill) and queue it there."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.sim.request import Request

if TYPE_CHECKING:
    from kvtier.sim.cluster import Cluster


def deliver(cluster: Cluster, req: Request) -> None:
    cluster.route(req).submit(req)
