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

Why one step at a time and not many in one loop: the engines of a cluster share one
:class:`~kvtier.sim.metrics.Metrics` (float sums of busy time and token gaps, added in event order)
and one router that reads every engine's load at each arrival; jumping one engine ahead over
other engines' events would reorder those float additions. Each fast step still goes through the
event heap, but costs the cost model and the step's end, not a view, a decision and its checks.

The run (:attr:`DecodeEngine.decode_run`) is armed after a slow step whose decision was exactly
"decode every running request" in a state where nothing else could be decided (no waiting,
fetching, swapped or incoming request, no eager swap copies) and the policy opted in. It ends (the
slow path plans the step) as soon as, at a step's start, anything could make the decision differ:

- a request arrived or was preempted back into waiting, or reached the fetching, swapped or
  P/D incoming sets;
- the running set is not the armed batch (a request finished, left, or was added);
- a decode would cross into a block it does not hold (``plan_decode`` would allocate, which can
  evict or preempt).
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from kvtier.sched.base import Policy, SchedulerDecision, SchedulerView
from kvtier.sched.swap_copy import SwapCopy
from kvtier.sim.core import EventLoop
from kvtier.sim.cost import BatchShape, CostModel, RooflineCostModel
from kvtier.sim.events.step_end import Step, StepEngine
from kvtier.sim.state import SimRequest


class _Config(Protocol):
    @property
    def swap_copy(self) -> SwapCopy: ...


class _LoadPaths(Protocol):
    interference: list[float]


class _Swaps(Protocol):
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
    if not engine.decode_fast_forward or engine.config.swap_copy.eager or _others_pending(engine):
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
    holds; False (and the run disarmed) if the slow path must plan it."""
    batch = engine.decode_run
    running = engine.running
    if batch is None or len(running) != len(batch) or _others_pending(engine):
        engine.decode_run = None
        return False
    block_tokens = engine.block_tokens
    decodes: list[tuple[SimRequest, int]] = []
    contexts: list[int] = []
    for r, armed in zip(running, batch, strict=True):
        context = r.req.prompt_tokens + r.generated_tokens
        # Engine.plan_decode's test: crossing into a block it does not hold allocates (slow path).
        held = r.locked_blocks + r.private_blocks + r.reserved_blocks
        if r is not armed or -(-(context + 1) // block_tokens) > held:
            engine.decode_run = None
            return False
        decodes.append((r, r.epoch))
        contexts.append(context)
    step = Step(engine, start_s=engine.loop.now_s)
    step.decodes = decodes
    step.decode_contexts = contexts
    # Engine.start_step's slowdown and compute time, with no loads in the step: the same floats.
    slowdown = max(engine.load_paths.interference, default=0.0)
    cost = engine.cost
    if type(cost) is RooflineCostModel:  # its decode-only form: the same float, fewer calls
        compute_s = cost.decode_step_time_s(contexts)
    else:
        compute_s = cost.step_time_s(BatchShape((), tuple(contexts)))
    step.compute_s = compute_s * (1.0 + slowdown)
    engine.stepping = True
    if not engine.swaps.holds_step(step):
        step.begin()
    return True
