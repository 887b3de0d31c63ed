"""The swapped requests' views are kept across steps until a swap changes them (issue 20): at every
step they are what building them afresh gives."""

from __future__ import annotations

import dataclasses

import pytest

import kvtier.sim.engine as sim_engine
from kvtier.bench.sim import config
from kvtier.sched.base import SchedulerView
from kvtier.sim.run import run
from kvtier.sim.view import ViewedEngine, admitted_view, build_view


# The engines' swap paths: vLLM's (a step's swaps land before the next view), plain (views are built
# while copies are in flight), SuperInfer's pipeline (next_step, eager rotation).
@pytest.mark.parametrize(
    ("policy", "engine", "requests"),
    [("waiting_first", "vllm", 150), ("rotasched", "plain", 70), ("rotasched", "duplexkv", 150)],
)
def test_kept_swapped_views_are_the_fresh_ones(
    policy: str, engine: str, requests: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    build = build_view
    seen = {"steps": 0, "swapped": 0}

    def checked(engine: ViewedEngine) -> SchedulerView:
        view = build(engine)
        fresh = tuple(admitted_view(r) for r in engine.swapped.values() if not r.swap_pending)
        assert view.swapped == fresh
        seen["steps"] += 1
        seen["swapped"] += len(fresh)
        return view

    monkeypatch.setattr(sim_engine, "build_view", checked)
    run(dataclasses.replace(config(requests, policy), swap={"engine": engine}))
    assert seen["steps"] > 100 and seen["swapped"] > seen["steps"]  # it swapped, many steps long
