"""Agentic trajectories: dozens to hundreds of steps, each a long reused context plus a short append.

Step ``k`` of a trajectory sends ``a_1 + g_1 + ... + a_{k-1} + g_{k-1} + a_k`` (appended tokens ``a``,
mostly tool output, and generated tokens ``g``) and generates ``g_k`` (DualPath App. A.3), so step
``k + 1``'s block keys start with step ``k``'s full-block keys (its partial tail block is not shared,
see :class:`~kvtier.sim.workload.common.ContextKeys`). Like DualPath (App. A.4) KV is reused only
within a trajectory: trajectories share no blocks.

A trajectory's first step arrives open-loop (``arrival`` process, ``rate_per_s`` trajectories a second;
``arrival="batch"`` starts them all at 0, DualPath's offline agent batches, §7). Every later step is
closed-loop: ``parent_id`` is the previous step, ``think_time_s`` the tool's run time, exponential of
mean ``tool_time_mean_s`` (0 by default: DualPath replays recorded tool outputs). A trajectory's
steps are yielded right after its first step, with its ``arrival_s``.

Shapes follow DualPath Table 2 (production coding-agent RL traces, 500 trajectories each), chosen by
``dataset`` (the maximum agent length, MAL):

=======  =====  ======  ===  ======  =======
MaxLen   Turns  Append  Gen  Total   Context
=======  =====  ======  ===  ======  =======
32K      60     608     148  28,639  17,183
48K      106    474     172  42,607  25,120
64K      157    429     176  55,958  32,721
=======  =====  ======  ===  ======  =======

The table gives means only, and they are not jointly reproducible by plain accumulation (157 turns
of 429 + 176 tokens is 95K tokens, beyond 64K; the per-turn means are presumably averaged per
trajectory). The generator keeps what drives KV traffic, the per-step append and generation means,
and bounds the context like the paper's own scaling runs: "truncate the whole trajectory at given
MAL" (§7). Appends are log-normal (mean ``Append``, ``append_tokens_sigma`` 1.0: mostly short tool
outputs, some long file dumps), generations log-normal (mean ``Gen``, sigma 0.5), the planned
number of turns log-normal (mean ``Turns``, sigma 0.5); a trajectory stops at its planned turns or
when the next step would pass MaxLen, whichever is first. Realised with the defaults (seed 0, 500
trajectories; 32K / 48K / 64K): mean final length 28.6K / 43.9K / 60.2K (Total: 28.6K / 42.6K /
56.0K), mean prompt per step 15.0K / 22.8K / 31.0K (Context: 17.2K / 25.1K / 32.7K), mean append
588 / 468 / 427 and generation 148 / 172 / 176 per step, but 39 / 69 / 100 steps (Turns: 60 / 106 /
157).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

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
    require_choice,
    require_int,
    require_non_negative,
    require_positive,
)


@dataclass(frozen=True, slots=True)
class TrajectoryShape:
    """One row of DualPath Table 2 (means)."""

    max_context_tokens: int
    turns_mean: float
    append_tokens_mean: float
    gen_tokens_mean: float


AGENTIC_DATASETS: dict[str, TrajectoryShape] = {
    "32k": TrajectoryShape(32 * 1024, 60, 608, 148),
    "48k": TrajectoryShape(48 * 1024, 106, 474, 172),
    "64k": TrajectoryShape(64 * 1024, 157, 429, 176),
}


def agentic_workload(
    *,
    block_tokens: int,
    num_trajectories: int = 500,
    dataset: str = "64k",
    rate_per_s: float = 1.0,
    arrival: str = "poisson",
    cv: float = 1.0,
    max_context_tokens: int | None = None,
    turns_mean: float | None = None,
    turns_sigma: float = 0.5,
    append_tokens_mean: float | None = None,
    append_tokens_sigma: float = 1.0,
    gen_tokens_mean: float | None = None,
    gen_tokens_sigma: float = 0.5,
    tool_time_mean_s: float = 0.0,
    seed: int = 0,
) -> Iterator[Request]:
    """``num_trajectories`` agent trajectories; parameters left at ``None`` take ``dataset``'s values."""
    block_tokens = require_block_tokens(block_tokens)
    preset = AGENTIC_DATASETS[require_choice("dataset", dataset, tuple(AGENTIC_DATASETS))]
    num_trajectories = require_int("num_trajectories", num_trajectories, 1)
    max_context = require_int(
        "max_context_tokens",
        preset.max_context_tokens if max_context_tokens is None else max_context_tokens,
        2,
    )
    turns_mu = require_at_least("turns_mean", preset.turns_mean if turns_mean is None else turns_mean, 1.0)
    turns_sigma = require_positive("turns_sigma", turns_sigma)
    append_mean = require_positive(
        "append_tokens_mean", preset.append_tokens_mean if append_tokens_mean is None else append_tokens_mean
    )
    append_sigma = require_positive("append_tokens_sigma", append_tokens_sigma)
    gen_mean = require_positive(
        "gen_tokens_mean", preset.gen_tokens_mean if gen_tokens_mean is None else gen_tokens_mean
    )
    gen_sigma = require_positive("gen_tokens_sigma", gen_tokens_sigma)
    tool_mean_s = require_non_negative("tool_time_mean_s", tool_time_mean_s)

    arrival_seed, shape_seed = np.random.SeedSequence(require_int("seed", seed, 0)).spawn(2)
    arrivals = make_arrivals(arrival, rate_per_s, np.random.default_rng(arrival_seed), cv=cv)
    rng = np.random.default_rng(shape_seed)

    def generate() -> Iterator[Request]:
        keys = KeyAllocator()
        req_ids = iter(range(2**62))
        for trajectory_id, start_s in zip(range(num_trajectories), arrivals, strict=False):
            planned_turns = lognormal_tokens(rng, turns_mu, turns_sigma, 1, 1_000_000)
            session = Session(ContextKeys(keys, block_tokens), req_ids, trajectory_id, start_s)
            context_tokens = 0
            for _ in range(planned_turns):
                append_tokens = lognormal_tokens(rng, append_mean, append_sigma, 1, max_context - 1)
                gen_tokens = lognormal_tokens(rng, gen_mean, gen_sigma, 1, max_context - 1)
                if context_tokens + append_tokens + gen_tokens > max_context:
                    if session.parent_id is not None:
                        break  # truncated at MaxLen (DualPath §7)
                    append_tokens = max_context - gen_tokens  # the first step always runs
                prompt_tokens = context_tokens + append_tokens
                yield session.turn(prompt_tokens, gen_tokens, rng, tool_mean_s)  # think time: tool time
                context_tokens = prompt_tokens + gen_tokens

    return generate()
