"""The simulator's GPU constants against a real GPU: ``python -m kvtier.sim.gpu_check FILE``.

``scripts/gpu_calibrate.py`` (torch only, run on the GPU) times a Llama-3.1-8B-shaped model's
forward steps and pinned host <-> GPU copies and writes ``FILE``; this module, which needs no GPU,
reads it and reports:

- **steps**: the roofline model (:class:`kvtier.sim.cost.RooflineCostModel` with its literature
  constants, on the hardware profile of the GPU measured) against every measured step, and the
  constants (``mfu_prefill``, ``mfu_decode``, ``bandwidth_efficiency``, ``step_overhead_s``) that
  fit the measured steps best; also :class:`kvtier.sim.cost.FittedCostModel` fitted to half of the
  steps and checked on the other half (:func:`kvtier.sim.calibrate.report`'s method).
- **links**: ``transfer_work_s``'s two constants per direction (bandwidth, per-segment overhead)
  fitted to copies issued one per segment, and the rate of one large copy, against the profile.

What the measured steps are not: a serving engine's. They are one forward pass (CUDA-graph replay
where it captured, else eager), without the scheduler, sampling or input preparation a vLLM step
adds, which the roofline's ``step_overhead_s`` stands for; so the fitted overhead is a lower bound.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from kvtier.errors import ConfigError
from kvtier.results import OMIT, Result, json_text
from kvtier.sim.calibrate import Sample, describe, fit, relative_errors
from kvtier.sim.cost import COEFFICIENTS, BatchShape, RooflineCostModel
from kvtier.sim.gpu_measurement import Measurement, StepRow, Steps, read
from kvtier.sim.hardware import HardwareProfile, load_hardware
from kvtier.sim.models import load_model

#: GPU names (as torch reports them) to the hardware profile that describes them.
PROFILES = (("H200", "h200"), ("H100", "h100-sxm"), ("GH200", "gh200"), ("L40S", "l40s"))
ROOFLINE_CONSTANTS = ("mfu_prefill", "mfu_decode", "bandwidth_efficiency", "step_overhead_s")
#: Each of ROOFLINE_CONSTANTS set on a model (``replace`` per field, so mypy checks the names).
_SET: dict[str, Callable[[RooflineCostModel, float], RooflineCostModel]] = {
    "mfu_prefill": lambda m, v: replace(m, mfu_prefill=v),
    "mfu_decode": lambda m, v: replace(m, mfu_decode=v),
    "bandwidth_efficiency": lambda m, v: replace(m, bandwidth_efficiency=v),
    "step_overhead_s": lambda m, v: replace(m, step_overhead_s=v),
}


@dataclass(frozen=True)
class LinkFit:
    """``seconds = bytes / bytes_per_s + segments x per_segment_overhead_s`` fitted to copies issued
    one per segment (:func:`kvtier.sim.cost.transfer_work_s`'s form)."""

    direction: str
    bytes_per_s: float
    per_segment_overhead_s: float
    max_rel_error: float  # of the fit over the rows it was fitted to


@dataclass(frozen=True)
class LinkProfile(Result):
    """The hardware profile's host link, which the fits are compared with."""

    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    per_segment_overhead_s: float


@dataclass(frozen=True)
class PythonLink(Result):
    """One direction's torch ``copy_`` per segment, fitted, and its one large copy."""

    bytes_per_s: float
    per_segment_overhead_s: float
    fit_max_rel_error: float
    one_copy_bytes_per_s: float


@dataclass(frozen=True)
class CppLink(Result):
    """One direction's ``cudaMemcpyAsync`` per segment, fitted, and its gather kernel's range."""

    bytes_per_s: float
    per_segment_overhead_s: float
    fit_max_rel_error: float
    gather_kernel_bytes_per_s_min: float  # NaN where no gather kernel was timed
    gather_kernel_bytes_per_s_max: float
    smallest_segment_bytes: int


@dataclass(frozen=True)
class LinksReport(Result):
    profile: LinkProfile
    python_h2d: PythonLink | None = field(default=None, metadata=OMIT)
    python_d2h: PythonLink | None = field(default=None, metadata=OMIT)
    duplex_bytes_per_s: float | None = field(default=None, metadata=OMIT)
    cpp_h2d: CppLink | None = field(default=None, metadata=OMIT)
    cpp_d2h: CppLink | None = field(default=None, metadata=OMIT)


@dataclass(frozen=True)
class StepFigures(Result):
    shape: str
    measured_s: float
    roofline_s: float
    fitted_roofline_s: float


@dataclass(frozen=True)
class StepsReport(Result):
    clock: list[str]
    attention: str | None
    rows: list[StepFigures]
    roofline_default: dict[str, float]  # ROOFLINE_CONSTANTS' values
    roofline_default_mean_abs_rel_error: float
    roofline_default_max_abs_rel_error: float
    roofline_fitted: dict[str, float]
    roofline_fitted_mean_abs_rel_error: float
    roofline_fitted_max_abs_rel_error: float
    fitted_cost_model_held_out_mean_rel_error: float  # NaN with too few steps to hold half out
    fitted_cost_model_held_out_max_rel_error: float
    repeat_mean_rel_diff: float | None = field(default=None, metadata=OMIT)  # with ``steps_repeat``
    repeat_max_rel_diff: float | None = field(default=None, metadata=OMIT)


@dataclass(frozen=True)
class OverlapFigures(Result):
    shape: str
    direction: str
    step_slowdown: float
    copy_alone_bytes_per_s: float
    copy_together_bytes_per_s: float


@dataclass(frozen=True)
class GpuCheck(Result):
    """What the module docs list; a part is left out where the measurement lacks it."""

    machine: Mapping[str, object]  # the measurement's, as written
    hardware_profile: str
    steps: StepsReport | None = field(default=None, metadata=OMIT)
    links: LinksReport | None = field(default=None, metadata=OMIT)
    overlap: list[OverlapFigures] | None = field(default=None, metadata=OMIT)
    kvtier: Mapping[str, object] | None = field(default=None, metadata=OMIT)  # as written


def hardware_for(gpu: str, name: str | None = None) -> HardwareProfile:
    """The profile ``name``, else the one that describes ``gpu`` (torch's name for it)."""
    if name:
        return load_hardware(name)
    for marker, profile in PROFILES:  # H200 before H100: "GH200" contains "H200"
        if marker in gpu and not (marker == "H200" and "GH200" in gpu):
            return load_hardware(profile)
    raise ConfigError(f"no hardware profile for GPU {gpu!r}; name one with --hardware")


def _errors(model: Callable[[BatchShape], float], rows: Sequence[StepRow]) -> np.ndarray:
    return np.array([(model(r.shape) - r.seconds) / r.seconds for r in rows])


def fit_roofline(base: RooflineCostModel, rows: Sequence[StepRow], rounds: int = 6) -> RooflineCostModel:
    """The roofline constants minimising the mean squared relative step error (coordinate search:
    each constant over a grid, the others held, repeated ``rounds`` times)."""
    grids = {
        "mfu_prefill": np.linspace(0.05, 1.0, 96),
        "mfu_decode": np.linspace(0.02, 1.0, 99),
        "bandwidth_efficiency": np.linspace(0.2, 1.0, 81),
        "step_overhead_s": np.linspace(0.0, 5e-3, 101),
    }
    best = base
    for _ in range(rounds):
        for name in ROOFLINE_CONSTANTS:
            scores = []
            for value in grids[name]:
                trial = _SET[name](best, float(value))
                scores.append(float(np.mean(_errors(trial.step_time_s, rows) ** 2)))
            best = _SET[name](best, float(grids[name][int(np.argmin(scores))]))
    return best


def fit_link(rows: Sequence[tuple[int, int, float]], direction: str) -> LinkFit:
    """Fits ``(bytes, segments, seconds)`` rows by least squares on relative error."""
    if len(rows) < 2:
        raise ConfigError(f"links: {len(rows)} {direction} rows; need 2 or more to fit rate and overhead")
    x = np.array([[nbytes, segments] for nbytes, segments, _ in rows], dtype=float)
    y = np.array([seconds for *_, seconds in rows], dtype=float)
    if not (y > 0).all():
        raise ConfigError(f"links: a {direction} copy took {y.min()} s; expected positive times")
    (inv_rate, overhead), *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    inv_rate, overhead = max(float(inv_rate), 1e-15), max(float(overhead), 0.0)
    pred = x @ np.array([inv_rate, overhead])
    return LinkFit(direction, 1.0 / inv_rate, overhead, float(np.max(np.abs(pred - y) / y)))


def _link_report(data: Measurement, hw: HardwareProfile) -> LinksReport:
    link = hw.host_link
    profile = LinkProfile(link.h2d_bytes_per_s, link.d2h_bytes_per_s, link.per_segment_overhead_s)
    python: dict[str, PythonLink] = {}
    if data.links:  # from Python: torch copy_ per segment, and one copy of everything
        for d in ("h2d", "d2h"):
            mine = [r for r in data.links.rows if r.direction == d]
            f = fit_link([(r.bytes, r.segments, r.per_segment_s) for r in mine], d)
            python[d] = PythonLink(
                f.bytes_per_s,
                f.per_segment_overhead_s,
                f.max_rel_error,
                max(r.bytes / r.one_copy_s for r in mine),
            )
    cpp: dict[str, CppLink] = {}
    if data.links_cpp is not None:  # from C++: cudaMemcpyAsync per segment, and one gather kernel
        for d in ("h2d", "d2h"):
            copies = [
                r for r in data.links_cpp if r.direction == d and r.method == "memcpy_async_per_segment"
            ]
            f = fit_link([(r.bytes, r.segments, r.seconds) for r in copies], d)
            gather = [
                r.bytes / r.seconds
                for r in data.links_cpp
                if r.direction == d and r.method == "gather_kernel"
            ]
            cpp[d] = CppLink(
                f.bytes_per_s,
                f.per_segment_overhead_s,
                f.max_rel_error,
                min(gather) if gather else math.nan,
                max(gather) if gather else math.nan,
                min(r.segment_bytes for r in copies),
            )
    return LinksReport(
        profile,
        python_h2d=python.get("h2d"),
        python_d2h=python.get("d2h"),
        duplex_bytes_per_s=data.links.duplex_bytes / data.links.duplex_s if data.links else None,
        cpp_h2d=cpp.get("h2d"),
        cpp_d2h=cpp.get("d2h"),
    )


def _steps_report(steps: Steps, repeat: Steps | None, hw: HardwareProfile) -> StepsReport:
    if steps.model != "Llama-3.1-8B-shaped":
        raise ConfigError(
            f"steps were measured on {steps.model!r}; the check compares a "
            "Llama-3.1-8B-shaped model's steps (scripts/gpu_calibrate.py without --tiny)"
        )
    rows = steps.rows
    base = RooflineCostModel(hw, load_model("llama-3.1-8b"))
    fitted = fit_roofline(base, rows)
    default_err, fitted_err = _errors(base.step_time_s, rows), _errors(fitted.step_time_s, rows)
    samples = [Sample(r.shape, r.seconds) for r in rows]
    held = [math.nan]
    if len(samples) >= 4 * len(COEFFICIENTS):  # half to fit, half to check
        trial = fit(samples[0::2], base.kv_bytes_per_token, base.num_layers)
        held = relative_errors(trial, samples[1::2])
    diffs = None
    if repeat is not None:  # the same shapes measured again: the measurement's own noise
        diffs = [abs(a.seconds - b.seconds) / a.seconds for a, b in zip(rows, repeat.rows, strict=True)]
    return StepsReport(
        clock=sorted({r.clock for r in rows}),
        attention=steps.attention,
        rows=[
            StepFigures(describe(r.shape), r.seconds, base.step_time_s(r.shape), fitted.step_time_s(r.shape))
            for r in rows
        ],
        roofline_default={name: getattr(base, name) for name in ROOFLINE_CONSTANTS},
        roofline_default_mean_abs_rel_error=float(np.mean(np.abs(default_err))),
        roofline_default_max_abs_rel_error=float(np.max(np.abs(default_err))),
        roofline_fitted={name: getattr(fitted, name) for name in ROOFLINE_CONSTANTS},
        roofline_fitted_mean_abs_rel_error=float(np.mean(np.abs(fitted_err))),
        roofline_fitted_max_abs_rel_error=float(np.max(np.abs(fitted_err))),
        fitted_cost_model_held_out_mean_rel_error=float(np.mean(held)),
        fitted_cost_model_held_out_max_rel_error=float(np.max(held)),
        repeat_mean_rel_diff=None if diffs is None else float(np.mean(diffs)),
        repeat_max_rel_diff=None if diffs is None else float(np.max(diffs)),
    )


def check(data: Measurement, hardware: str | None = None) -> GpuCheck:
    """Everything the module docs list."""
    hw = hardware_for(data.gpu, hardware)
    overlap = None
    if data.overlap is not None:  # a step with DMA copies in flight on another stream, and the copies
        overlap = [
            OverlapFigures(
                describe(BatchShape(r.prefills, (1024,) * r.decodes)),
                r.direction,
                r.step_together_s / r.step_alone_s,
                r.copy_bytes / r.copy_alone_s,
                r.copy_bytes / r.copy_together_s,
            )
            for r in data.overlap
        ]
    return GpuCheck(
        data.machine,
        hw.name,
        steps=None if data.steps is None else _steps_report(data.steps, data.steps_repeat, hw),
        links=_link_report(data, hw) if data.links or data.links_cpp is not None else None,
        overlap=overlap,
        kvtier=None if data.kvtier is None else data.kvtier.raw,
    )


def _steps_summary(s: StepsReport) -> list[str]:
    lines = [f"steps ({', '.join(s.clock)} clock, attention {s.attention}):"]
    lines.append(f"  {'shape':36s} {'measured ms':>12s} {'roofline ms':>12s} {'fitted ms':>10s}")
    for r in s.rows:
        lines.append(
            f"  {r.shape:36s} {r.measured_s * 1e3:12.2f} {r.roofline_s * 1e3:12.2f} {r.fitted_roofline_s * 1e3:10.2f}"
        )
    for which, consts, mean, worst in (
        (
            "default",
            s.roofline_default,
            s.roofline_default_mean_abs_rel_error,
            s.roofline_default_max_abs_rel_error,
        ),
        (
            "fitted",
            s.roofline_fitted,
            s.roofline_fitted_mean_abs_rel_error,
            s.roofline_fitted_max_abs_rel_error,
        ),
    ):
        shown = ", ".join(f"{k} {v:.3g}" for k, v in consts.items())
        lines.append(f"  roofline {which} ({shown}): mean |rel error| {mean:.3f}, max {worst:.3f}")
    lines.append(
        f"  fitted cost model, half held out: mean {s.fitted_cost_model_held_out_mean_rel_error:.3f}, "
        f"max {s.fitted_cost_model_held_out_max_rel_error:.3f}"
    )
    if s.repeat_mean_rel_diff is not None and s.repeat_max_rel_diff is not None:
        lines.append(
            f"  the same steps measured again: mean |rel diff| {s.repeat_mean_rel_diff:.4f}, "
            f"max {s.repeat_max_rel_diff:.4f} (the measurement's noise)"
        )
    return lines


def _links_summary(links: LinksReport) -> list[str]:
    p = links.profile
    lines = [
        f"links (profile: {p.h2d_bytes_per_s / 1e9:.1f} / {p.d2h_bytes_per_s / 1e9:.1f} GB/s h2d / d2h "
        f"+ {p.per_segment_overhead_s * 1e6:.2f} us a segment):"
    ]
    fits: tuple[tuple[str, CppLink | PythonLink | None], ...] = (
        ("h2d cudaMemcpyAsync per segment (C++)", links.cpp_h2d),
        ("d2h cudaMemcpyAsync per segment (C++)", links.cpp_d2h),
        ("h2d torch copy_ per segment", links.python_h2d),
        ("d2h torch copy_ per segment", links.python_d2h),
    )
    for what, f in fits:
        if f:
            lines.append(
                f"  {what}: {f.bytes_per_s / 1e9:.1f} GB/s + "
                f"{f.per_segment_overhead_s * 1e6:.2f} us a segment (fit max err {f.fit_max_rel_error:.2f})"
            )
    for d, c, py in (("h2d", links.cpp_h2d, links.python_h2d), ("d2h", links.cpp_d2h, links.python_d2h)):
        if c:
            lines.append(
                f"  {d} one gather kernel over pinned pages of {c.smallest_segment_bytes >> 10} KiB and up: "
                f"{c.gather_kernel_bytes_per_s_min / 1e9:.1f}-{c.gather_kernel_bytes_per_s_max / 1e9:.1f} GB/s"
            )
        if py:
            lines.append(f"  {d} one large copy: {py.one_copy_bytes_per_s / 1e9:.1f} GB/s")
    if links.duplex_bytes_per_s is not None:
        lines.append(f"  both directions at once: {links.duplex_bytes_per_s / 1e9:.1f} GB/s in total")
    return lines


def summary(result: GpuCheck, measurement: Measurement) -> str:
    m = result.machine
    lines = [f"{m.get('gpu', '?')} (profile {result.hardware_profile}), torch {m.get('torch', '?')}"]
    if result.steps:
        lines += _steps_summary(result.steps)
    if result.links:
        lines += _links_summary(result.links)
    for r in result.overlap or []:
        lines.append(
            f"{r.shape} with {r.direction} copies in flight: step x{r.step_slowdown:.3f}; copies "
            f"{r.copy_alone_bytes_per_s / 1e9:.1f} GB/s alone, {r.copy_together_bytes_per_s / 1e9:.1f} beside the step"
        )
    k = measurement.kvtier
    for threads, t in k.threads if k else ():
        lines.append(
            f"kvtier DRAM tier, {threads} copy thread(s), {k.bytes >> 20 if k else 0} MiB: put {t.put_s * 1e3:.1f} ms, "
            f"lease+load into pinned memory {t.load_s * 1e3:.1f} ms, then to the GPU {t.h2d_s * 1e3:.1f} ms; "
            f"memcpy into the same pinned memory {t.memcpy_s * 1e3:.1f} ms"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvtier.sim.gpu_check", description=__doc__.split("\n")[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--hardware", help="hardware profile name or file (default: from the GPU's name)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    measurement = read(args.file)
    result = check(measurement, args.hardware)
    print(json_text(result, indent=1) if args.json else summary(result, measurement))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
