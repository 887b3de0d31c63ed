"""Decode fast-forward (issue 20, sixth slice): a step whose decision is known is planned without
asking the policy.

On a sized cluster most steps are small decode-only batches between arrivals (4 H100s on the
bundled trace: ~4 decodes a step, ~37 steps between one engine's arrivals and finishes). Such a
step's decision is known before the policy is asked when the policy says so
(:meth:`Policy.steady_decode`): every running request decodes, in running order, and nothing else.
The engine then skips the view, the policy and the executor, and plans the step here: the same
decodes (``plan_decode``'s work), the same contexts, the same cost-model call and the same
``STEP_END`` event as the slow path. The step ends through the usual
:func:`~kvtier.sim.events.step_end.finish_step`, so every effect — tokens, the TBT histogram, the
clock, the shared metrics, the event count — happens at the same instant and in the same order as
without the fast-forward: results are bit-identical (``tests/sim/test_fast_forward.py``).

Several steps in one loop (issue 20, seventh slice): while nothing but other engines' step ends can
happen before a step's end (:meth:`EventLoop.horizon_s`: no arrival, transfer end, wake or the run's
bound sooner), no step-synced swap copy is in flight, and those cannot reach this engine
(``engine.isolated()``: a colocated cluster, open loop, no closed-loop request waiting for its
parent, so a finish only folds its record), the step ends here, without an event (:func:`_ahead`),
as ``finish_step`` would end it: the same tokens, gaps, maximum gap, step and event counts, at the
same instants. It stops before a step at whose end a request finishes (its record and any effect of
the finish keep their event and its order) and before a step whose decodes would cross into a block
they do not hold (the slow path allocates it); that step is then scheduled as the usual
``STEP_END``. What changes is only the order in which the engines add to the shared float sums
(``Metrics.busy_s``, the TBT histogram's total): an engine's run-ahead steps add theirs before other
engines' earlier steps do, so those sums differ by rounding (rel < 1e-12,
``tests/sim/test_fast_forward.py``); per-request records, counts, histogram buckets and the event
count are exact.

The run (:attr:`DecodeEngine.decode_run`) is armed after a slow step whose decision was exactly
"decode every running request" in a state where nothing else could be decided (no waiting,
fetching, swapped or incoming request) and the policy opted in. It ends (the slow path plans the
step) as soon as, at a step's start, anything could make the decision or the step start differ:

- a request arrived or was preempted back into waiting, or reached the fetching, swapped or
  P/D incoming sets;
- the running set is not the armed batch (a request finished, left, or was added);
- a decode would cross into a block it does not hold (``plan_decode`` would allocate, which can
  evict or preempt);
- under eager rotation (DuplexKV, twelfth slice), a running request filled a block since the last
  step: the slow path's step start issues its host copy (``Swaps.rotate_synced_blocks``).
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable, Iterator
from itertools import count
from typing import Protocol

from kvtier.sched.base import Policy, SchedulerDecision, SchedulerView
from kvtier.sched.swap_copy import SwapCopy
from kvtier.sim.core import EventKind, EventLoop
from kvtier.sim.cost import BatchShape, CostModel, RooflineCostModel
from kvtier.sim.events.step_end import Step, StepEngine
from kvtier.sim.state import SimRequest


class _Config(Protocol):
    @property
    def swap_copy(self) -> SwapCopy: ...


class _LoadPaths(Protocol):
    interference: list[float]


class _Swaps(Protocol):
    barrier: int  # step-synced swap copies in flight

    def holds_step(self, step: Step) -> bool: ...


class DecodeEngine(StepEngine, Protocol):
    """What the fast-forward reads and sets of its engine (:class:`kvtier.sim.engine.Engine`)."""

    decode_fast_forward: bool  # False: every step asks the policy (tests compare both)
    decode_run: list[SimRequest] | None  # the armed batch; None: the next step asks the policy
    stepping: bool
    block_tokens: int
    policy: Policy
    running: list[SimRequest]
    waiting: list[tuple[float, int]]
    fetching: dict[int, SimRequest]
    swapped: dict[int, SimRequest]
    incoming: deque[SimRequest]
    isolated: Callable[[], bool] | None  # multi-step runs allowed now (a colocated Cluster's)

    @property
    def loop(self) -> EventLoop: ...
    @property
    def cost(self) -> CostModel: ...
    @property
    def config(self) -> _Config: ...
    @property
    def load_paths(self) -> _LoadPaths: ...
    @property
    def swaps(self) -> _Swaps: ...


def _others_pending(engine: DecodeEngine) -> bool:
    """Whether any request besides the running ones could be scheduled."""
    return bool(engine.waiting or engine.fetching or engine.swapped or engine.incoming)


def arm(engine: DecodeEngine, view: SchedulerView, decision: SchedulerDecision, step: Step) -> None:
    """After a slow step: keeps its batch as the engine's decode run if its decision was "decode
    every running request, in order" in a state where nothing else was possible, and the policy
    says it would decide the same while only the decodes' token counts advance."""
    engine.decode_run = None
    if not engine.decode_fast_forward or _others_pending(engine):
        return
    if step.prefills or step.loads or decision.prefill or decision.loads:
        return
    if decision.preempt or decision.swap_out or decision.swap_in:
        return
    running = engine.running
    decodes = step.decodes
    if len(decodes) != len(running) or any(r is not d for (d, _), r in zip(decodes, running, strict=True)):
        return
    if engine.policy.steady_decode(view):
        engine.decode_run = list(running)


