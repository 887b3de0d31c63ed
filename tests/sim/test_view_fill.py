"""The views a simulated engine fills slot by slot (kvtier.sched.view_fill, issue 20) are the frozen
dataclasses their constructors build, at every step of a real replay."""

from __future__ import annotations

import dataclasses

import pytest

import kvtier.sim.engine as sim_engine
from kvtier.bench.sim import config
from kvtier.sched.base import RequestView, SchedulerView
from kvtier.sim.run import run
from kvtier.sim.view import ViewedEngine, build_view
from kvtier.tiers import NO_TOKENS


def test_built_views_are_the_constructors_views(monkeypatch: pytest.MonkeyPatch) -> None:
    build = build_view
    seen = {"steps": 0, "running": 0}

    def checked(engine: ViewedEngine) -> SchedulerView:
        view = build(engine)
        config, cost = engine.config, engine.cost
        expected = SchedulerView(  # what build_view built with the constructor (the read ones as read)
            now_s=engine.loop.now_s,
            waiting=view.waiting,
            running=view.running,
            fetching=view.fetching,
            swapped=view.swapped,
            free_device_blocks=engine.available_device_blocks(),
            free_host_blocks=engine.lower_tiers.swap_room() if config.host_blocks else None,
            block_tokens=config.block_tokens,
            max_batch_tokens=config.max_batch_tokens,
            max_running=config.max_running,
            num_layers=cost.num_layers,
            cost=view.cost,
            kv_bytes_per_token=cost.kv_bytes_per_token,
            swap_copy=config.swap_copy,
            fetch=config.fetch,
        )
        assert type(view) is SchedulerView and view == expected and repr(view) == repr(expected)
        with pytest.raises(dataclasses.FrozenInstanceError):
            view.now_s = 0.0  # type: ignore[misc]
        running = tuple(
            RequestView(
                r.req_id,
                r.req.arrival_s,
                r.phase,
                r.req.prompt_tokens,
                r.computed_tokens,
                r.generated_tokens,
                NO_TOKENS,
                0,
                0,
                r.req.block_keys,
            )
            for r in engine.running
        )
        assert view.running == running and all(type(v) is RequestView for v in view.running)
        assert [hash(v) for v in view.running] == [hash(v) for v in running]
        seen["steps"] += 1
        seen["running"] += len(running)
        return view

    monkeypatch.setattr(sim_engine, "build_view", checked)
    run(dataclasses.replace(config(60, "rotasched"), swap={"engine": "plain"}))
    assert seen["steps"] > 100 and seen["running"] > seen["steps"]
