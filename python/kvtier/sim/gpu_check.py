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
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.errors import ConfigError
from kvtier.sim.calibrate import Sample, describe, fit, relative_errors
from kvtier.sim.cost import COEFFICIENTS, BatchShape, PrefillChunk, RooflineCostModel
from kvtier.sim.hardware import HardwareProfile, load_hardware
from kvtier.sim.models import load_model

#: GPU names (as torch reports them) to the hardware profile that describes them.
PROFILES = (("H200", "h200"), ("H100", "h100-sxm"), ("GH200", "gh200"), ("L40S", "l40s"))
ROOFLINE_CONSTANTS = ("mfu_prefill", "mfu_decode", "bandwidth_efficiency", "step_overhead_s")


@dataclass(frozen=True)
class StepRow:
    shape: BatchShape
    seconds: float
    clock: str  # "graph" (CUDA-graph replay) or "eager"


@dataclass(frozen=True)
class LinkFit:
    """``seconds = bytes / bytes_per_s + segments x per_segment_overhead_s`` fitted to copies issued
    one per segment (:func:`kvtier.sim.cost.transfer_work_s`'s form)."""

    direction: str
    bytes_per_s: float
    per_segment_overhead_s: float
    max_rel_error: float  # of the fit over the rows it was fitted to


def _need(data: dict[str, Any], key: str, where: str) -> Any:
    if key not in data:
        raise ConfigError(f"{where}: missing {key!r} (is this a scripts/gpu_calibrate.py output?)")
    return data[key]


def read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not a readable JSON file: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    _need(data, "machine", str(path))
    return data


def step_rows(data: dict[str, Any]) -> list[StepRow]:
    steps = _need(data, "steps", "measurement")
    rows = []
    for i, raw in enumerate(_need(steps, "rows", "steps")):
        where = f"steps.rows[{i}]"
        prefills = tuple(PrefillChunk(int(n), int(c)) for n, c in _need(raw, "prefills", where))
        shape = BatchShape(prefills, tuple(int(c) for c in _need(raw, "decodes", where)))
        seconds, clock = (
            (raw["graph_s"], "graph") if "graph_s" in raw else (_need(raw, "eager_s", where), "eager")
        )
        if not (isinstance(seconds, (int, float)) and seconds > 0 and math.isfinite(seconds)):
            raise ConfigError(f"{where}: step time {seconds!r}; expected a positive number of seconds")
        rows.append(StepRow(shape, float(seconds), clock))
    if not rows:
        raise ConfigError("measurement has no step rows")
    return rows


def hardware_for(data: dict[str, Any], name: str | None = None) -> HardwareProfile:
    if name:
        return load_hardware(name)
    gpu = str(data["machine"].get("gpu", ""))
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
                change: dict[str, Any] = {name: float(value)}
                trial = replace(best, **change)
                scores.append(float(np.mean(_errors(trial.step_time_s, rows) ** 2)))
            change = {name: float(grids[name][int(np.argmin(scores))])}
            best = replace(best, **change)
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


def _link_report(data: dict[str, Any], hw: HardwareProfile) -> dict[str, Any]:
    link = hw.host_link
    out: dict[str, Any] = {
        "profile": {
            "h2d_bytes_per_s": link.h2d_bytes_per_s,
            "d2h_bytes_per_s": link.d2h_bytes_per_s,
            "per_segment_overhead_s": link.per_segment_overhead_s,
        }
    }
    if "links" in data:  # from Python: torch copy_ per segment, and one copy of everything
        rows = _need(data["links"], "rows", "links")
        for d in ("h2d", "d2h"):
            mine = [r for r in rows if r["direction"] == d]
            f = fit_link([(r["bytes"], r["segments"], r["per_segment_s"]) for r in mine], d)
            out[f"python_{d}"] = {
                "bytes_per_s": f.bytes_per_s,
                "per_segment_overhead_s": f.per_segment_overhead_s,
                "fit_max_rel_error": f.max_rel_error,
                "one_copy_bytes_per_s": max(r["bytes"] / r["one_copy_s"] for r in mine),
            }
        out["duplex_bytes_per_s"] = data["links"]["duplex_bytes"] / data["links"]["duplex_s"]
    if "links_cpp" in data:  # from C++: cudaMemcpyAsync per segment, and one gather kernel
        rows = _need(data["links_cpp"], "rows", "links_cpp")
        for d in ("h2d", "d2h"):
            copies = [r for r in rows if r["direction"] == d and r["method"] == "memcpy_async_per_segment"]
            f = fit_link([(r["bytes"], r["segments"], r["seconds"]) for r in copies], d)
            gather = [
                r["bytes"] / r["seconds"]
                for r in rows
                if r["direction"] == d and r["method"] == "gather_kernel"
            ]
            out[f"cpp_{d}"] = {
                "bytes_per_s": f.bytes_per_s,
                "per_segment_overhead_s": f.per_segment_overhead_s,
                "fit_max_rel_error": f.max_rel_error,
                "gather_kernel_bytes_per_s_min": min(gather) if gather else math.nan,
                "gather_kernel_bytes_per_s_max": max(gather) if gather else math.nan,
                "smallest_segment_bytes": min(r["segment_bytes"] for r in copies),
            }
    return out


