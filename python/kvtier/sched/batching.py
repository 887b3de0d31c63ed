"""First-come-first-served batch formation shared by the baseline policies.

vLLM v1's order: running requests first (decodes and unfinished chunked prefills, oldest first),
then waiting requests in arrival order while the token budget, the running-request bound and the
free device blocks allow; the first waiting request that does not fit stops admission (no
overtaking, as in vLLM's FCFS queue).
"""

from __future__ import annotations

from kvtier.sched.base import LoadMode, LoadOrder, RequestView, SchedulerDecision, SchedulerView
from kvtier.sched.members import DEVICE


def blocks_for(tokens: int, block_tokens: int) -> int:
    return -(-tokens // block_tokens)


def schedule_running(view: SchedulerView, decision: SchedulerDecision) -> int:
    """Adds decodes and prefill chunks of running requests; returns the token budget left."""
    budget = view.max_batch_tokens
    for r in view.running:
        if budget <= 0:
            break
        if r.computed_tokens < r.prompt_tokens:
            n = min(r.remaining_prefill_tokens, budget)
            decision.prefill.append((r.req_id, n))
            budget -= n
        else:
            decision.decode.append(r.req_id)
            budget -= 1
    return budget


def steady_fcfs(view: SchedulerView) -> bool:
    """:meth:`Policy.steady_decode` of a policy that is :func:`schedule_running` then
    :func:`admit_fcfs` (or any admission that orders nothing with nobody waiting or fetching):
    with nothing but running decodes, every one fits the token budget and nobody can be admitted."""
    return (
        not view.waiting
        and not view.fetching
        and not view.swapped
        and len(view.running) <= view.max_batch_tokens
        and all(r.computed_tokens >= r.prompt_tokens for r in view.running)
    )


def admit_fcfs(
    view: SchedulerView,
    decision: SchedulerDecision,
    budget: int,
    load_mode: LoadMode | None,
    load_priority: int = 1,
    reserve_full_prompt: bool = False,
) -> None:
    """Admits waiting requests in order. With ``load_mode``, their host/SSD/remote prefix is loaded.

    ``reserve_full_prompt``: admit only if the blocks of the whole prompt are available, not just
    those of the first chunk (SGLang's PrefillAdder budgets a request's whole input; vLLM v1
    allocates chunk by chunk and preempts when it runs out).
    """
    free_blocks = view.free_device_blocks
    running = len(view.running)
    for r in view.waiting:
        if budget <= 0 or running >= view.max_running:
            break
        reused = reusable_tokens(r, load_mode is not None)
        n = min(r.prompt_tokens - reused, budget)
        held = reused + (r.prompt_tokens - reused if reserve_full_prompt else n)
        need = blocks_for(held, view.block_tokens) - blocks_for(r.cached_tokens[DEVICE], view.block_tokens)
        if need > free_blocks:
            break
        loaded = reused - r.cached_tokens[DEVICE]
        if load_mode is not None and loaded > 0:
            decision.loads.append(LoadOrder(r.req_id, loaded, load_mode, load_priority))
        decision.prefill.append((r.req_id, n))
        budget -= n
        free_blocks -= need
        running += 1


def reusable_tokens(r: RequestView, with_lower_tiers: bool) -> int:
    """Prompt tokens a request can reuse: its device prefix, plus lower tiers when it loads.

    At least one prompt token is always computed (it yields the first output token's logits).
    """
    cached = sum(r.cached_tokens) if with_lower_tiers else r.cached_tokens[DEVICE]
    return min(cached, r.prompt_tokens - 1)
