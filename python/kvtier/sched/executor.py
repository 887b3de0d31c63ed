"""One decision executor: the order and the validation of applying a :class:`SchedulerDecision`.

Both step loops — the reference engine (:mod:`kvtier.engine.scheduler`, real KV) and the simulated
engine (:mod:`kvtier.sim.engine`, modelled time) — hand their policy's decision to :func:`execute`
with themselves as the :class:`DecisionBackend`. The executor decides what happens in which order
and what is an error; a backend only carries out one order at a time (mechanism). A policy
validated on the reference engine is therefore the policy the simulator runs.

The order, for every step:

1. Validation before anything moves: every request an order names exists; a load's target is
   ``Tier.DEVICE`` or ``Tier.HOST``; a request has at most one load and appears at most once among the
   prefills and decodes; a host prefetch never comes with a prefill of the same request.
2. The epochs of the requests planned for prefill or decode are read: work planned for a request
   that leaves the device during this step (preempted or swapped out, by the decision or passively
   by another request's allocation) is dropped, as the step it was planned for no longer holds it.
3. Preemptions (of running requests), swap-outs (running), swap-ins (swapped), then the step's
   swap transfers leave (:meth:`DecisionBackend.end_swaps`).
4. Prefill chunks in the decision's order, each with its request's load, if any.
5. Decodes: a request must be running with its prefill done.
6. Loads of requests not prefilled this step: ``Tier.DEVICE`` starts a load on its own
   (:meth:`DecisionBackend.start_load`, the fetching queue), ``Tier.HOST`` a prefetch into host memory
   (of a waiting request).

An order a backend cannot carry out raises (:meth:`DecisionBackend.error`); it never vanishes. An
order that cannot be carried out *now* is a state, not an error: a swap-in or admission without free
blocks leaves the request where it is and the policy asks again next step; a swap-out host has no
room for preempts the request by recompute (vLLM's passive preemption), as both backends do.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Protocol, TypeVar, cast

from kvtier.sched.base import LoadOrder, Phase, Policy, SchedulerDecision
from kvtier.sched.members import HOST, RUNNING, SWAPPED, WAITING
from kvtier.tiers import Tier

_epoch = attrgetter("epoch")  # map()ped over a step's decodes (C, no frame per request)

#: Where a :class:`LoadOrder` may bring KV: the device, or host memory only (a prefetch).
LOAD_TARGETS = (Tier.DEVICE, Tier.HOST)


class PlannedRequest(Protocol):
    """What the executor reads of a backend's request."""

    @property
    def req_id(self) -> int: ...
    @property
    def phase(self) -> Phase: ...
    @property
    def epoch(self) -> int: ...  # bumped when it leaves the device (preempted, swapped out)
    @property
    def prefill_done(self) -> bool: ...  # its prompt's KV is computed: it may decode


R = TypeVar("R", bound=PlannedRequest)
P = TypeVar("P", contravariant=True)  # the backend's plan of one step


class DecisionBackend(Protocol[R, P]):
    """The mechanism of one engine: each method carries out one order on ``R`` requests, adding the
    step's work to a plan ``P``. Phases are checked by the executor before each call."""

    @property
    def policy(self) -> Policy: ...

    def error(self, message: str) -> Exception:
        """The exception this backend raises for a decision it cannot carry out."""
        ...

    def find(self, req_id: int) -> R | None: ...

    def preempt(self, r: R) -> None:
        """Drops the running ``r``'s device KV; it waits and computes it again."""
        ...

    def swap_out(self, r: R) -> None:
        """Copies the running ``r``'s KV to host (or preempts it where host has no room)."""
        ...

    def swap_in(self, r: R) -> None:
        """Brings the swapped ``r``'s KV back (nothing, if its blocks are not free now)."""
        ...

    def end_swaps(self) -> None:
        """The step's swap-outs and swap-ins are all issued: send what was batched."""
        ...

    def plan_prefill(self, plan: P, r: R, tokens: int, load: LoadOrder | None) -> None:
        """Adds up to ``tokens`` prompt tokens of ``r`` (admitted first if waiting), after ``load``."""
        ...

    def plan_decode(self, plan: P, r: R) -> None: ...

    def start_load(self, r: R, load: LoadOrder) -> None:
        """Brings ``r``'s cached prefix to the device while it is out of the step's batch."""
        ...

    def prefetch(self, r: R, load: LoadOrder) -> None:
        """Brings the waiting ``r``'s SSD/remote prefix up into host memory only."""
        ...


