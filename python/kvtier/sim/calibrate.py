"""``kvtier sim calibrate``: fit the simulator's step-time model to measured engine steps.

The simulator's ``cpu`` hardware profile describes this machine; its roofline cost model is an
analytical guess. Calibration replaces the guess with measurements (Vidur's approach: profile the
real engine's steps, fit a predictor). The measuring is the reference engine's
(:mod:`kvtier.engine.calibrate`: its loop's step log on a calibration workload, and standalone
forward passes over :data:`DEFAULT_SHAPES`); this module is the simulator's half, which needs no
engine: it fits :class:`kvtier.sim.cost.FittedCostModel`'s six non-negative coefficients to
:class:`Sample` s by least squares on relative error (:func:`fit`), holding every other step out
of a first fit and reporting that fit's error (:func:`report`). The held-out *workload* check (real
chat turns, closed loop) is :mod:`kvtier.engine.validate` with :mod:`kvtier.sim.validate`.

The result is a YAML file a simulation config names as ``cost: {kind: fitted, calibration: PATH}``
(or the packaged ``profiles/calibration/cpu-smollm2-135m.yaml``, ``calibration: cpu-smollm2-135m``);
:func:`kvtier.sim.cost.load_calibration` reads it.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NotRequired, TypedDict

import numpy as np
import yaml

from kvtier.errors import ConfigError
from kvtier.results import replacing
from kvtier.sim.cost import COEFFICIENTS, CONNECTOR_COEFFICIENTS, BatchShape, FittedCostModel, PrefillChunk
from kvtier.sim.machine import Fingerprint, fingerprint


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


class ForwardRow(TypedDict):
    """A standalone forward pass of the grid against the fit's prediction."""

    shape: str  # :func:`describe`
    measured_s: float
    predicted_s: float


class ConnectorFit(TypedDict):
    """:func:`connector_report`: the connector's increments of CONNECTOR_COEFFICIENTS and their check."""

    base_s: float
    token_s: float
    engine_steps: int
    paired: bool
    mean_slowdown: float
    median_slowdown: float
    held_out_mean_rel_error_base: float
    held_out_mean_rel_error: float


class ConnectorSection(ConnectorFit):
    """A calibration's ``connector`` section: the fit and the connector config it was timed with."""

    config: Mapping[str, object]


class EngineTimed(TypedDict):
    """A calibration's ``engine`` section: another engine's steps (``kvtier.bench.vllm_sim``)."""

    name: str
    torch: str
    torch_threads: int
    block_tokens: int
    clock: str  # the clock the steps were timed on: "wall" or "cpu"


class Calibration(TypedDict):
    """:func:`report`: the YAML file ``kvtier sim calibrate`` writes (:func:`write`) and
    :func:`kvtier.sim.cost.read_calibration` reads back; its keys in the order written."""

    model: str
    blas_threads: int
    machine: Fingerprint
    kind: str  # "fitted"
    base_s: float  # COEFFICIENTS, FittedCostModel's
    token_s: float
    pair_s: float
    seq_s: float
    decode_pair_s: float
    multi_token_s: float
    engine_steps: int
    held_out_mean_rel_error: float
    held_out_max_rel_error: float
    fit_mean_rel_error: float
    forward_grid: list[ForwardRow]
    connector: NotRequired[ConnectorSection]  # kvtier.bench.vllm_sim's
    engine: NotRequired[EngineTimed]  # kvtier.bench.vllm_sim's
    written_to: NotRequired[str]  # added for the report, not written


def _nnls_relative(x: np.ndarray, y: np.ndarray, offset: np.ndarray | None = None) -> np.ndarray:
    """Non-negative coefficients minimising the squared *relative* error of ``offset + x @ c``
    against ``y`` (rows scaled by 1/y), by trying every subset of free coefficients (there are only
    six)."""
    xs, ys = x / y[:, None], np.ones_like(y) if offset is None else (y - offset) / y
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


def canonical(shape: BatchShape) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    """A batch shape with its sequences in a canonical order (two engines order a batch apiece)."""
    chunks = tuple(sorted((c.new_tokens, c.context_tokens) for c in shape.prefills))
    return chunks, tuple(sorted(shape.decode_context_tokens))