def next_step(engine: DecodeEngine) -> bool:
    """Plans and begins the engine's next step as the slow path would, if the decode run still
    holds; False (and the run disarmed) if the slow path must plan it. Steps that can end before
    anything else could reach the engine are run here, in one loop (:func:`_ahead`)."""
    batch = engine.decode_run
    running = engine.running
    if batch is None or len(running) != len(batch) or _others_pending(engine):
        engine.decode_run = None
        return False
    block_tokens = engine.block_tokens
    eager = engine.config.swap_copy.eager
    contexts: list[int] = []
    # How many steps may run ahead (_ahead): step j (from 0) may if no request finishes at its end
    # (generated + j + 1 < output) and step j + 1's decodes stay in their blocks (context + j + 2 <=
    # held tokens) and, under eager rotation, fill no block (the test below, at step j + 1).
    limit = sys.maxsize if running else 0  # an empty batch: nothing to run ahead
    for r, armed in zip(running, batch, strict=True):
        context, generated = r.prompt_tokens + r.generated_tokens, r.generated_tokens
        # Engine.plan_decode's test: crossing into a block it does not hold allocates (slow path).
        held_tokens = (r.locked_blocks + r.private_blocks + r.reserved_blocks) * block_tokens
        if r is not armed or context + 1 > held_tokens:  # ceil((context + 1) / block) > held blocks
            engine.decode_run = None
            return False
        if (room := min(r.output_tokens - generated, held_tokens - context) - 1) < limit:
            limit = room
        # Eager rotation (Swaps.rotate_synced_blocks, at the slow path's start): a block filled since
        # the last step starts its host copy there, so such a step is the slow path's.
        if eager:
            if (r.computed_tokens + generated) // block_tokens > r.host_copied_blocks:
                engine.decode_run = None
                return False
            if (
                room := (r.host_copied_blocks + 1) * block_tokens - r.computed_tokens - generated - 1
            ) < limit:
                limit = room
        contexts.append(context)
    loop = engine.loop
    # Engine.start_step's slowdown, with no loads in the step: it holds until a transfer ends.
    slowdown = 1.0 + max(engine.load_paths.interference, default=0.0)
    start_s, compute_s = loop.now_s, _compute_s(engine.cost, contexts, slowdown)
    isolated = engine.isolated
    if isolated is not None and not engine.swaps.barrier and isolated():
        start_s, compute_s, contexts = _ahead(engine, contexts, start_s, compute_s, slowdown, limit)
    step = Step(engine, start_s=start_s)
    step.decodes = [(r, r.epoch) for r in running]
    step.decode_contexts = contexts
    step.compute_s = compute_s
    engine.stepping = True
    if start_s != loop.now_s:  # steps ran ahead: this one ends as begin() would have scheduled it
        loop.schedule(start_s + compute_s, EventKind.STEP_END, lambda: engine.end_step(step))
    elif not engine.swaps.holds_step(step):
        step.begin()
    return True


