"""One RotaSched iteration's plan (:class:`StepPlan`): the running requests' decodes and prefill
chunks, then the prioritised requests' swap-ins and admissions, each within the token budget, the
running slots and the device blocks left (:mod:`kvtier.sched.rotasched`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvtier.sched.base import Phase, RequestView, SchedulerDecision, SchedulerView
from kvtier.sched.batching import reusable_tokens
from kvtier.sched.claims import kv_blocks


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

    def run(self, running: Iterable[RequestView]) -> None:
        """Decodes and prefill chunks of the running requests that stay, in the view's order."""
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
        if r.phase is Phase.WAITING:
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