def fit_connector(
    samples: Sequence[Sample], offsets: Sequence[float], names: Sequence[str] = CONNECTOR_COEFFICIENTS
) -> dict[str, float]:
    """The non-negative increments of the coefficients ``names`` that, added to ``offsets`` (each
    step's time without kvtier's connector), come closest in relative error to ``samples`` (the
    same engine's steps with the connector configured)."""
    if len(samples) < len(names) or len(offsets) != len(samples):
        raise ConfigError(
            f"{len(samples)} samples and {len(offsets)} offsets cannot fit {len(names)} connector coefficients"
        )
    cols = [COEFFICIENTS.index(n) for n in names]
    x = np.array([FittedCostModel.features(s.shape) for s in samples])[:, cols]
    y = np.array([s.seconds for s in samples])
    return dict(zip(names, map(float, _nnls_relative(x, y, np.asarray(offsets, dtype=float))), strict=True))


def with_increments(base: FittedCostModel, increments: Mapping[str, float]) -> FittedCostModel:
    return replace(base, **{k: getattr(base, k) + v for k, v in increments.items()})


def connector_report(
    base: FittedCostModel, samples: Sequence[Sample], plain: Sequence[Sample] = ()
) -> ConnectorFit:
    """What kvtier's connector adds to the engine's steps (``samples``: the calibration workload
    again, the connector configured; its random prompts hit nothing, so every difference is the
    connector's per-step and write-through work). Where ``plain`` (the run without the connector
    that ``base`` was fitted to) has the same steps in the same order, each connector step is
    paired with its plain twin: the increments are fitted to the measured differences (``paired``),
    so the base fit's own shape error does not enter them; else to the differences from ``base``.
    :func:`fit_connector` on every other step, its error on the others beside the error of ``base``
    alone (the measurement that says whether the increments explain the difference), then refitted
    on all steps."""
    paired = len(plain) == len(samples) and all(
        canonical(p.shape) == canonical(s.shape) for p, s in zip(plain, samples, strict=True)
    )
    offsets = [p.seconds for p in plain] if paired else [base.step_time_s(s.shape) for s in samples]
    train, held_out = samples[0::2], samples[1::2]
    trial = with_increments(base, fit_connector(train, offsets[0::2]))
    slowdown = [(s.seconds - o) / o for s, o in zip(samples, offsets, strict=True)]
    increments = fit_connector(samples, offsets)
    return ConnectorFit(
        base_s=increments["base_s"],
        token_s=increments["token_s"],
        engine_steps=len(samples),
        paired=paired,
        mean_slowdown=float(np.mean(slowdown)),
        median_slowdown=float(np.median(slowdown)),
        held_out_mean_rel_error_base=float(np.mean(relative_errors(base, held_out))),
        held_out_mean_rel_error=float(np.mean(relative_errors(trial, held_out))),
    )


def relative_errors(model: FittedCostModel, samples: Sequence[Sample]) -> list[float]:
    return [abs(model.step_time_s(s.shape) - s.seconds) / s.seconds for s in samples]


def describe(shape: BatchShape) -> str:
    parts = [f"prefill {c.new_tokens}@{c.context_tokens}" for c in shape.prefills]
    if shape.decode_context_tokens:
        ctx = shape.decode_context_tokens
        parts.append(f"decode x{len(ctx)} @{int(np.mean(ctx))}")
    return " + ".join(parts)


def report(
    samples: Sequence[Sample],
    grid: Sequence[Sample],
    *,
    kv_bytes_per_token: int,
    num_layers: int,
    model: str,
    blas_threads: int,
    runtime: Mapping[str, object] | None = None,
) -> Calibration:
    """Fits the engine's step log ``samples`` (every other step held out of a first fit, whose error
    is reported; then refitted on all steps) and reports how the fit predicts ``grid``, standalone
    forward passes: those lack the loop's per-step costs, so they show what the fit would miss
    without them. ``runtime``: the engine's runtime (:func:`kvtier.sim.machine.fingerprint`)."""
    train, held_out = samples[0::2], samples[1::2]
    trial = fit(train, kv_bytes_per_token, num_layers)
    held_out_errors = relative_errors(trial, held_out)
    final = fit(samples, kv_bytes_per_token, num_layers)
    return Calibration(
        model=model,
        blas_threads=blas_threads,
        machine=fingerprint(runtime),
        kind="fitted",
        base_s=final.base_s,
        token_s=final.token_s,
        pair_s=final.pair_s,
        seq_s=final.seq_s,
        decode_pair_s=final.decode_pair_s,
        multi_token_s=final.multi_token_s,
        engine_steps=len(samples),
        held_out_mean_rel_error=float(np.mean(held_out_errors)),
        held_out_max_rel_error=float(np.max(held_out_errors)),
        fit_mean_rel_error=float(np.mean(relative_errors(final, samples))),
        forward_grid=[
            ForwardRow(shape=describe(s.shape), measured_s=s.seconds, predicted_s=final.step_time_s(s.shape))
            for s in grid
        ],
    )


