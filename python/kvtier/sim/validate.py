"""Does the calibrated simulator predict the reference engine? (``kvtier bench engine``'s
``sim_ttft_error`` and ``sim_tpot_error``, issue 9 item 7.)

A held-out multi-turn chat workload — none of its batch shapes is one the calibration timed — runs
for real on the CPU reference engine (``fcfs``, chunked prefill, continuous batching, device prefix
cache; each conversation's next turn is sent the moment its previous reply finishes, and re-sends
the whole history). The same requests — prompt lengths, output lengths, block keys derived from the
real token ids (so prefix hits match), closed-loop parents — then run in the simulator with the
``fitted`` cost model and the engine's sizes. The errors are ``|sim - engine| / engine`` of the mean
TTFT and the mean TPOT.

The engine also caches the blocks of each reply, and the next turn's prompt contains that reply:
each simulated request therefore carries ``finish_keys`` (the keys of its prompt + reply blocks,
from the real tokens), which the simulator leaves in its device prefix cache at finish.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.errors import ConfigError
from kvtier.sim.calibrate import warm_up
from kvtier.sim.request import Request

QUESTIONS: tuple[tuple[str, ...], ...] = (
    (
        "Describe how a bicycle gear system works.",
        "Why do racing bikes have more gears?",
        "What about hills?",
    ),
    ("Suggest a name for a bakery.", "Make it sound French.", "Now a slogan for it."),
    ("What causes ocean tides?", "How often do they happen?", "Are they the same everywhere?"),
    ("Write a haiku about winter.", "Now one about spring.", "Which season do you prefer?"),
    ("How do vaccines train the immune system?", "What is a booster?", "Why are some yearly?"),
)


@dataclass(frozen=True)
class Turn:
    """One finished request of the engine run."""

    req_id: int
    parent_id: int | None
    prompt: list[int]
    output: list[int]
    output_tokens: int
    ttft_s: float
    tpot_s: float


def _block_keys(prompt: Sequence[int], block_tokens: int, req_id: int) -> tuple[int, ...]:
    """Chained keys of the prompt's full blocks (equal prefix, equal key); a partial tail gets a key
    of its own, as the simulator's workloads do."""
    keys = []
    h = hashlib.blake2b(digest_size=8)
    full = len(prompt) // block_tokens
    for i in range(full):
        h.update(np.asarray(prompt[i * block_tokens : (i + 1) * block_tokens], dtype=np.int64).tobytes())
        keys.append(int.from_bytes(h.copy().digest(), "little"))
    if len(prompt) % block_tokens:
        keys.append(
            int.from_bytes(hashlib.blake2b(f"tail-{req_id}".encode(), digest_size=8).digest(), "little")
        )
    return tuple(keys)


def run_engine(
    model: Any,
    tokenizer: Any,
    *,
    conversations: int,
    turns: int,
    reply_tokens: int,
    engine_config: Any,
) -> list[Turn]:
    """The workload on the real engine (closed loop, zero think time); one :class:`Turn` per request."""
    from kvtier.engine.sampling import SamplingParams
    from kvtier.engine.scheduler import Engine
    from kvtier.sched import make_policy

    if not 1 <= conversations <= len(QUESTIONS) or not 1 <= turns <= len(QUESTIONS[0]):
        raise ConfigError(
            f"{conversations} conversations x {turns} turns; expected at most {len(QUESTIONS)} x {len(QUESTIONS[0])}"
        )
    if reply_tokens < 2:
        raise ConfigError(f"reply_tokens is {reply_tokens}; expected >= 2 (TPOT needs two tokens)")
    warm_up(model)
    engine = Engine(model, make_policy("fcfs"), engine_config)
    params = SamplingParams(max_tokens=reply_tokens, ignore_eos=True)
    where: dict[int, tuple[int, int, int | None]] = {}  # req_id -> (conversation, turn, parent)
    for c in range(conversations):
        rid = engine.add_request(tokenizer.encode_instruct(QUESTIONS[c][0]), params)
        where[rid] = (c, 0, None)
    turns_out: list[Turn] = []
    while engine.has_unfinished():
        engine.step()
        for out in engine.pop_finished():
            c, t, parent = where[out.request_id]
            n = len(out.token_ids)
            turns_out.append(
                Turn(
                    out.request_id,
                    parent,
                    list(out.prompt_token_ids),
                    list(out.token_ids),
                    n,
                    out.ttft_s,
                    (out.latency_s - out.ttft_s) / (n - 1),
                )
            )
            if t + 1 < turns:
                follow = tokenizer.encode(f"\n{QUESTIONS[c][t + 1]}\n")
                rid = engine.add_request(list(out.prompt_token_ids) + list(out.token_ids) + follow, params)
                where[rid] = (c, t + 1, out.request_id)
    return sorted(turns_out, key=lambda x: x.req_id)


