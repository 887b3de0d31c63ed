"""What the simulated engine's seams read of what owns them, declared once: the step sizes every
engine config has (the simulator's :class:`~kvtier.sim.config.SimConfig`, the reference engine's
``EngineConfig``) and the engine members both load orders (:mod:`kvtier.sim.loads`) and swaps
(:mod:`kvtier.sim.swap`) use. Each seam's own protocol adds what only it reads."""

from __future__ import annotations

from typing import Protocol

from kvtier.sim.core import EventLoop
from kvtier.sim.state import SimRequest
from kvtier.sim.tiers import LowerTiers


class StepSizes(Protocol):
    """The sizes that bound one engine step."""

    @property
    def block_tokens(self) -> int: ...
    @property
    def max_batch_tokens(self) -> int: ...
    @property
    def max_running(self) -> int: ...


class SeamOwner(Protocol):
    """The engine (:class:`kvtier.sim.engine.Engine`) as its load orders and swaps see it."""

    loop: EventLoop
    lower_tiers: LowerTiers
    running: list[SimRequest]

    def make_room(self, blocks: int) -> bool: ...
    def kick(self) -> None: ...
