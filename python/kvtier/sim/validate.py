"""Does the calibrated simulator predict the reference engine? The simulator's half of ``kvtier
bench engine``'s ``sim_ttft_error`` and ``sim_tpot_error`` (issue 9 item 7): the engine's run is
:mod:`kvtier.engine.validate`, which hands its finished requests (:class:`Turn`) to
:func:`simulate` and :func:`compare`; this module needs no engine (issue 18).

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
from typing import Any, Protocol

import numpy as np

from kvtier.sim.config import SimConfig
from kvtier.sim.cost import read_calibration
from kvtier.sim.machine import differences
from kvtier.sim.owner import StepSizes
from kvtier.sim.request import Request
from kvtier.sim.run import build


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


class EngineSizes(StepSizes, Protocol):
    """The engine's sizes the simulation copies (:class:`kvtier.engine.config.EngineConfig` has them)."""

    @property
    def num_blocks(self) -> int: ...
    @property
    def device_prefix_cache(self) -> bool: ...


def simulate(turns: Sequence[Turn], engine_config: EngineSizes, calibration: str) -> dict[str, Any]:
    """The same requests in the simulator with the fitted cost model; returns its results."""
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


def compare(turns: Sequence[Turn], sim: dict[str, Any], calibration: str) -> dict[str, Any]:
    """The engine's and the simulator's mean TTFT and TPOT, and the errors ``|sim - engine| / engine``."""
    engine_ttft = float(np.mean([t.ttft_s for t in turns]))
    engine_tpot = float(np.mean([t.tpot_s for t in turns]))
    sim_ttft, sim_tpot = float(sim["ttft_s"]["mean"]), float(sim["tpot_s"]["mean"])
    differs = differences(read_calibration(calibration).get("machine"))
    return {
        "requests": len(turns),
        "calibration": calibration,
        # Empty when the calibration was fitted on this kind of machine; else what differs (and the
        # errors below say little about the model: refit with `kvtier sim calibrate`).
        "calibration_machine_differences": differs,
        "calibration_fitted_here": not differs,
        "engine_mean_ttft_s": engine_ttft,
        "sim_mean_ttft_s": sim_ttft,
        "engine_mean_tpot_s": engine_tpot,
        "sim_mean_tpot_s": sim_tpot,
        "sim_ttft_error": abs(sim_ttft - engine_ttft) / engine_ttft,
        "sim_tpot_error": abs(sim_tpot - engine_tpot) / engine_tpot,
        "sim_requests": int(sim["requests"]),
    }
