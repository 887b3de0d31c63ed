"""A replay that stalled: its events ran out with requests unfinished.

Every request a simulated engine holds is moved on by an event (a step's end, a transfer landing, a
wake); an engine whose policy plans nothing while its running requests wait for device blocks, with
nothing in flight, schedules none, and the event loop ends with those requests still there. That is
a stall, not a result (docs/simulator.md): :func:`check_not_stalled` raises, naming each engine that
still holds requests. A replay cut by its horizon (``max_sim_s``) has events left and is not one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvtier.errors import SimError
from kvtier.sim.core import EventLoop
from kvtier.sim.engine import Engine
from kvtier.tiers import Tier


class Replayed(Protocol):
    def unfinished_requests(self) -> int: ...


def check_not_stalled(loop: EventLoop, cluster: Replayed, engines: Sequence[Engine], steps: int) -> None:
    """Raises :class:`SimError` if ``loop`` has no event left while ``cluster`` has unfinished
    requests; ``engines`` are the cluster's engines (described where they hold requests), ``steps``
    the run's step count so far."""
    unfinished = cluster.unfinished_requests()
    if unfinished == 0 or not loop.exhausted():
        return
    stuck = "; ".join(describe(e) for e in engines if e.requests) or "no engine holds them"
    raise SimError(
        f"the replay stalled at {loop.now_s:.6g} s after {steps} steps with {unfinished} requests "
        f"unfinished: no event left can move them ({stuck}). The usual cause: the policy planned "
        "nothing while its requests wait for blocks nothing in flight will free"
    )


def describe(e: Engine) -> str:
    """One engine's state at a stall: its requests by phase, its free blocks, its policy."""
    host = e.lower_tiers.free_blocks(Tier.HOST) if Tier.HOST in e.lower_tiers else 0
    return (
        f"engine {e.name!r}, policy {e.policy.name!r}: {len(e.running)} running, {len(e.waiting)} waiting, "
        f"{len(e.swapped)} swapped, {len(e.fetching)} fetching, {len(e.incoming)} incoming; "
        f"{e.free_device_blocks()} of {e.config.device_blocks} device blocks free, {host} host blocks free"
    )
