"""RotaSched's per-request helpers are spelled inline in its hot loops (issue 20): the running
batch's claims and one step's plan are what :func:`claim`, :func:`step_need` and
:func:`step_tokens` say, for any running batch, budget and free blocks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.sched.base import Phase, RequestView, SchedulerDecision, SchedulerView
from kvtier.sched.rotasched import StepPlan, claim, running_claims, step_need, step_tokens
from kvtier.sched.swap_copy import PLAIN_SWAP

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