def _compute_s(cost: CostModel, contexts: list[int], slowdown: float) -> float:
    """Engine.start_step's compute time of a decode-only step: the same floats."""
    if type(cost) is RooflineCostModel:  # its decode-only form: the same float, fewer operations
        return cost.step_times.decode_s(contexts) * slowdown
    return cost.step_time_s(BatchShape((), tuple(contexts))) * slowdown


def _run_s(cost: CostModel, contexts: list[int], slowdown: float) -> Iterator[float]:
    """``_compute_s`` of each step of a decode run from ``contexts``: each context + 1 a step."""
    if type(cost) is RooflineCostModel:
        yield from cost.step_times.decode_run_s(contexts, slowdown)
    for advance in count():
        yield cost.step_time_s(BatchShape((), tuple(c + advance for c in contexts))) * slowdown


def _ahead(
    engine: DecodeEngine, contexts: list[int], start_s: float, compute_s: float, slowdown: float, limit: int
) -> tuple[float, float, list[int]]:
    """Runs whole decode steps of the run here, without events, while each ends before the next
    event that could reach the engine (:meth:`EventLoop.horizon_s`: an arrival, a transfer's end,
    a wake, the run's bound; other engines' step ends cannot while ``engine.isolated()``), no
    request finishes at its end, and the step after it is planned the same way (no decode crosses
    into a block it does not hold). Together they do what ``finish_step`` does for each of them,
    in order: tokens, gaps, the shared metrics, the event count. At most ``limit`` steps
    (:func:`next_step`'s: no finish, no block crossed or filled). Returns the start, compute time
    and contexts of the first step left to end through the event heap."""
    loop, metrics, running = engine.loop, engine.metrics, engine.running
    horizon_s = loop.horizon_s()
    end_s = start_s + compute_s
    if limit <= 0 or end_s >= horizon_s:
        return start_s, compute_s, contexts
    gaps: list[float] = []
    for r in running:  # finish_step's decode loop for the first step, no request finishing
        gap = end_s - r.last_token_s
        gaps.append(gap)
        if gap > r.max_tbt_s:
            r.max_tbt_s = gap
        r.last_token_s = end_s
    busy_s = metrics.busy_s + (end_s - start_s)
    # Every later step's decodes are the step before's, so each request's gap is the same float,
    # end_s - start_s (its last token came at start_s): one gap a step, repeated per decode.
    step_gaps: list[float] = []
    times = _run_s(engine.cost, [c + 1 for c in contexts], slowdown)  # from the second step on
    start_s, compute_s = end_s, next(times)
    end_s = start_s + compute_s
    steps = 1
    while steps < limit and end_s < horizon_s:
        gap = end_s - start_s
        step_gaps.append(gap)
        busy_s += gap
        steps += 1
        start_s, compute_s = end_s, next(times)
        end_s = start_s + compute_s
    if step_gaps:
        max_gap = max(step_gaps)
        for r in running:
            if max_gap > r.max_tbt_s:
                r.max_tbt_s = max_gap
            r.last_token_s = start_s
    for r in running:
        r.generated_tokens += steps
    metrics.steps += steps
    metrics.busy_s = busy_s
    metrics.add_tbts(gaps)  # the same as one call per step: gaps in step order
    if step_gaps:
        metrics.add_tbts(step_gaps, len(running))
    loop.events_run += steps  # the steps' ends, events without the fast-forward
    return start_s, compute_s, [c + steps for c in contexts]
