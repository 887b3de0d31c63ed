"""Device blocks a running request claims in one step: what the swap policies (RotaSched's
:class:`~kvtier.sched.rotasched.StepPlan`, the static swap policies) plan a running batch with.

A request holds device slots for its computed + generated tokens, except right after its prefill
(one token generated, none of it stored yet); a step adds a prefill chunk's tokens or a decode's
one token, and claims the blocks those need (the rest of an unfinished prompt is set aside whole).
Also Algorithm 1's blk(r) (:func:`kv_blocks`) and what a swap-out frees at once (:func:`released_now`).
"""

from __future__ import annotations

from kvtier.sched.base import RequestView, SchedulerView
from kvtier.sched.batching import blocks_for
from kvtier.sched.members import DEVICE, WAITING
from kvtier.sched.swap_copy import SwapCopy


def step_need(r: RequestView, tokens: int, block_tokens: int) -> int:
    """New device blocks a running request needs to compute ``tokens`` more this step.

    A prefill chunk needs slots for ``computed + tokens``; a decode step slots for prompt + generated
    + 1 (the engine's convention). A request holds slots for computed + generated tokens, except
    right after its prefill (one token generated, none of it stored yet).
    """
    # Runs a few times per running request per step: blocks_for spelled inline (-(-n // bt)).
    computed = r.computed_tokens
    if computed < r.prompt_tokens:
        return -(-(computed + tokens) // block_tokens) + (-computed // block_tokens)
    generated = r.generated_tokens
    held = computed + generated - (1 if generated == 1 else 0)
    return -(-(computed + generated + tokens) // block_tokens) + (-held // block_tokens)


def step_tokens(r: RequestView, budget: int) -> int:
    """Tokens a running request computes this step: a decode token or a prefill chunk."""
    if r.computed_tokens < r.prompt_tokens:
        return min(r.remaining_prefill_tokens, budget)
    return 1


def claim(r: RequestView, block_tokens: int) -> int:
    """Blocks a running request claims beyond what it holds: the rest of an unfinished prompt, or
    the new block a decode whose next token starts one needs."""
    computed = r.computed_tokens
    if computed < r.prompt_tokens:  # the rest of the prompt
        return -(-r.prompt_tokens // block_tokens) + (-computed // block_tokens)
    generated = r.generated_tokens  # step_need(r, 1, block_tokens), inline
    held = computed + generated - (1 if generated == 1 else 0)
    return -(-(computed + generated + 1) // block_tokens) + (-held // block_tokens)


def running_claims(view: SchedulerView) -> int:
    """What the whole running batch claims (:func:`claim`, inline: per running request per step)."""
    bt, total = view.block_tokens, 0
    for r in view.running:
        computed = r.computed_tokens
        if computed < r.prompt_tokens:
            total += -(-r.prompt_tokens // bt) + (-computed // bt)
        else:
            generated = r.generated_tokens
            held = computed + generated - (1 if generated == 1 else 0)
            total += -(-(computed + generated + 1) // bt) + (-held // bt)
    return total


def kv_blocks(r: RequestView, block_tokens: int) -> int:
    """blk(r) of Algorithm 1: the device blocks a request holds (running, rotary) or needs for its
    whole prompt (waiting; its device-cached prefix is already there)."""
    if r.phase is WAITING:
        return blocks_for(r.prompt_tokens, block_tokens) - r.cached_tokens[DEVICE] // block_tokens
    return blocks_for(r.computed_tokens + r.generated_tokens, block_tokens)


def released_now(r: RequestView, copy: SwapCopy, synced_blocks: int, block_tokens: int) -> int:
    """Device blocks a swap-out frees for this very iteration: all of them if the copy runs before
    the step writes HBM (sync "step"); with eager rotation its synced blocks (a host copy exists,
    §4.3.2); otherwise none until the copy lands."""
    held = kv_blocks(r, block_tokens)
    if copy.sync == "step":
        return held
    if copy.eager:
        return min(synced_blocks, held)
    return 0
