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
TTFT and the mean TPOT, the engine's figure being the mean over repeated runs; the same workload's
spread over those runs (``engine_ttft_noise``, ``engine_tpot_noise``: (max - min) / mean of the
runs' means) is the noise floor the errors are judged against. :func:`compare` also reports the
cost model's error on the engine's own steps of the first run (their batch shapes and times), and
whether the simulator computed the same batch shapes: a prefix hit is a prefill chunk after its
cached tokens on both sides, so the model's step error on such a workload is the simulator's.

The engine also caches the blocks of each reply, and the next turn's prompt contains that reply:
each simulated request therefore carries ``finish_keys`` (the keys of its prompt + reply blocks,
from the real tokens), which the simulator leaves in its device prefix cache at finish.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NotRequired, Protocol, TypedDict

import numpy as np

from kvtier.errors import ConfigError
from kvtier.sim.calibrate import Sample, canonical
from kvtier.sim.cluster import Cluster
from kvtier.sim.config import SimConfig
from kvtier.sim.cost import BatchShape, CostModel, FittedCostModel, load_calibration, read_calibration
from kvtier.sim.machine import differences
from kvtier.sim.metrics import SimMetrics
from kvtier.sim.owner import StepSizes
from kvtier.sim.request import Request
from kvtier.sim.run import build, replay


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


class StepErrors(TypedDict):
    """:func:`step_errors`: the fitted model on the engine's own steps (none: only the counts)."""

    engine_steps: int
    sim_steps: int
    sim_steps_match_engine: NotRequired[bool]
    step_mean_error: NotRequired[float]
    step_mean_abs_error: NotRequired[float]


class Comparison(StepErrors):
    """:func:`compare`: the engine's and the simulator's TTFT and TPOT, their errors and the noise."""

    requests: int
    engine_runs: int
    calibration: str
    # Empty when the calibration was fitted on this kind of machine; else what differs (and the
    # errors below say little about the model: refit with `kvtier sim calibrate`).
    calibration_machine_differences: list[str]
    calibration_fitted_here: bool
    engine_mean_ttft_s: float
    sim_mean_ttft_s: float
    engine_mean_tpot_s: float
    sim_mean_tpot_s: float
    sim_ttft_error: float
    sim_tpot_error: float
    # The same workload's own spread over the engine runs (0 with one run): the noise floor.
    engine_ttft_noise: float
    engine_tpot_noise: float
    engine_run_mean_ttft_s: list[float]
    engine_run_mean_tpot_s: list[float]
    sim_requests: int


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


@dataclass
class _Recorded:
    """A cost model that keeps every batch shape the simulated engine asks it to time."""

    cost: CostModel
    shapes: list[BatchShape]

    def step_time_s(self, batch: BatchShape) -> float:
        if not batch.is_empty:
            self.shapes.append(batch)
        return self.cost.step_time_s(batch)

    def prefill_time_s(self, new_tokens: int, context_tokens: int = 0) -> float:
        return self.cost.prefill_time_s(new_tokens, context_tokens)

    def transfer_work_s(
        self, nbytes: int, segment_bytes: int, bandwidth_bytes_per_s: float, per_segment_overhead_s: float
    ) -> float:
        return self.cost.transfer_work_s(nbytes, segment_bytes, bandwidth_bytes_per_s, per_segment_overhead_s)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.cost.kv_bytes_per_token

    @property
    def num_layers(self) -> int:
        return self.cost.num_layers


def simulate(
    turns: Sequence[Turn],
    engine_config: EngineSizes,
    calibration: str,
    step_shapes: list[BatchShape] | None = None,
    *,
    host_capacity_bytes: int = 0,
    ssd_capacity_bytes: int = 0,
    connector: bool = False,
    model: str = "smollm2-135m",
) -> SimMetrics:
    """The same requests in the simulator with the fitted cost model; returns its results.
    ``step_shapes``, a list, receives the batch shape of every step the simulator computed. With
    ``host_capacity_bytes``, a host tier (the ``cpu`` profile's measured memcpy link) holds every
    computed block (written through) and a hit in it is loaded before the step that needs it, as
    vLLM's connector loads a kvtier hit (the ``lmcache`` policy: ``fcfs`` with synchronous loads
    of one block per object); with ``ssd_capacity_bytes`` too, an SSD tier below it (the ``cpu``
    profile's disk), written through as well, so a hit the host tier no longer holds is read from
    SSD. ``connector``: the engine ran kvtier's connector, so its steps cost what the calibration's
    ``connector`` section adds (:func:`kvtier.sim.cost.load_calibration`). ``model`` is the model profile (name or YAML path: its dtype sizes
    the KV a load moves)."""
    policy: dict[str, Any] = {"name": "fcfs"}
    if host_capacity_bytes or ssd_capacity_bytes:
        policy = {"name": "lmcache"}  # its objects: the config's block_tokens
    config = SimConfig(
        name="engine-validation",
        hardware="cpu",
        model=model,
        policy=policy,
        block_tokens=engine_config.block_tokens,
        max_batch_tokens=engine_config.max_batch_tokens,
        max_running=engine_config.max_running,
        device_blocks=engine_config.num_blocks,
        host_capacity_bytes=host_capacity_bytes,
        ssd_capacity_bytes=ssd_capacity_bytes,
        device_prefix_cache=engine_config.device_prefix_cache,
        cost={"kind": "fitted", "calibration": calibration, **({"connector": True} if connector else {})},
    )
    sim = build(config)
    if step_shapes is not None:
        if not isinstance(sim.cluster, Cluster) or len(sim.cluster.engines) != 1:
            raise ConfigError("the engine validation simulates one colocated engine")
        engine = sim.cluster.engines[0]
        engine.cost = _Recorded(engine.cost, step_shapes)
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
    replay(sim)
    return sim.metrics.result()


def _spread(values: Sequence[float]) -> float:
    return (max(values) - min(values)) / float(np.mean(values))


def step_errors(
    calibration: str, engine_steps: Sequence[Sample], sim_steps: Sequence[BatchShape]
) -> StepErrors:
    """The fitted model's signed relative error on the engine's own steps (``(predicted - measured)
    / measured``: its mean and mean absolute value), and whether the simulator computed the same
    batch shapes in the same order."""
    if not engine_steps:
        return StepErrors(engine_steps=0, sim_steps=len(sim_steps))
    model = FittedCostModel(1, 1, **load_calibration(calibration))
    errors = [(model.step_time_s(s.shape) - s.seconds) / s.seconds for s in engine_steps]
    same = [canonical(s.shape) for s in engine_steps] == [canonical(s) for s in sim_steps]
    return StepErrors(
        engine_steps=len(engine_steps),
        sim_steps=len(sim_steps),
        sim_steps_match_engine=same,
        step_mean_error=float(np.mean(errors)),
        step_mean_abs_error=float(np.mean(np.abs(errors))),
    )


def compare(
    runs: Sequence[Sequence[Turn]],
    sim: SimMetrics,
    calibration: str,
    *,
    engine_steps: Sequence[Sample] = (),
    sim_steps: Sequence[BatchShape] = (),
    machine: Mapping[str, object] | None = None,
) -> Comparison:
    """The engine's (mean over ``runs``, the same workload repeated) and the simulator's mean TTFT and
    TPOT, the errors ``|sim - engine| / engine``, the engine's own spread over the runs, and
    :func:`step_errors`. ``machine``: this machine's fingerprint with the engine's runtime
    (:func:`kvtier.sim.machine.fingerprint`), for the comparison with where the calibration was
    fitted (default: without a runtime)."""
    if not runs or not all(runs):
        raise ConfigError("compare needs at least one engine run with finished requests")
    ttfts = [float(np.mean([t.ttft_s for t in turns])) for turns in runs]
    tpots = [float(np.mean([t.tpot_s for t in turns])) for turns in runs]
    engine_ttft, engine_tpot = float(np.mean(ttfts)), float(np.mean(tpots))
    sim_ttft, sim_tpot = float(sim["ttft_s"]["mean"]), float(sim["tpot_s"]["mean"])
    differs = differences(read_calibration(calibration).get("machine"), machine)
    return Comparison(
        requests=len(runs[0]),
        engine_runs=len(runs),
        calibration=calibration,
        calibration_machine_differences=differs,
        calibration_fitted_here=not differs,
        engine_mean_ttft_s=engine_ttft,
        sim_mean_ttft_s=sim_ttft,
        engine_mean_tpot_s=engine_tpot,
        sim_mean_tpot_s=sim_tpot,
        sim_ttft_error=abs(sim_ttft - engine_ttft) / engine_ttft,
        sim_tpot_error=abs(sim_tpot - engine_tpot) / engine_tpot,
        engine_ttft_noise=_spread(ttfts),
        engine_tpot_noise=_spread(tpots),
        engine_run_mean_ttft_s=ttfts,
        engine_run_mean_tpot_s=tpots,
        sim_requests=int(sim["requests"]),
        **step_errors(calibration, engine_steps, sim_steps),
    )
