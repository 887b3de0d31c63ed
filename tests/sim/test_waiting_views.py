"""The waiting head's views are kept across steps while the engine's ``waiting_version`` stays (issue
20): at every step they are what looking each request up afresh gives."""

from __future__ import annotations

import pytest

import kvtier.sim.engine as sim_engine
from kvtier.bench.sim import config
from kvtier.radix.counts import prefix_counts
from kvtier.sched.base import RequestView, SchedulerDecision, SchedulerView
from kvtier.sim.engine import Engine
from kvtier.sim.events.step_end import Step
from kvtier.sim.run import run
from kvtier.sim.state import SimRequest
from kvtier.sim.view import admitted_view, cap_prefix


def fresh_view(engine: Engine, r: SimRequest) -> RequestView:
    """``r``'s view from a new prefix lookup (nothing kept)."""
    if r.admitted:
        return admitted_view(r)
    bt = engine.config.block_tokens
    per_tier, in_queue, in_flight = prefix_counts(engine.tree, r.keys, r.queue_marked)
    cached = cap_prefix([n * bt for n in per_tier], r.req.prompt_tokens, bt)
    return RequestView(
        r.req_id,
        r.req.arrival_s,
        r.phase,
        r.req.prompt_tokens,
        r.computed_tokens,
        r.generated_tokens,
        cached,
        in_queue * bt,
        in_flight * bt,
        r.req.block_keys,
    )


# Strata reads the whole head every step; hicache (FCFS) stops at the first request that does not
# fit, so a kept list also carries views never built; fcfs preempts, so requests re-enter the queue;
# rotasched reads the whole head too, most steps after an admission changed it (a head built anew
# takes the views its requests keep, then looks up the new ones as they are read).
@pytest.mark.parametrize(
    ("policy", "requests", "kept_share"),
    [("strata", 300, 4), ("hicache", 300, 4), ("fcfs", 300, 4), ("rotasched", 300, 8)],
)
def test_kept_waiting_views_are_the_fresh_ones(
    policy: str, requests: int, kept_share: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked once the policy has decided, before the decision changes anything: every view it
    built or was handed from a kept list is the fresh one (the views it did not read stay unbuilt)."""
    build, execute, changed = sim_engine.build_view, sim_engine.execute, sim_engine.Engine.waiting_changed
    seen = {"steps": 0, "kept": 0, "views": 0, "tree_bumps": 0}

    def counted_build(engine: Engine) -> SchedulerView:
        kept = engine.waiting_views
        seen["kept"] += kept is not None and kept.version == engine.waiting_version and kept._built > 0
        return build(engine)

    def checked(decision: SchedulerDecision, engine: Engine, step: Step) -> None:
        waiting = engine.waiting_views
        assert waiting is not None
        head = [engine.requests[rid] for _, rid in engine.waiting[: engine.config.view_waiting_max]]
        assert waiting._requests == head
        for r, v in zip(head, waiting._views, strict=True):
            if v is not None:
                assert v == fresh_view(engine, r)
                seen["views"] += 1
        seen["steps"] += 1
        execute(decision, engine, step)

    def counted(engine: Engine) -> None:
        seen["tree_bumps"] += 1
        changed(engine)

    monkeypatch.setattr(sim_engine, "build_view", counted_build)
    monkeypatch.setattr(sim_engine, "execute", checked)
    monkeypatch.setattr(sim_engine.Engine, "waiting_changed", counted)
    run(config(requests, policy))
    # Many steps long, most with a kept head that had views in it, and watches released on the way.
    assert seen["steps"] > 1000 and seen["views"] > seen["steps"]
    assert seen["kept"] > seen["steps"] // kept_share
    assert seen["tree_bumps"] > 100