def coefficients(result: Calibration) -> dict[str, float]:
    """The fitted coefficients of ``result``, in COEFFICIENTS' order."""
    return {
        "base_s": result["base_s"],
        "token_s": result["token_s"],
        "pair_s": result["pair_s"],
        "seq_s": result["seq_s"],
        "decode_pair_s": result["decode_pair_s"],
        "multi_token_s": result["multi_token_s"],
    }


def fitted_model(result: Calibration, kv_bytes_per_token: int, num_layers: int) -> FittedCostModel:
    """The :class:`FittedCostModel` that ``result`` fitted."""
    c = coefficients(result)
    return FittedCostModel(
        kv_bytes_per_token,
        num_layers,
        base_s=c["base_s"],
        token_s=c["token_s"],
        pair_s=c["pair_s"],
        seq_s=c["seq_s"],
        decode_pair_s=c["decode_pair_s"],
        multi_token_s=c["multi_token_s"],
    )


def write(result: Calibration, path: Path) -> None:
    header = (
        "# Fitted by `kvtier sim calibrate` (kvtier.sim.calibrate): step_s = base_s + token_s x tokens\n"
        "# + pair_s x prefill attention pairs + decode_pair_s x decode attention pairs + seq_s x sequences\n"
        "# + multi_token_s x [two or more tokens in the step],\n"
        "# on this machine's engine steps (see kvtier.sim.cost.FittedCostModel).\n"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as file:  # whole or not at all
        file.write(header + yaml.safe_dump(result, sort_keys=False))


def summary(result: Calibration) -> str:
    lines = [
        f"calibrated {result['model']} on {result['blas_threads']} BLAS thread(s) from "
        f"{result['engine_steps']} engine steps; written to {result.get('written_to', '-')}",
        "  step_s = " + " + ".join(f"{v:.3g} {k}" for k, v in coefficients(result).items()),
        f"  held-out steps: mean relative error {result['held_out_mean_rel_error']:.3f}, "
        f"max {result['held_out_max_rel_error']:.3f}; fit on all: mean {result['fit_mean_rel_error']:.3f}",
    ]
    if "engine" in result:  # another engine's steps (kvtier.bench.vllm_sim): no forward grid
        lines.append(
            f"  engine: {result['engine']['name']}, steps timed on the {result['engine']['clock']} clock"
        )
    if "connector" in result:  # the same workload with kvtier's connector (kvtier.bench.vllm_sim)
        c = result["connector"]
        lines.append(
            f"  with kvtier's connector: steps {c['median_slowdown']:+.1%} (median; mean {c['mean_slowdown']:+.1%}) "
            f"{'on the same steps without it' if c['paired'] else 'on the fit above'}; adds "
            f"{c['base_s']:.3g} base_s + {c['token_s']:.3g} token_s (held-out steps: mean relative error "
            f"{c['held_out_mean_rel_error']:.3f}, {c['held_out_mean_rel_error_base']:.3f} without)"
        )
    if result["forward_grid"]:
        lines.append("  standalone forward passes (no loop overhead) vs the fit:")
        lines.append(f"  {'shape':48s} {'measured s':>11s} {'predicted s':>12s}")
    for row in result["forward_grid"]:
        lines.append(f"  {row['shape']:48s} {row['measured_s']:11.4f} {row['predicted_s']:12.4f}")
    lines.append("use it in a sim config: cost: {kind: fitted, calibration: <that file>}")
    return "\n".join(lines)