def check(data: dict[str, Any], hardware: str | None = None) -> dict[str, Any]:
    """Everything the module docs list, as one JSON-ready dict."""
    hw = hardware_for(data, hardware)
    out: dict[str, Any] = {"machine": data["machine"], "hardware_profile": hw.name}
    if "steps" in data:
        if data["steps"].get("model") != "Llama-3.1-8B-shaped":
            raise ConfigError(
                f"steps were measured on {data['steps'].get('model')!r}; the check compares a "
                "Llama-3.1-8B-shaped model's steps (scripts/gpu_calibrate.py without --tiny)"
            )
        rows = step_rows(data)
        base = RooflineCostModel(hw, load_model("llama-3.1-8b"))
        fitted = fit_roofline(base, rows)
        default_err, fitted_err = _errors(base.step_time_s, rows), _errors(fitted.step_time_s, rows)
        samples = [Sample(r.shape, r.seconds) for r in rows]
        held = [math.nan]
        if len(samples) >= 4 * len(COEFFICIENTS):  # half to fit, half to check
            trial = fit(samples[0::2], base.kv_bytes_per_token, base.num_layers)
            held = relative_errors(trial, samples[1::2])
        out["steps"] = {
            "clock": sorted({r.clock for r in rows}),
            "attention": data["steps"].get("attention"),
            "rows": [
                {
                    "shape": describe(r.shape),
                    "measured_s": r.seconds,
                    "roofline_s": base.step_time_s(r.shape),
                    "fitted_roofline_s": fitted.step_time_s(r.shape),
                }
                for r in rows
            ],
            "roofline_default": {name: getattr(base, name) for name in ROOFLINE_CONSTANTS},
            "roofline_default_mean_abs_rel_error": float(np.mean(np.abs(default_err))),
            "roofline_default_max_abs_rel_error": float(np.max(np.abs(default_err))),
            "roofline_fitted": {name: getattr(fitted, name) for name in ROOFLINE_CONSTANTS},
            "roofline_fitted_mean_abs_rel_error": float(np.mean(np.abs(fitted_err))),
            "roofline_fitted_max_abs_rel_error": float(np.max(np.abs(fitted_err))),
            "fitted_cost_model_held_out_mean_rel_error": float(np.mean(held)),
            "fitted_cost_model_held_out_max_rel_error": float(np.max(held)),
        }
    if "links" in data or "links_cpp" in data:
        out["links"] = _link_report(data, hw)
    if (
        "steps_repeat" in data and "steps" in out
    ):  # the same shapes measured again: the measurement's own noise
        again = step_rows({"steps": data["steps_repeat"]})
        diffs = [abs(a.seconds - b.seconds) / a.seconds for a, b in zip(step_rows(data), again, strict=True)]
        out["steps"]["repeat_mean_rel_diff"] = float(np.mean(diffs))
        out["steps"]["repeat_max_rel_diff"] = float(np.max(diffs))
    if "overlap" in data:  # a step with DMA copies in flight on another stream, and the copies
        out["overlap"] = [
            {
                "shape": describe(
                    BatchShape(
                        tuple(PrefillChunk(int(n), int(c)) for n, c in r["prefills"]),
                        (1024,) * int(r["decodes"]),
                    )
                ),
                "direction": r["direction"],
                "step_slowdown": r["step_together_s"] / r["step_alone_s"],
                "copy_alone_bytes_per_s": r["copy_bytes"] / r["copy_alone_s"],
                "copy_together_bytes_per_s": r["copy_bytes"] / r["copy_together_s"],
            }
            for r in _need(data["overlap"], "rows", "overlap")
        ]
    if "kvtier" in data:
        out["kvtier"] = data["kvtier"]
    return out


