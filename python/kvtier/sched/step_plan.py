"""One RotaSched iteration's plan (:class:`StepPlan`): the running requests' decodes and prefill
chunks, then the prioritised requests' swap-ins and admissions, each within the token budget, the
running slots and the device blocks left (:mod:`kvtier.sched.rotasched`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from operator import attrgetter
from typing import NamedTuple

from kvtier.sched.base import RequestView, SchedulerDecision, SchedulerView
from kvtier.sched.batching import reusable_tokens
from kvtier.sched.claims import claim, kv_blocks
from kvtier.sched.members import WAITING

_req_id = attrgetter("req_id")


class RunningBatch(NamedTuple):
    """What a running batch asks of one step where nothing binds: the blocks it claims
    (:func:`~kvtier.sched.claims.claim`, each >= 0), its tokens (a decode's one, an unfinished
    prompt's rest) and how many of them are prefills. RotaSched reads it in its visit of the running
    requests (:func:`~kvtier.sched.rota_seen.visit_running`), so that a step whose whole batch fits
    is planned without a pass of its own (issue 20)."""

    claims: int
    tokens: int
    prefills: int

    def without(self, out: Iterable[RequestView], block_tokens: int) -> RunningBatch:
        """The same totals with ``out`` (requests of the batch) left out."""
        claims, tokens, prefills = self
        for r in out:
            claims -= claim(r, block_tokens)
            if r.computed_tokens < r.prompt_tokens:
                tokens, prefills = tokens - (r.prompt_tokens - r.computed_tokens), prefills - 1
            else:
                tokens -= 1
        return RunningBatch(claims, tokens, prefills)


class StepPlan:
    """One iteration's decision with its token budget, running slots and device blocks free now.

    Requests are added in priority order; each takes what it needs or is skipped (it waits).
    ``free_blocks`` already counts what the swap-outs release at once (see :func:`released_now`).
    """

    def __init__(self, view: SchedulerView, free_blocks: int, swapped_out: Sequence[RequestView]) -> None:
        self.view = view
        self.decision = SchedulerDecision(swap_out=[r.req_id for r in swapped_out])
        self.budget = view.max_batch_tokens
        self.free_blocks = free_blocks
        self.slots = view.max_running - len(view.running) + len(swapped_out)

    def run(self, running: Sequence[RequestView], batch: RunningBatch | None = None) -> None:
        """Decodes and prefill chunks of the running requests that stay, in the view's order;
        ``batch``, if given, is their :class:`RunningBatch`."""
        if batch is not None and batch.tokens <= self.budget and batch.claims <= self.free_blocks:
            # Nothing binds: before each request the budget left is at least its tokens (> 0) and
            # the blocks left at least its claim (claims are >= 0), so the loop below would give
            # each its whole step (an unfinished prompt's rest in one chunk, its claim within the
            # blocks). The same lists, without a step per request.
            decision = self.decision
            if batch.prefills:
                decision.prefill.extend(
                    [
                        (r.req_id, r.prompt_tokens - r.computed_tokens)
                        for r in running
                        if r.computed_tokens < r.prompt_tokens
                    ]
                )
                decision.decode.extend([r.req_id for r in running if r.computed_tokens >= r.prompt_tokens])
            else:
                decision.decode.extend(map(_req_id, running))
            self.budget -= batch.tokens
            self.free_blocks -= batch.claims
            return
        # step_tokens, step_need and claim inline (per running request per step); a decode's
        # step_need for its one token is its claim. A request that cannot get its block now stalls
        # one iteration (no recompute preemption); its claim is set aside even when it waits.
        bt = self.view.block_tokens
        budget, free = self.budget, self.free_blocks
        prefill, decode = self.decision.prefill, self.decision.decode
        for r in running:
            computed, prompt = r.computed_tokens, r.prompt_tokens
            if computed < prompt:
                claimed = -(-prompt // bt) + (-computed // bt)  # the rest of the prompt
                if budget > 0:
                    rest = prompt - computed
                    n = rest if rest < budget else budget
                    if -(-(computed + n) // bt) + (-computed // bt) <= free:
                        budget -= n
                        prefill.append((r.req_id, n))
            else:
                generated = r.generated_tokens
                held = computed + generated - (1 if generated == 1 else 0)
                claimed = -(-(computed + generated + 1) // bt) + (-held // bt)
                if budget > 0 and claimed <= free:
                    budget -= 1
                    decode.append(r.req_id)
            free -= claimed
        self.budget, self.free_blocks = budget, free

    def swap_in(self, r: RequestView) -> bool:
        if r.phase is WAITING:
            need = kv_blocks(r, self.view.block_tokens)
        else:  # kv_blocks inline: up to every rotary request per step
            need = -(-(r.computed_tokens + r.generated_tokens) // self.view.block_tokens)
        if need > self.free_blocks or self.slots <= 0:
            return False
        self.decision.swap_in.append(r.req_id)
        self.free_blocks -= need
        self.slots -= 1
        return True

    def admit(self, r: RequestView) -> bool:
        """Starts a waiting request's prefill; its whole prompt's blocks are set aside."""
        need = kv_blocks(r, self.view.block_tokens)
        if self.budget <= 0 or self.slots <= 0 or need > self.free_blocks:
            return False
        n = min(r.prompt_tokens - reusable_tokens(r, with_lower_tiers=False), self.budget)
        self.decision.prefill.append((r.req_id, n))
        self.budget -= n
        self.free_blocks -= need
        self.slots -= 1
        return True
