"""``replay`` runs the event loop with the cyclic collector's young-generation threshold raised,
and restores the caller's threshold however the run ends."""

from __future__ import annotations

import gc
from types import SimpleNamespace
from typing import cast

import pytest

from kvtier.errors import SimError
from kvtier.sim.run import Simulation, replay


class _Loop:
    def __init__(self) -> None:
        self.thresholds: list[tuple[int, int, int]] = []

    def run(self, until_s: float | None = None) -> None:
        self.thresholds.append(gc.get_threshold())
        raise SimError("the loop failed")


def test_replay_raises_the_threshold_and_restores_it_when_the_run_fails() -> None:
    before = gc.get_threshold()
    loop = _Loop()
    with pytest.raises(SimError, match="the loop failed"):
        replay(cast(Simulation, SimpleNamespace(loop=loop)))
    assert loop.thresholds == [(20_000, *before[1:])]
    assert gc.get_threshold() == before
