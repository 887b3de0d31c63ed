"""What RotaSched (:mod:`kvtier.sched.rotasched`) remembers of a request between views
(:class:`Seen`), and its visit of the running requests, which also reads what its rotation needs of
them (:func:`visit_running`).

A view carries a request's phase and token counts, not when its last token came (t_last) or when it
began running (t_run): RotaSched reads them from successive views, and a record keeps the fields
that need. A running request's view is new at every step (its tokens grew), so every running
request is visited every view; the rotation's reads of it (its claim, its step-4 key) are taken in
that same pass rather than in passes of their own (issue 20).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvtier.sched.base import Phase, RequestView, SchedulerView
from kvtier.sched.lvf import Head
from kvtier.sched.step_plan import RunningBatch


@dataclass(slots=True)
class Seen:
    """What the policy remembers of a request between views."""

    phase: Phase
    generated: int
    tokens: int  # computed + generated at the last view
    prev_tokens: int  # ... at the view before (its full blocks have a host copy under eager rotation)
    last_token_s: float
    run_start_s: float
    seen_s: float
    view: RequestView | None = None  # the view these fields were read from (views are frozen)


# What the rotation reads of the running requests, taken in their visit: step 4's heads (VLT < 0)
# in the view's order, the batch's totals (its claims: :func:`~kvtier.sched.claims.running_claims`;
# the step plan's :class:`~kvtier.sched.step_plan.RunningBatch`), and those shown running in
# another phase (not where a simulator shows them: the rotation's general path).
RunningPass = tuple[list[Head], RunningBatch, list[RequestView]]


def visit_running(
    view: SchedulerView, seen_map: OrderedDict[int, Seen], pending_out: dict[int, tuple[int, float]]
) -> RunningPass | None:
    """RotaSched's visit of ``view``'s running requests (the first it visits), as it visits any
    request: a request seen again drops its pending swap-out (its copy landed) and moves to the end
    of ``seen_map``; a new view updates its record (t_last where it generated, t_run where it began
    running). Also returns what the rotation reads of them, each key with its t_run read right after
    the visit (the same floats as a pass after the whole view's visit: nothing later in it changes
    a running request's t_run unless it is visited again). None where a record was visited already
    in this view (a request shown twice), so the caller reads them again after the whole visit."""
    now, bt = view.now_s, view.block_tokens
    running = Phase.RUNNING
    tails: list[Head] = []
    odd: list[RequestView] = []
    claims, rest, prefills, exact = 0, 0, 0, True
    running_views = view.running
    for r in running_views:
        rid, computed, generated = r.req_id, r.computed_tokens, r.generated_tokens
        tokens = computed + generated
        if computed < r.prompt_tokens:  # claim(), inline
            claims += -(-r.prompt_tokens // bt) + (-computed // bt)
            rest, prefills = rest + r.prompt_tokens - computed, prefills + 1
        else:
            claims += -(-(tokens + 1) // bt) + (-(tokens - (1 if generated == 1 else 0)) // bt)
        pending_out.pop(rid, None)  # visible again: its swap-out copy has landed
        seen = seen_map.get(rid)
        if seen is None:
            last_s = now if generated else r.arrival_s
            seen = seen_map[rid] = Seen(r.phase, generated, tokens, 0, last_s, now, now, r)
        else:
            if seen.seen_s == now:  # visited already in this view (or settled at the same time)
                exact = False
            seen_map.move_to_end(rid)
            if seen.view is r:  # the very view seen last time: phase and tokens as recorded
                seen.seen_s, seen.prev_tokens = now, seen.tokens
            else:
                seen.view = r
                if generated > seen.generated:
                    seen.last_token_s = now
                if r.phase is running and seen.phase is not running:
                    seen.run_start_s = now
                seen.phase, seen.generated, seen.seen_s = r.phase, generated, now
                seen.prev_tokens, seen.tokens = seen.tokens, tokens
        if r.phase is not running:
            odd.append(r)
        elif (lag := now - seen.run_start_s) > 0:  # VLT -lag < 0; its key, -VLT, is lag itself
            tails.append(((lag, r.arrival_s, rid), -(-tokens // bt), r))
    if not exact:
        return None
    return tails, RunningBatch(claims, len(running_views) - prefills + rest, prefills), odd
