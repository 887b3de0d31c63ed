"""RotaSched's per-request helpers are spelled inline in its hot loops (issue 20): the running
batch's claims and one step's plan are what :func:`claim`, :func:`step_need` and
:func:`step_tokens` say, for any running batch, budget and free blocks."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.sched.base import Phase, RequestView, SchedulerDecision, SchedulerView
from kvtier.sched.claims import claim, running_claims, step_need, step_tokens
from kvtier.sched.rotasched import RotaSched, StepPlan, lvf
from kvtier.sched.swap_copy import PLAIN_SWAP, SWAP_ENGINES

BT = 16


class _NoCost:
    def prefill_s(self, new_tokens: int, context_tokens: int) -> float:
        return 0.0

    def load_s(self, tokens: int, tier: object, mode: object) -> float:
        return 0.0


@st.composite
def running(draw: st.DrawFn) -> RequestView:
    prompt = draw(st.integers(1, 64))
    computed = draw(st.integers(0, prompt))
    generated = draw(st.integers(0, 20)) if computed == prompt else 0
    return RequestView(draw(st.integers(0, 10**6)), 0.0, Phase.RUNNING, prompt, computed, generated)


def _view(requests: list[RequestView], free: int, budget: int) -> SchedulerView:
    return SchedulerView(
        0.0, (), tuple(requests), (), (), free, None, BT, budget, 256, 1, _NoCost(), 0, PLAIN_SWAP
    )


def _reference_run(view: SchedulerView, free: int) -> tuple[SchedulerDecision, int, int]:
    """StepPlan.run as it read before the helpers were inlined."""
    decision, budget = SchedulerDecision(), view.max_batch_tokens
    for r in view.running:
        n = step_tokens(r, budget) if budget > 0 else 0
        if n > 0 and step_need(r, n, BT) <= free:
            budget -= n
            if r.computed_tokens < r.prompt_tokens:
                decision.prefill.append((r.req_id, n))
            else:
                decision.decode.append(r.req_id)
        free -= claim(r, BT)
    return decision, budget, free


@settings(max_examples=300)
@given(st.lists(running(), max_size=12), st.integers(-4, 24), st.integers(0, 80))
def test_inline_claims_and_plan_are_the_helpers(requests: list[RequestView], free: int, budget: int) -> None:
    view = _view(requests, free, budget)
    assert running_claims(view) == sum(claim(r, BT) for r in requests)
    plan = StepPlan(view, free, [])
    plan.run(view.running)
    decision, left, free_left = _reference_run(view, free)
    assert (plan.decision.prefill, plan.decision.decode) == (decision.prefill, decision.decode)
    assert (plan.budget, plan.free_blocks) == (left, free_left)


# ------------------------------------------------------------------------------------------------
# LVF's groups and observe's same-view path (issue 20, eighth slice)


def _reference_lvf(
    candidates: list[tuple[float, RequestView]], blocks: dict[int, int], free_blocks: int, xfer_blocks: int
) -> tuple[list[RequestView], list[RequestView]]:
    """Algorithm 1 as it read with one sort of every candidate."""
    left = free_blocks + xfer_blocks
    waiting_rotary = [r for _, r in candidates if r.phase is not Phase.RUNNING]
    if free_blocks >= sum(blocks[r.req_id] for r in waiting_rotary):
        fcfs = sorted(
            waiting_rotary, key=lambda r: (0 if r.phase is Phase.SWAPPED else 1, r.arrival_s, r.req_id)
        )
        return [], fcfs
    keys = sorted([(-vlt, r.arrival_s, r.req_id, i) for i, (vlt, r) in enumerate(candidates)])
    ordered = [candidates[key[3]] for key in keys]
    prioritised = []
    for vlt, r in ordered:
        if r.phase is not Phase.RUNNING and vlt >= 0 and blocks[r.req_id] <= left:
            prioritised.append(r)
            left -= blocks[r.req_id]
    swap = xfer_blocks - left
    preempted = []
    for vlt, r in reversed(ordered):
        if r.phase is Phase.RUNNING and vlt < 0 and swap > 0:
            preempted.append(r)
            swap -= blocks[r.req_id]
    return preempted, prioritised


# Few distinct VLTs and arrivals (0.0 and -0.0 among them), so keys tie up to the request id.
VLTS = st.sampled_from([-2.0, -0.5, -0.0, 0.0, 0.5, 3.0])
PHASES = st.sampled_from([Phase.RUNNING, Phase.WAITING, Phase.SWAPPED])


@st.composite
def candidates(draw: st.DrawFn) -> tuple[list[tuple[float, RequestView]], dict[int, int]]:
    ids = draw(st.lists(st.integers(0, 50), unique=True, max_size=14))
    out, blocks = [], {}
    for rid in ids:
        phase = draw(PHASES)
        r = RequestView(rid, draw(st.sampled_from([0.0, 1.0, 2.0])), phase, 50, 50, 3)
        out.append((draw(VLTS), r))
        blocks[rid] = draw(st.integers(1, 6))
    return out, blocks


@settings(max_examples=400)
@given(candidates(), st.integers(-4, 30), st.integers(0, 30))
def test_lvf_by_groups_is_one_sort_of_every_candidate(
    drawn: tuple[list[tuple[float, RequestView]], dict[int, int]], free: int, xfer: int
) -> None:
    cands, blocks = drawn
    assert lvf(cands, blocks, free, xfer) == _reference_lvf(cands, blocks, free, xfer)


@st.composite
def views(draw: st.DrawFn) -> list[RequestView]:
    """One engine's requests at a step: each in one phase, token counts that only grow."""
    out = []
    for rid in draw(st.lists(st.integers(0, 30), unique=True, max_size=10)):
        phase = draw(PHASES)
        prompt = draw(st.integers(1, 80))
        if phase is Phase.WAITING:
            out.append(RequestView(rid, rid * 0.25, phase, prompt, 0, 0))
        else:
            out.append(RequestView(rid, rid * 0.25, phase, prompt, prompt, draw(st.integers(0, 40))))
    return out