def simulate(turns: Sequence[Turn], engine_config: Any, calibration: str) -> dict[str, Any]:
    """The same requests in the simulator with the fitted cost model; returns its results."""
    from kvtier.sim.config import SimConfig
    from kvtier.sim.run import build

    config = SimConfig(
        name="engine-validation",
        hardware="cpu",
        model="smollm2-135m",
        policy={"name": "fcfs"},
        block_tokens=engine_config.block_tokens,
        max_batch_tokens=engine_config.max_batch_tokens,
        max_running=engine_config.max_running,
        device_blocks=engine_config.num_blocks,
        host_capacity_bytes=0,
        device_prefix_cache=engine_config.device_prefix_cache,
        cost={"kind": "fitted", "calibration": calibration},
    )
    sim = build(config)
    requests = [
        Request(
            t.req_id,
            0.0,
            len(t.prompt),
            t.output_tokens,
            _block_keys(t.prompt, engine_config.block_tokens, t.req_id),
            session_id=t.req_id if t.parent_id is None else -1,
            parent_id=t.parent_id,
            finish_keys=_block_keys(t.prompt + t.output, engine_config.block_tokens, t.req_id)[
                : (len(t.prompt) + t.output_tokens) // engine_config.block_tokens
            ],
        )
        for t in turns
    ]
    sim.cluster.feed(iter(requests))
    sim.loop.run()
    return sim.metrics.result()


def validate(
    *,
    calibration: str = "cpu-smollm2-135m",
    conversations: int = 4,
    turns: int = 3,
    reply_tokens: int = 12,
    threads: int = 1,
    model: Any = None,
    tokenizer: Any = None,
) -> dict[str, Any]:
    """Runs the held-out workload on the engine and in the simulator; returns both and the errors."""
    from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

    from kvtier.engine import load
    from kvtier.engine.scheduler import EngineConfig

    if model is None or tokenizer is None:
        model, tokenizer = load()
    config = EngineConfig(num_blocks=512, max_batch_tokens=256, max_running=16)
    with threadpool_limits(limits=threads, user_api="blas"):
        turns_run = run_engine(
            model, tokenizer, conversations=conversations, turns=turns, reply_tokens=reply_tokens,
            engine_config=config,
        )  # fmt: skip
    sim = simulate(turns_run, config, calibration)
    engine_ttft = float(np.mean([t.ttft_s for t in turns_run]))
    engine_tpot = float(np.mean([t.tpot_s for t in turns_run]))
    sim_ttft, sim_tpot = float(sim["ttft_s"]["mean"]), float(sim["tpot_s"]["mean"])
    return {
        "requests": len(turns_run),
        "calibration": calibration,
        "engine_mean_ttft_s": engine_ttft,
        "sim_mean_ttft_s": sim_ttft,
        "engine_mean_tpot_s": engine_tpot,
        "sim_mean_tpot_s": sim_tpot,
        "sim_ttft_error": abs(sim_ttft - engine_ttft) / engine_ttft,
        "sim_tpot_error": abs(sim_tpot - engine_tpot) / engine_tpot,
        "sim_requests": int(sim["requests"]),
    }
