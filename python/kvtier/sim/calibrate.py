"""``kvtier sim calibrate``: fit the simulator's step-time model to the CPU reference engine.

The simulator's ``cpu`` hardware profile describes this machine; its roofline cost model is an
analytical guess. Calibration replaces the guess with measurements (Vidur's approach: profile the
real engine's steps, fit a predictor): run the reference engine's loop (``fcfs``, chunked prefill,
continuous batching) on a calibration workload of random-token requests in two waves, log every
step's batch shape and wall time (policy, view, forward pass and sampling included), and fit
:class:`kvtier.sim.cost.FittedCostModel`'s five non-negative coefficients by least squares on
relative error. Every other step is held out of a first fit and reported as the predictor's error;
the held-out *workload* check (real chat turns, closed loop) is :mod:`kvtier.sim.validate`.

The result is a YAML file a simulation config names as ``cost: {kind: fitted, calibration: PATH}``
(or the packaged ``profiles/calibration/cpu-smollm2-135m.yaml``, ``calibration: cpu-smollm2-135m``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from kvtier.errors import ConfigError
from kvtier.sim.cost import BatchShape, FittedCostModel, PrefillChunk

CALIBRATIONS = Path(__file__).parent / "profiles" / "calibration"
COEFFICIENTS = ("base_s", "token_s", "pair_s", "seq_s", "decode_pair_s")


def _p(new: int, ctx: int) -> PrefillChunk:
    return PrefillChunk(new, ctx)


# Interleaved so that every other shape (the held-out half) spans the same kinds of step.
DEFAULT_SHAPES: tuple[BatchShape, ...] = (
    BatchShape((_p(32, 0),)),
    BatchShape((_p(64, 0),)),
    BatchShape((_p(128, 0),)),
    BatchShape((_p(256, 0),)),
    BatchShape((_p(512, 0),)),
    BatchShape((_p(384, 0),)),
    BatchShape((_p(64, 1024),)),
    BatchShape((_p(32, 2048),)),
    BatchShape((_p(256, 1024),)),
    BatchShape((_p(128, 1536),)),
    BatchShape(decode_context_tokens=(256,)),
    BatchShape(decode_context_tokens=(1024,)),
    BatchShape(decode_context_tokens=(2048,)),
    BatchShape(decode_context_tokens=(512,) * 2),
    BatchShape(decode_context_tokens=(256,) * 4),
    BatchShape(decode_context_tokens=(1024,) * 4),
    BatchShape(decode_context_tokens=(512,) * 8),
    BatchShape(decode_context_tokens=(256,) * 12),
    BatchShape(decode_context_tokens=(1024,) * 16),
    BatchShape(decode_context_tokens=(512,) * 16),
    BatchShape((_p(128, 256),), (512,) * 4),
    BatchShape((_p(64, 0),), (1024,) * 2),
    BatchShape((_p(32, 512), _p(96, 0)), (256,) * 8),
    BatchShape((_p(192, 0),), (256,) * 8),
)
QUICK_SHAPES: tuple[BatchShape, ...] = (
    BatchShape((_p(16, 0),)),
    BatchShape((_p(48, 0),)),
    BatchShape((_p(96, 0),)),
    BatchShape((_p(32, 128),)),
    BatchShape((_p(64, 64),)),
    BatchShape(decode_context_tokens=(64,)),
    BatchShape(decode_context_tokens=(128,) * 2),
    BatchShape(decode_context_tokens=(64,) * 4),
    BatchShape(decode_context_tokens=(96,) * 6),
    BatchShape((_p(32, 0),), (64,) * 2),
)


@dataclass(frozen=True)
class Sample:
    shape: BatchShape
    seconds: float


def measure_engine_steps(
    model: Any,
    shapes: Sequence[BatchShape],
    *,
    repeats: int = 3,
    block_tokens: int = 16,
    progress: Callable[[int, int], None] | None = None,
) -> list[Sample]:
    """Best-of-``repeats`` wall time of one :meth:`Model.forward` per shape, over a paged pool."""
    from kvtier.engine.kv import PagedKvPool, pool_geometry

    if repeats < 1:
        raise ConfigError(f"repeats is {repeats}; expected >= 1")
    geometry = pool_geometry(model.config, block_tokens)
    rng = np.random.default_rng(0)
    samples = []
    for i, shape in enumerate(shapes):
        seqs = [(c.new_tokens, c.context_tokens) for c in shape.prefills]
        seqs += [(1, ctx) for ctx in shape.decode_context_tokens]
        needs = [-(-(new + ctx) // block_tokens) for new, ctx in seqs]
        pool = PagedKvPool(geometry, sum(needs))
        tables, first = [], 0
        for n in needs:
            tables.append(list(range(first, first + n)))
            first += n
        ids = rng.integers(0, model.config.vocab_size, size=sum(new for new, _ in seqs))
        positions = np.concatenate([np.arange(ctx, ctx + new) for new, ctx in seqs])
        best = float("inf")
        for attempt in range(repeats + 1):  # the first run warms caches and is not counted
            access = pool.step(tables, [new + ctx for new, ctx in seqs], [new for new, _ in seqs])
            start = time.perf_counter()
            model.forward(ids, positions, access)
            if attempt:
                best = min(best, time.perf_counter() - start)
        samples.append(Sample(shape, best))
        if progress is not None:
            progress(i + 1, len(shapes))
    return samples


def warm_up(model: Any) -> None:
    """One short prefill and decode, so the first timed step does not pay for first-use costs
    (BLAS buffers, page faults on the weights): about 1 s on this machine."""
    from kvtier.engine.model import greedy_generate

    greedy_generate(model, [[1] * 48, [2] * 24], 3)


def engine_run_samples(
    model: Any,
    *,
    quick: bool = False,
    seed: int = 1,
    engine_config: Any = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[Sample]:
    """Step times of the real engine loop (policy, view, admission, forward, sampling: everything a
    step costs) on a calibration workload of random-token prompts: a first wave of requests, then a
    second wave sent as the first requests finish, so the log holds prefill-only, decode-only and
    mixed steps at many batch sizes and context lengths."""
    from kvtier.engine.sampling import SamplingParams
    from kvtier.engine.scheduler import Engine, EngineConfig
    from kvtier.sched import make_policy

    warm_up(model)
    rng = np.random.default_rng(seed)
    count, longest = (4, 96) if quick else (16, 900)
    # Log-uniform prompt lengths: decode steps then run at short and long contexts alike, so the
    # per-sequence and per-context costs can be told apart.
    lengths = np.exp(rng.uniform(np.log(16), np.log(longest), size=count)).astype(int)
    replies = rng.integers(4, 12 if quick else 64, size=count)
    config = engine_config or EngineConfig(num_blocks=1024, max_batch_tokens=256, max_running=16)
    engine = Engine(model, make_policy("fcfs"), config)
    engine.step_log = []
    vocab = model.config.vocab_size

    def send(i: int) -> None:
        prompt = rng.integers(0, vocab, size=int(lengths[i])).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=int(replies[i]), ignore_eos=True))

    first_wave = count // 2
    for i in range(first_wave):
        send(i)
    sent, done = first_wave, 0
    while engine.has_unfinished():
        engine.step()
        for _ in engine.pop_finished():
            done += 1
            if progress is not None:
                progress(done, count)
            if sent < count:
                send(sent)
                sent += 1
    return [
        Sample(BatchShape(tuple(PrefillChunk(n, c) for n, c in prefills), tuple(decodes)), seconds)
        for prefills, decodes, seconds in engine.step_log
    ]


def _nnls_relative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative coefficients minimising the squared *relative* error of ``x @ c`` against ``y``
    (rows scaled by 1/y), by trying every subset of free coefficients (there are only five)."""
    xs, ys = x / y[:, None], np.ones_like(y)
    best, best_err = np.zeros(x.shape[1]), float("inf")
    for k in range(1, x.shape[1] + 1):
        for subset in itertools.combinations(range(x.shape[1]), k):
            cols = list(subset)
            coef, *_ = np.linalg.lstsq(xs[:, cols], ys, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(x.shape[1])
            full[cols] = coef
            err = float(((xs @ full - ys) ** 2).sum())
            if err < best_err:
                best, best_err = full, err
    return best


def fit(samples: Sequence[Sample], kv_bytes_per_token: int, num_layers: int) -> FittedCostModel:
    """The :class:`FittedCostModel` closest (in relative error) to ``samples``."""
    if len(samples) < len(COEFFICIENTS):
        raise ConfigError(f"{len(samples)} samples cannot fit {len(COEFFICIENTS)} coefficients")
    if any(not s.seconds > 0 or s.shape.is_empty for s in samples):
        raise ConfigError("every sample needs a non-empty batch and a positive time")
    x = np.array([FittedCostModel.features(s.shape) for s in samples])
    y = np.array([s.seconds for s in samples])
    coef = _nnls_relative(x, y)
    return FittedCostModel(
        kv_bytes_per_token, num_layers, **dict(zip(COEFFICIENTS, map(float, coef), strict=True))
    )


def relative_errors(model: FittedCostModel, samples: Sequence[Sample]) -> list[float]:
    return [abs(model.step_time_s(s.shape) - s.seconds) / s.seconds for s in samples]


def describe(shape: BatchShape) -> str:
    parts = [f"prefill {c.new_tokens}@{c.context_tokens}" for c in shape.prefills]
    if shape.decode_context_tokens:
        ctx = shape.decode_context_tokens
        parts.append(f"decode x{len(ctx)} @{int(np.mean(ctx))}")
    return " + ".join(parts)


def calibrate(
    *,
    quick: bool = False,
    repeats: int = 3,
    threads: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Runs the calibration workload on the reference engine and fits its step log (every other
    step held out of a first fit, whose error is reported; then refitted on all steps). Also times
    the standalone forward grid (:data:`DEFAULT_SHAPES`) and reports how the fit predicts it: those
    shapes lack the loop's per-step costs, so they show what the fit would miss without them."""
    from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

    from kvtier.engine import load_model

    model = load_model()
    kv_bytes = 2 * model.config.num_layers * model.config.kv_size * 4  # fp32 K and V per token
    with threadpool_limits(limits=threads, user_api="blas"):
        samples = engine_run_samples(model, quick=quick, progress=progress)
        grid = measure_engine_steps(model, QUICK_SHAPES if quick else DEFAULT_SHAPES, repeats=repeats)
    train, held_out = samples[0::2], samples[1::2]
    trial = fit(train, kv_bytes, model.config.num_layers)
    held_out_errors = relative_errors(trial, held_out)
    final = fit(samples, kv_bytes, model.config.num_layers)
    return {
        "model": "SmolLM2-135M-Instruct (kvtier.engine, fp32 numpy)",
        "blas_threads": threads,
        "kind": "fitted",
        **{name: getattr(final, name) for name in COEFFICIENTS},
        "engine_steps": len(samples),
        "held_out_mean_rel_error": float(np.mean(held_out_errors)),
        "held_out_max_rel_error": float(np.max(held_out_errors)),
        "fit_mean_rel_error": float(np.mean(relative_errors(final, samples))),
        "forward_grid": [
            {"shape": describe(s.shape), "measured_s": s.seconds, "predicted_s": final.step_time_s(s.shape)}
            for s in grid
        ],
    }


def write(result: dict[str, Any], path: Path) -> None:
    header = (
        "# Fitted by `kvtier sim calibrate` (kvtier.sim.calibrate): step_s = base_s + token_s x tokens\n"
        "# + pair_s x prefill attention pairs + decode_pair_s x decode attention pairs + seq_s x sequences,\n"
        "# on this machine's engine steps (see kvtier.sim.cost.FittedCostModel).\n"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.safe_dump(result, sort_keys=False))


def load_calibration(name_or_path: str) -> dict[str, float]:
    """The coefficients of a calibration file: a path, or a name under ``profiles/calibration``."""
    path = Path(name_or_path)
    if not path.exists():
        path = CALIBRATIONS / f"{name_or_path}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in CALIBRATIONS.glob("*.yaml"))
        raise ConfigError(f"calibration {name_or_path!r} is neither a file nor one of {known}")
    data = yaml.safe_load(path.read_text())
    missing = [k for k in COEFFICIENTS if not isinstance(data.get(k), (int, float))]
    if missing:
        raise ConfigError(f"calibration {path} lacks numeric {missing}; rerun `kvtier sim calibrate`")
    return {k: float(data[k]) for k in COEFFICIENTS}


def summary(result: dict[str, Any]) -> str:
    lines = [
        f"calibrated {result['model']} on {result['blas_threads']} BLAS thread(s) from "
        f"{result['engine_steps']} engine steps; written to {result.get('written_to', '-')}",
        "  step_s = " + " + ".join(f"{result[k]:.3g} {k}" for k in COEFFICIENTS),
        f"  held-out steps: mean relative error {result['held_out_mean_rel_error']:.3f}, "
        f"max {result['held_out_max_rel_error']:.3f}; fit on all: mean {result['fit_mean_rel_error']:.3f}",
        "  standalone forward passes (no loop overhead) vs the fit:",
        f"  {'shape':48s} {'measured s':>11s} {'predicted s':>12s}",
    ]
    for row in result["forward_grid"]:
        lines.append(f"  {row['shape']:48s} {row['measured_s']:11.4f} {row['predicted_s']:12.4f}")
    lines.append("use it in a sim config: cost: {kind: fitted, calibration: <that file>}")
    return "\n".join(lines)