def _fresh(r: RequestView) -> RequestView:
    """An equal view that is a new object: observe cannot take its same-view path."""
    return dataclasses.replace(r)


@settings(max_examples=200)
@given(
    st.lists(st.tuples(views(), st.booleans(), st.floats(0.0, 0.3)), min_size=1, max_size=8),
    st.integers(0, 40),
)
def test_rotate_with_kept_views_is_rotate_with_fresh_ones(
    steps: list[tuple[list[RequestView], bool, float]], free: int
) -> None:
    """Shown the same view objects again (as the simulator shows swapped and unchanged waiting
    requests), RotaSched decides and remembers what it does when every view is a new object."""
    kept, fresh = RotaSched(xfer_blocks=12), RotaSched(xfer_blocks=12)
    now, previous = 0.0, [RequestView(0, 0.0, Phase.SWAPPED, 10, 10, 1)]
    for requests, repeat, dt in steps:
        now += dt
        shown = previous if repeat else requests  # repeat: the very same objects again
        a = kept.rotate(_scheduler_view(now, shown, free))
        b = fresh.rotate(_scheduler_view(now, [_fresh(r) for r in shown], free))
        assert [[r.req_id for r in part] for part in a[:2]] + [a[2]] == [
            [r.req_id for r in part] for part in b[:2]
        ] + [b[2]]
        assert [(rid, _state(s)) for rid, s in kept._seen.items()] == [
            (rid, _state(s)) for rid, s in fresh._seen.items()
        ]
        assert kept._pending_out == fresh._pending_out
        previous = shown


def _state(s: object) -> tuple[object, ...]:
    return tuple(
        getattr(s, f)
        for f in ("phase", "generated", "tokens", "prev_tokens", "last_token_s", "run_start_s", "seen_s")
    )


def _scheduler_view(now: float, requests: list[RequestView], free: int) -> SchedulerView:
    by = {p: tuple(r for r in requests if r.phase is p) for p in Phase}
    return SchedulerView(
        now,
        by[Phase.WAITING],
        by[Phase.RUNNING],
        (),
        by[Phase.SWAPPED],
        free,
        None,
        BT,
        4096,
        256,
        1,
        _NoCost(),
        0,
        SWAP_ENGINES["duplexkv"],
    )