def execute(decision: SchedulerDecision, backend: DecisionBackend[R, P], plan: P) -> None:
    """Applies ``decision`` through ``backend`` in the executor's order (see the module doc)."""
    name = backend.policy.name

    def get(rid: int, what: str) -> R:
        r = backend.find(rid)
        if r is None:
            raise backend.error(f"policy {name!r} asked to {what} unknown request {rid}")
        return r

    def expect(r: R, phase: Phase, what: str) -> R:
        if r.phase is not phase:
            raise backend.error(f"policy {name!r} {what} request {r.req_id} in phase {r.phase.value}")
        return r

    loads = _loads_by_request(decision, backend, name)
    for rid in loads:
        get(rid, "load")
    prefills = [(get(rid, "prefill"), tokens) for rid, tokens in decision.prefill]
    find = backend.find  # a decode per running request per step: no closure call each
    running = RUNNING
    found = list(map(find, decision.decode))
    if None in found:
        get(decision.decode[found.index(None)], "decode")  # raises: the first unknown one
    decodes = cast("list[R]", found)  # no None left (checked above)
    planned = [rid for rid, _ in decision.prefill]
    planned.extend(decision.decode)
    if len(set(planned)) != len(planned):
        raise backend.error(f"policy {name!r} plans a request twice in one step: {sorted(planned)}")
    prefill_epochs = [r.epoch for r, _ in prefills]
    decode_epochs = list(map(_epoch, decodes))
    for rid in decision.preempt:
        backend.preempt(expect(get(rid, "preempt"), RUNNING, "preempts"))
    # Swaps: get and expect inline (a rotating policy swaps ~20 requests each way per step).
    swap_out, swap_in = backend.swap_out, backend.swap_in
    for rid in decision.swap_out:
        found_r = find(rid)
        if found_r is None or found_r.phase is not running:
            found_r = expect(get(rid, "swap out"), running, "swaps out")  # raises
        swap_out(found_r)
    swapped = SWAPPED
    for rid in decision.swap_in:
        found_r = find(rid)
        if found_r is None or found_r.phase is not swapped:
            found_r = expect(get(rid, "swap in"), swapped, "swaps in")  # raises
        swap_in(found_r)
    backend.end_swaps()
    for (r, tokens), epoch in zip(prefills, prefill_epochs, strict=True):
        if r.epoch == epoch:  # else it left the device while this step was planned
            load = loads.pop(r.req_id, None)
            if load is not None and load.target is HOST:
                raise backend.error(
                    f"policy {name!r} prefills request {r.req_id} and prefetches it to host in one step"
                )
            backend.plan_prefill(plan, r, tokens, load)
    plan_decode = backend.plan_decode
    for r, epoch in zip(decodes, decode_epochs, strict=True):
        if r.epoch != epoch:
            continue
        if r.phase is not running or not r.prefill_done:
            raise backend.error(
                f"policy {name!r} decodes request {r.req_id} ({r.phase.value}) before its prefill is done"
            )
        plan_decode(plan, r)
    for load in loads.values():  # loads of requests not prefilled this step
        r = get(load.req_id, "load")
        if load.target is HOST:
            backend.prefetch(expect(r, WAITING, "prefetches"), load)
        else:
            backend.start_load(r, load)


def _loads_by_request(
    decision: SchedulerDecision, backend: DecisionBackend[R, P], name: str
) -> dict[int, LoadOrder]:
    loads: dict[int, LoadOrder] = {}
    for load in decision.loads:
        if load.target not in LOAD_TARGETS:
            raise backend.error(
                f"policy {name!r}: load target {_shown(load.target)} for request {load.req_id}; "
                f"expected one of {', '.join(t.label for t in LOAD_TARGETS)}"
            )
        if load.req_id in loads:
            raise backend.error(f"policy {name!r} orders two loads for request {load.req_id} in one step")
        loads[load.req_id] = load
    return loads


def _shown(target: object) -> str:
    """A load target as an error shows it: a tier by its label, anything else by its repr."""
    return repr(target.label) if isinstance(target, Tier) else repr(target)
