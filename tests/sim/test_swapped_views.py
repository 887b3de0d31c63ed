"""The swapped requests' views are kept across steps until a swap changes them (issue 20): at every
step they are what building them afresh gives."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import kvtier.sim.engine as sim_engine
from kvtier.bench.sim import config
from kvtier.sched.base import Phase, SchedulerView
from kvtier.sched.lvf import RotarySet
from kvtier.sched.shown import ShownViews
from kvtier.sim.request import Request
from kvtier.sim.run import run
from kvtier.sim.state import SimRequest
from kvtier.sim.view import SwappedViews, ViewedEngine, admitted_view, build_view


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


# Swap events on a few requests: issue, land, hide (swap-in issued), leave (swap-in landed), each
# where its request's state allows it, and views built in between (a policy reads some of them).
_events = st.lists(
    st.tuples(
        st.sampled_from(["swap", "swap", "swap", "build"]),
        st.integers(0, 5),
        st.sampled_from([True, True, True, False]),
    ),
    max_size=80,
)


def _swaps(*rids: int) -> list[tuple[str, int, bool]]:
    return [("swap", rid, True) for rid in rids]


@settings(max_examples=300, deadline=None)
@given(_events)
@example(  # a view unread between two read ones, each a swap in and out: as many views, others
    [
        *_swaps(0, 0, 1, 1),
        ("build", 0, True),
        *_swaps(0, 2, 2),
        ("build", 0, False),
        *_swaps(1, 3, 3),
        ("build", 0, True),
    ]
)
def test_each_tuple_says_what_changed_since_the_one_built_before(events: list[tuple[str, int, bool]]) -> None:
    """Every tuple built is a ``ShownViews`` whose ``added`` and ``removed`` are the views it and
    the one built before differ by (by object; a request swapped in and out again has a new view),
    and the one before keeps no link; a rotary set reading those tuples (and skipping some, as a
    policy skips fast-forwarded views) finds what comparing the tuples finds (issue 20)."""
    kept = SwappedViews()
    requests = {rid: SimRequest(Request(rid, 0.0, 16, 9, (rid,)), admitted=True) for rid in range(6)}
    state = dict.fromkeys(requests, "absent")
    issued: list[int] = []  # in the order their swap-outs were issued: the tuple's
    built: list[ShownViews] = []
    rotary = RotarySet()
    for kind, rid, read in events:
        r = requests[rid]
        if kind == "swap":
            step = {"absent": kept.issued, "out": kept.landed, "shown": kept.hidden, "in": kept.left}
            if state[rid] == "absent":
                r.generated_tokens += 1  # it decoded while it ran: a new view when it lands
                issued.append(rid)
            elif state[rid] == "in":
                issued.remove(rid)
            r.phase = Phase.RUNNING if state[rid] == "in" else Phase.SWAPPED
            step[state[rid]](r)
            state[rid] = {"absent": "out", "out": "shown", "shown": "in", "in": "absent"}[state[rid]]
            continue
        shown = kept.views()
        assert shown == tuple(admitted_view(requests[k]) for k in issued if state[k] == "shown")
        if isinstance(shown, ShownViews) and (not built or shown is not built[-1]):
            base = built[-1] if built else None
            assert shown.base is base
            before = {id(v) for v in base or ()}
            now = {id(v) for v in shown}
            assert sorted(map(id, shown.added)) == sorted(now - before)
            assert sorted(map(id, shown.removed)) == sorted(before - now)
            assert not built or built[-1].base is None  # the link before is dropped
            built.append(shown)
        if read and shown is not rotary.shown:
            fresh, gone = rotary.diff(shown)
            sets_fresh, sets_gone = rotary._diff_by_sets(shown)
            assert [id(v) for v in fresh] == [id(v) for v in sets_fresh]
            assert sorted(gone) == sorted(sets_gone)
            rotary.update(shown, gone, [(0.0, v.arrival_s, v.req_id, 1, v, 0) for v in fresh])