def summary(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [f"{m.get('gpu', '?')} (profile {result['hardware_profile']}), torch {m.get('torch', '?')}"]
    s = result.get("steps")
    if s:
        lines.append(f"steps ({', '.join(s['clock'])} clock, attention {s['attention']}):")
        lines.append(f"  {'shape':36s} {'measured ms':>12s} {'roofline ms':>12s} {'fitted ms':>10s}")
        for r in s["rows"]:
            lines.append(
                f"  {r['shape']:36s} {r['measured_s'] * 1e3:12.2f} {r['roofline_s'] * 1e3:12.2f} "
                f"{r['fitted_roofline_s'] * 1e3:10.2f}"
            )
        for which in ("default", "fitted"):
            consts = ", ".join(f"{k} {v:.3g}" for k, v in s[f"roofline_{which}"].items())
            lines.append(
                f"  roofline {which} ({consts}): mean |rel error| "
                f"{s[f'roofline_{which}_mean_abs_rel_error']:.3f}, max {s[f'roofline_{which}_max_abs_rel_error']:.3f}"
            )
        lines.append(
            f"  fitted cost model, half held out: mean {s['fitted_cost_model_held_out_mean_rel_error']:.3f}, "
            f"max {s['fitted_cost_model_held_out_max_rel_error']:.3f}"
        )
    if s and "repeat_mean_rel_diff" in s:
        lines.append(
            f"  the same steps measured again: mean |rel diff| {s['repeat_mean_rel_diff']:.4f}, "
            f"max {s['repeat_max_rel_diff']:.4f} (the measurement's noise)"
        )
    links = result.get("links")
    if links:
        p = links["profile"]
        lines.append(
            f"links (profile: {p['h2d_bytes_per_s'] / 1e9:.1f} / {p['d2h_bytes_per_s'] / 1e9:.1f} GB/s h2d / d2h "
            f"+ {p['per_segment_overhead_s'] * 1e6:.2f} us a segment):"
        )
        for key, what in (
            ("cpp", "cudaMemcpyAsync per segment (C++)"),
            ("python", "torch copy_ per segment"),
        ):
            for d in ("h2d", "d2h"):
                f = links.get(f"{key}_{d}")
                if f:
                    lines.append(
                        f"  {d} {what}: {f['bytes_per_s'] / 1e9:.1f} GB/s + "
                        f"{f['per_segment_overhead_s'] * 1e6:.2f} us a segment (fit max err {f['fit_max_rel_error']:.2f})"
                    )
        for d in ("h2d", "d2h"):
            f = links.get(f"cpp_{d}")
            if f:
                lines.append(
                    f"  {d} one gather kernel over pinned pages of {f['smallest_segment_bytes'] >> 10} KiB and up: "
                    f"{f['gather_kernel_bytes_per_s_min'] / 1e9:.1f}-{f['gather_kernel_bytes_per_s_max'] / 1e9:.1f} GB/s"
                )
            f = links.get(f"python_{d}")
            if f:
                lines.append(f"  {d} one large copy: {f['one_copy_bytes_per_s'] / 1e9:.1f} GB/s")
        if "duplex_bytes_per_s" in links:
            lines.append(f"  both directions at once: {links['duplex_bytes_per_s'] / 1e9:.1f} GB/s in total")
    for r in result.get("overlap", []):
        lines.append(
            f"{r['shape']} with {r['direction']} copies in flight: step x{r['step_slowdown']:.3f}; copies "
            f"{r['copy_alone_bytes_per_s'] / 1e9:.1f} GB/s alone, {r['copy_together_bytes_per_s'] / 1e9:.1f} beside the step"
        )
    k = result.get("kvtier")
    if k:
        for key in sorted(x for x in k if x.startswith("threads_")):
            t = k[key]
            lines.append(
                f"kvtier DRAM tier, {key.split('_')[1]} copy thread(s), {k['bytes'] >> 20} MiB: put {t['put_s'] * 1e3:.1f} ms, "
                f"lease+load into pinned memory {t['load_s'] * 1e3:.1f} ms, then to the GPU {t['h2d_s'] * 1e3:.1f} ms; "
                f"memcpy into the same pinned memory {t['memcpy_s'] * 1e3:.1f} ms"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvtier.sim.gpu_check", description=__doc__.split("\n")[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--hardware", help="hardware profile name or file (default: from the GPU's name)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    result = check(read(args.file), args.hardware)
    print(json.dumps(result, indent=1) if args.json else summary(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
