"""Multi-turn chat: sessions of several turns, each turn's prompt the whole history so far.

Turn ``k`` of a session sends ``system prompt + (user_1, answer_1, ..., user_{k-1}, answer_{k-1}) +
user_k``, so turn ``k + 1`` repeats turn ``k``'s prompt and extends it: its block keys start with turn
``k``'s full-block keys. Turn ``k``'s partial tail block is not shared (turn ``k + 1`` fills it with
the answer's first tokens, different content, so a different key). Sessions share the full blocks
of the system prompt when ``system_prompt_tokens > 0``.

A session's first turn arrives open-loop (``arrival`` process of sessions, ``rate_per_s`` sessions a
second); every later turn is closed-loop: ``parent_id`` is the previous turn and ``think_time_s`` an
exponential think time of mean ``think_time_mean_s`` (60 s by default, the think time Strata §5.1 and
Pensieve insert between ShareGPT rounds). A session's turns are yielded right after its first; a
closed-loop turn's ``arrival_s`` is its session's start (the simulator ignores it until the parent
finishes), so the stream's ``arrival_s`` never decreases.

ShareGPT-like shapes: answers log-normal with mean ``output_tokens_mean`` (260.9 tokens, ShareGPT's
mean output in Strata Table 1; SuperInfer §5.1 serves the same dataset); user messages log-normal
with mean ``user_tokens_mean`` and turns per session geometric with mean ``turns_mean`` (capped at
``turns_max``). The papers give no per-turn split, so those two defaults (60 tokens, 3 turns) are
chosen so that the mean prompt, history included, is ~700 tokens, near ShareGPT's 680.9 in Strata
Table 1. A session ends early when the next prompt plus its answer would exceed
``max_context_tokens``.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from kvtier.sim.request import Request
from kvtier.sim.workload.arrivals import make_arrivals
from kvtier.sim.workload.common import (
    ContextKeys,
    KeyAllocator,
    Session,
    lognormal_tokens,
    require_at_least,
    require_block_tokens,
    require_int,
    require_non_negative,
    require_positive,
)


def multiturn_workload(
    *,
    block_tokens: int,
    num_sessions: int = 200,
    rate_per_s: float = 0.5,
    arrival: str = "poisson",
    cv: float = 1.0,
    turns_mean: float = 3.0,
    turns_max: int = 32,
    system_prompt_tokens: int = 0,
    user_tokens_mean: float = 60.0,
    user_tokens_sigma: float = 1.0,
    output_tokens_mean: float = 260.9,
    output_tokens_sigma: float = 0.8,
    output_tokens_max: int = 2048,
    think_time_mean_s: float = 60.0,
    max_context_tokens: int = 32_768,
    seed: int = 0,
) -> Iterator[Request]:
    """``num_sessions`` chat sessions; parameters are checked now, requests made as they are read."""
    block_tokens = require_block_tokens(block_tokens)
    num_sessions = require_int("num_sessions", num_sessions, 1)
    turns_mean = require_at_least("turns_mean", turns_mean, 1.0)
    turns_max = require_int("turns_max", turns_max, 1)
    system_tokens = require_int("system_prompt_tokens", system_prompt_tokens, 0)
    user_mean = require_positive("user_tokens_mean", user_tokens_mean)
    user_sigma = require_positive("user_tokens_sigma", user_tokens_sigma)
    output_mean = require_positive("output_tokens_mean", output_tokens_mean)
    output_sigma = require_positive("output_tokens_sigma", output_tokens_sigma)
    output_max = require_int("output_tokens_max", output_tokens_max, 1)
    think_mean_s = require_non_negative("think_time_mean_s", think_time_mean_s)
    max_context = require_int("max_context_tokens", max_context_tokens, system_tokens + 2)

    arrival_seed, shape_seed = np.random.SeedSequence(require_int("seed", seed, 0)).spawn(2)
    arrivals = make_arrivals(arrival, rate_per_s, np.random.default_rng(arrival_seed), cv=cv)
    rng = np.random.default_rng(shape_seed)

    def generate() -> Iterator[Request]:
        keys = KeyAllocator()
        system_keys = tuple(keys.fresh(system_tokens // block_tokens))
        req_ids = iter(range(2**62))
        for session_id, start_s in zip(range(num_sessions), arrivals, strict=False):
            num_turns = min(int(rng.geometric(1.0 / turns_mean)), turns_max)
            session = Session(ContextKeys(keys, block_tokens, system_keys), req_ids, session_id, start_s)
            history_tokens = system_tokens
            for _ in range(num_turns):
                user_tokens = lognormal_tokens(rng, user_mean, user_sigma, 1, max_context)
                output_tokens = lognormal_tokens(rng, output_mean, output_sigma, 1, output_max)
                prompt_tokens = history_tokens + user_tokens
                if prompt_tokens + output_tokens > max_context:
                    if session.parent_id is not None:
                        break
                    # The first turn always runs, shortened to fit.
                    output_tokens = min(output_tokens, max_context - history_tokens - 1)
                    prompt_tokens = max_context - output_tokens
                yield session.turn(prompt_tokens, output_tokens, rng, think_mean_s)
                history_tokens = prompt_tokens + output_tokens

    return generate()
