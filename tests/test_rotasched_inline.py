"""RotaSched's per-request helpers are spelled inline in its hot loops (issue 20): the running
batch's claims and one step's plan are what :func:`claim`, :func:`step_need` and
:func:`step_tokens` say, for any running batch, budget and free blocks."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import cast

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.sched.base import Phase, RequestView, SchedulerDecision, SchedulerView
from kvtier.sched.claims import claim, kv_blocks, running_claims, step_need, step_tokens
from kvtier.sched.lvf import lvf
from kvtier.sched.rota_seen import Seen as _Seen
from kvtier.sched.rotasched import _FORGET_S, RotaSched
from kvtier.sched.step_plan import RunningBatch, StepPlan
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
    kept._rotary_base = fresh._rotary_base = 0  # the rotary set always kept
    now, previous = 0.0, [RequestView(0, 0.0, Phase.SWAPPED, 10, 10, 1)]
    for requests, repeat, dt in steps:
        now += dt
        shown = previous if repeat else requests  # repeat: the very same objects again
        a = kept.rotate(_scheduler_view(now, shown, free))
        b = fresh.rotate(_scheduler_view(now, [_fresh(r) for r in shown], free))
        assert [[r.req_id for r in part] for part in a[:2]] + [a[2]] == [
            [r.req_id for r in part] for part in b[:2]
        ] + [b[2]]
        assert _records(kept, now) == _records(fresh, now)
        assert kept._pending_out == fresh._pending_out
        previous = shown


def _state(s: object) -> tuple[object, ...]:
    return tuple(
        getattr(s, f)
        for f in ("phase", "generated", "tokens", "prev_tokens", "last_token_s", "run_start_s", "seen_s")
    )


def _records(
    policy: RotaSched, now: float, members: Collection[int] | None = None
) -> dict[int, tuple[object, ...]]:
    """What the policy remembers, as it acts on it: a rotary or waiting request kept in its set is
    not visited while its view stays, so its record's last sight is this view (``seen_s``) and its
    ``prev_tokens`` (read only for running requests, and set again when it runs) is left out."""
    members = _members(policy) if members is None else members
    return {
        rid: (*_state(s)[:3], None, *_state(s)[4:6], now) if rid in members else _state(s)
        for rid, s in policy._seen.items()
    }


def _assert_same_rotation(new: RotaSched, ref: _Reference, view: SchedulerView) -> None:
    """One iteration of both: the same preempted and prioritised requests, the same blocks freed
    and the same records of every request (the kept sets' members as the reference sees them)."""
    a, b = new.rotate(view), ref.rotate(view)
    assert [[r.req_id for r in part] for part in a[:2]] + [a[2]] == [
        [r.req_id for r in part] for part in b[:2]
    ] + [b[2]]
    members = _members(new)
    assert _remembered(new, view.now_s, members) == _remembered(ref, view.now_s, members)


def _members(policy: RotaSched) -> set[int]:
    """The requests in the policy's kept sets (rotary and waiting)."""
    return set(policy._rotary.entries) | set(policy._waiting.entries)


def _scheduler_view(
    now: float, requests: list[RequestView], free: int, host: int | None = None
) -> SchedulerView:
    by = {p: tuple(r for r in requests if r.phase is p) for p in Phase}
    return SchedulerView(
        now,
        by[Phase.WAITING],
        by[Phase.RUNNING],
        (),
        by[Phase.SWAPPED],
        free,
        host,
        BT,
        4096,
        256,
        1,
        _NoCost(),
        0,
        SWAP_ENGINES["duplexkv"],
    )


# ------------------------------------------------------------------------------------------------
# The rotary set (issue 20): rotate with the rotary requests kept between views is Algorithm 1
# over every candidate, with the records observe kept when it visited every request every view.


class _Reference(RotaSched):
    """RotaSched as it read before the rotary set: observe visits every request every view and
    forgets by a scan of its head; rotate runs :func:`lvf` over every candidate's VLT."""

    def observe(self, view: SchedulerView) -> None:
        now = view.now_s
        seen_map, pending_out = self._seen, self._pending_out
        for group in (view.running, view.swapped, view.waiting, view.fetching):
            for r in group:
                rid = r.req_id
                pending_out.pop(rid, None)
                tokens = r.computed_tokens + r.generated_tokens
                seen = seen_map.get(rid)
                if seen is None:
                    last_s = now if r.generated_tokens else r.arrival_s
                    seen_map[rid] = _Seen(r.phase, r.generated_tokens, tokens, 0, last_s, now, now, r)
                    continue
                seen_map.move_to_end(rid)
                if seen.view is r:
                    seen.seen_s, seen.prev_tokens = now, seen.tokens
                    continue
                seen.view = r
                if r.generated_tokens > seen.generated:
                    seen.last_token_s = now
                if r.phase is Phase.RUNNING and seen.phase is not Phase.RUNNING:
                    seen.run_start_s = now
                seen.phase, seen.generated, seen.seen_s = r.phase, r.generated_tokens, now
                seen.prev_tokens, seen.tokens = seen.tokens, tokens
        while seen_map:
            rid = next(iter(seen_map))
            if not now - seen_map[rid].seen_s > _FORGET_S:
                break
            del seen_map[rid]
        for rid in [rid for rid, (_, t) in pending_out.items() if now - t > _FORGET_S]:
            del pending_out[rid]

    def rotate(self, view: SchedulerView) -> tuple[list[RequestView], list[RequestView], int]:
        self.observe(view)
        cands = [(self.vlt(r, view.now_s), r) for g in (view.running, view.waiting, view.swapped) for r in g]
        blocks = {r.req_id: kv_blocks(r, BT) for _, r in cands}
        pending = sum(held for held, _ in self._pending_out.values())
        free = view.free_device_blocks - running_claims(view) + pending
        preempted, prioritised = lvf(cands, blocks, free, self.xfer_blocks, view.free_host_blocks)
        return preempted, prioritised, self.swap_out(view, preempted)


def _remembered(policy: RotaSched, now: float, members: Collection[int]) -> dict[int, tuple[object, ...]]:
    """The records as the policy acts on them at ``now``: :func:`_records` (``members``: the rotary
    set's), less those unseen for longer than ``_FORGET_S`` (forgotten, wherever they sit)."""
    records = _records(policy, now, members)
    return {rid: s for rid, s in records.items() if not now - cast(float, s[6]) > _FORGET_S}


@settings(max_examples=300)
@given(
    st.lists(
        st.tuples(views(), st.booleans(), st.sampled_from([0.0, 0.01, 0.04, 0.3, 29.95, 31.0])),
        min_size=1,
        max_size=10,
    ),
    st.integers(-4, 40),
    st.sampled_from([0.0, 1.0, 3.0]),
    st.sampled_from([0.0, 0.5]),
    st.sampled_from([None, 0, 8, 30]),
    st.sampled_from([0, 1, 2, 3, 64]),
    st.sampled_from([0.0, 1.0]),
)
def test_rotate_with_the_rotary_set_is_lvf_over_every_candidate(
    steps: list[tuple[list[RequestView], bool, float]],
    free: int,
    alpha: float,
    beta_b: float,
    host: int | None,
    base: int,
    per_swap: float,
) -> None:
    """Equal VLTs among rotary requests (alpha 0, or within beta_B's lag), requests that vanish and
    come back after the forgetting horizon, the very same swapped tuple shown again, and the set
    kept, dropped and kept again as its size crosses the thresholds: the decisions, swap-outs and
    records are the reference's."""
    new = RotaSched(xfer_blocks=12, alpha=alpha, beta_b=beta_b)
    new._rotary_base, new._rotary_per_swap = base, per_swap
    ref = _Reference(xfer_blocks=12, alpha=alpha, beta_b=beta_b)
    now, previous, swapped = 0.0, [RequestView(0, 0.0, Phase.SWAPPED, 10, 10, 1)], None
    for requests, repeat, dt in steps:
        now += dt
        shown = previous if repeat else requests
        view = _scheduler_view(now, shown, free, host)
        if repeat and swapped is not None:  # the simulator's kept swapped tuple
            view = dataclasses.replace(view, swapped=swapped)
        _assert_same_rotation(new, ref, view)
        assert new._pending_out == ref._pending_out
        previous, swapped = shown, view.swapped


def test_a_request_unseen_past_the_horizon_is_forgotten_behind_a_rotary_one_that_left() -> None:
    """A rotary request kept (not visited) for 30 s, then gone: its record must not shield an
    older one from forgetting. C runs once, vanishes for over 30 s and comes back with the same
    view: both policies remember it afresh (t_run is its return)."""
    a = RequestView(1, 0.0, Phase.SWAPPED, 40, 40, 2)
    c = RequestView(2, 0.0, Phase.RUNNING, 40, 40, 2)
    new, ref = RotaSched(xfer_blocks=12), _Reference(xfer_blocks=12)
    new._rotary_base = 1  # the set kept from one rotary request on
    swapped = (a,)
    for now, shown in ((0.0, [a]), (0.01, [a, c]), (29.9, [a]), (29.95, []), (30.05, []), (30.06, [c])):
        view = _scheduler_view(now, shown, 8)
        if a in shown:
            view = dataclasses.replace(view, swapped=swapped)
        assert [r.req_id for r in new.rotate(view)[1]] == [r.req_id for r in ref.rotate(view)[1]]
        members = _members(new)
        assert _remembered(new, now, members) == _remembered(ref, now, members)
    assert new._seen[2].run_start_s == 30.06


def test_a_waiting_request_kept_past_the_horizon_is_remembered_and_one_gone_forgotten() -> None:
    """The waiting head kept (issue 20): W waits with the same view object for over 30 s, never
    visited after it entered: its record stays (it is seen every view), and C, seen once, is
    forgotten on time behind it. W then runs (it leaves the head) and its record goes on from there.
    A rotary request keeps the rotary set, and so the head's, in use."""
    w = RequestView(1, 0.0, Phase.WAITING, 40, 0, 0)
    c = RequestView(2, 0.0, Phase.RUNNING, 40, 40, 2)
    s = RequestView(3, 0.0, Phase.SWAPPED, 40, 40, 2)
    w_run = RequestView(1, 0.0, Phase.RUNNING, 40, 40, 1)
    new, ref = RotaSched(xfer_blocks=12), _Reference(xfer_blocks=12)
    new._rotary_base = 1
    steps = (
        (0.0, [w, s]),
        (0.01, [w, s, c]),
        (29.9, [w, s]),
        (30.05, [w, s]),
        (31.0, [w_run, s]),
        (62.0, [s]),
    )
    for now, shown in steps:
        view = _scheduler_view(now, shown, 8)
        a, b = new.rotate(view), ref.rotate(view)
        assert [[r.req_id for r in part] for part in a[:2]] == [[r.req_id for r in part] for part in b[:2]]
        members = _members(new)
        assert _remembered(new, now, members) == _remembered(ref, now, members)
        assert (1 in new._waiting) == (w in shown)
    assert 2 not in new._seen and 1 not in new._seen


@settings(max_examples=100)
@given(st.lists(st.tuples(views(), st.booleans(), st.sampled_from([0.0, 0.3, 31.0])), min_size=1, max_size=8))
def test_a_waiting_head_with_requests_not_waiting_is_read_one_by_one(
    steps: list[tuple[list[RequestView], bool, float]],
) -> None:
    """Every request shown in the waiting head, whatever its phase (not where a simulator shows a
    running or rotary one): the head's set is not read (its order is not theirs), the pass reads
    each one, and the decisions and records are the reference's."""
    new, ref = RotaSched(xfer_blocks=12), _Reference(xfer_blocks=12)
    new._rotary_base = 0  # the rotary set kept: the head's set would be read beside it
    now, previous = 0.0, [RequestView(0, 0.0, Phase.SWAPPED, 10, 10, 1)]
    for requests, repeat, dt in steps:
        now += dt
        shown = previous if repeat else requests
        view = _scheduler_view(now, shown, 6)
        view = dataclasses.replace(view, waiting=tuple(shown), running=(), swapped=())
        _assert_same_rotation(new, ref, view)
        previous = shown


def test_a_running_request_visited_twice_is_keyed_as_its_whole_visit_leaves_it() -> None:
    """Step 4's keys are read in the running requests' visit (issue 20, eighteenth slice). A
    request shown again after it, in another phase and then running again (among the running, or
    among the fetching), begins running anew at this view: its key is read as the whole visit
    leaves its record (VLT 0: no victim), as the reference reads it, not as its first visit did
    (VLT -1: the victim the waiting request's admission asks for)."""
    x0 = RequestView(1, 0.0, Phase.RUNNING, 40, 40, 2)
    x1, x2 = (RequestView(1, 0.0, Phase.RUNNING, 40, 40, 3) for _ in range(2))  # equal, two objects
    other = RequestView(1, 0.0, Phase.WAITING, 40, 0, 0)
    w = RequestView(2, 0.5, Phase.WAITING, 40, 0, 0)
    for running, fetching in (((x1, other, x2), ()), ((x1,), (other, x2))):
        new, ref = RotaSched(xfer_blocks=12), _Reference(xfer_blocks=12)
        for now, view_running, view_fetching in ((0.0, (x0,), ()), (1.0, running, fetching)):
            view = dataclasses.replace(
                _scheduler_view(now, [w], 0), running=view_running, fetching=view_fetching
            )
            _assert_same_rotation(new, ref, view)
        assert new._seen[1].run_start_s == 1.0


# ------------------------------------------------------------------------------------------------
# The running batch's totals read in the visit (issue 20, twentieth slice)


@settings(max_examples=300)
@given(st.lists(running(), max_size=12), st.integers(-4, 24), st.integers(0, 80), st.data())
def test_a_batch_planned_from_its_totals_is_planned_request_by_request(
    requests: list[RequestView], free: int, budget: int, data: st.DataObject
) -> None:
    """RotaSched's visit reads the running batch's :class:`RunningBatch`; the step plan given it
    (less the requests swapped out) plans what it plans request by request, whether or not the
    whole batch fits the budget and the free blocks (a request shown twice: no totals)."""
    requests = [dataclasses.replace(r, req_id=i) for i, r in enumerate(requests)]
    view = _view(requests, free, budget)
    policy = RotaSched(xfer_blocks=12)
    policy.rotate(view)
    out = data.draw(st.lists(st.sampled_from(requests), unique_by=id)) if requests else []
    whole = RunningBatch(
        sum(claim(r, BT) for r in requests),
        sum(step_tokens(r, 10**9) for r in requests),
        sum(r.computed_tokens < r.prompt_tokens for r in requests),
    )
    assert policy.running_batch(view, ()) == whole
    batch = policy.running_batch(view, out)
    staying = [r for r in requests if all(r is not o for o in out)]
    assert batch is not None and batch.claims == sum(claim(r, BT) for r in staying)
    plan, reference = StepPlan(view, free, []), StepPlan(view, free, [])
    plan.run(staying, batch)
    reference.run(staying)
    assert (plan.decision.prefill, plan.decision.decode) == (
        reference.decision.prefill,
        reference.decision.decode,
    )
    assert (plan.budget, plan.free_blocks) == (reference.budget, reference.free_blocks)
    assert policy.running_batch(_view(requests, free, budget), out) is None  # not the view it read
