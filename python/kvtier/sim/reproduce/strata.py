"""Strata's headline experiment (§5.2, Fig. 8 LooGLE row; §5.3.1, Fig. 9): long-document QA on one
H200, throughput at equal TTFT of Strata against SGLang-HiCache (``hicache``) and vLLM-LMCache
(``lmcache``) for Llama-3.1-8B and Qwen2.5-14B, and the I/O-only (``strata_io``) and
schedule-only (``strata_sched``) ablations for Qwen2.5-14B.

Each system is swept over Poisson request rates (the paper's method, §5.1) with the client's cap of
128 in-flight queries, giving a curve of (output-token throughput, mean TTFT) per system, plotted as
Fig. 8 plots it.

*Throughput at equal TTFT* (the paper's "up to N x higher throughput at the same TTFT"): the TTFT
level is the baseline's mean TTFT at saturation (its highest on the sweep, where its throughput has
flattened); each system's throughput at that level is the highest its curve reaches with mean TTFT
at or below it (linearly interpolated between sweep points); the ratio is Strata's over the
baseline's. Whenever Strata's TTFT stays below that level this is the ratio of peak throughputs,
which is what Fig. 9 reports for the ablations ("peak throughput").

Configs: ``experiments/strata/loogle_llama8b_h200.yaml`` and ``loogle_qwen14b_h200.yaml``.
``quick`` runs Llama-3.1-8B only, on a 50-document, 500-query version of the workload at one overload
rate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from kvtier.sim.config import SimConfig
from kvtier.sim.reproduce import Row, experiments_dir, reproduction
from kvtier.sim.run import RateRun, run

PAPER = "strata"
SYSTEMS = ("strata", "hicache", "lmcache", "strata_io", "strata_sched")
LABELS = {
    "strata": "Strata",
    "hicache": "SGLang-HiCache",
    "lmcache": "vLLM-LMCache",
    "strata_io": "Strata-IO",
    "strata_sched": "Strata-Schedule-Only",
}
# Request rates (per second), from light load to past every system's saturation.
RATES = {
    "llama-3.1-8b": (2.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0),
    "qwen2.5-14b": (1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0),
}
CONFIGS = {"llama-3.1-8b": "loogle_llama8b_h200.yaml", "qwen2.5-14b": "loogle_qwen14b_h200.yaml"}
# Quick: more documents than the GPU holds (about 37 of ~21.6K tokens for Llama-8B), so hits come
# from host memory, but a fifth of the queries, at an overload rate only (peak throughputs).
SATURATED = 0.95
QUICK_WORKLOAD = {"num_requests": 500, "num_documents": 50}
QUICK_RATES = (24.0,)

Result = RateRun
Curve = list[tuple[float, float]]  # (throughput, mean TTFT) per rate, in rate order


def _sweep(model: str, quick: bool) -> dict[str, list[Result]]:
    """Each system over ascending rates, up to the first rate it cannot keep up with (served
    below ``SATURATED`` of the offered rate): past it the curve only climbs in TTFT."""
    base = SimConfig.from_yaml(experiments_dir() / PAPER / CONFIGS[model])
    rates = QUICK_RATES if quick else RATES[model]
    out: dict[str, list[Result]] = {}
    for name in SYSTEMS:
        results = []
        for rate in rates:
            workload = {**base.workload, "rate_per_s": rate, **(QUICK_WORKLOAD if quick else {})}
            result: Result = {
                **run(base.with_overrides(policy={"name": name}, workload=workload)),
                "rate_per_s": rate,
            }
            results.append(result)
            if result["throughput_requests_per_s"] < SATURATED * rate:
                break
        out[name] = results
    return out


def curve(results: Sequence[Result]) -> Curve:
    return [(float(r["throughput_output_tokens_per_s"]), float(r["ttft_s"]["mean"])) for r in results]


def throughput_at_ttft(points: Curve, ttft_s: float) -> float:
    """The highest throughput of a rate-sweep curve with mean TTFT at or below ``ttft_s``."""
    best = 0.0
    for i, (thr, ttft) in enumerate(points):
        if ttft <= ttft_s:
            best = max(best, thr)
        elif i > 0 and points[i - 1][1] <= ttft_s:  # the curve crosses the level: interpolate
            thr0, ttft0 = points[i - 1]
            best = max(best, thr0 + (thr - thr0) * (ttft_s - ttft0) / (ttft - ttft0))
    return best


def ratio_at_equal_ttft(system: Curve, baseline: Curve) -> tuple[float, float]:
    """(throughput ratio, TTFT level): at the baseline's saturation TTFT (see the module docs)."""
    level = max(ttft for _, ttft in baseline)
    return throughput_at_ttft(system, level) / throughput_at_ttft(baseline, level), level


def peak_ratio(system: Curve, baseline: Curve) -> float:
    return max(t for t, _ in system) / max(t for t, _ in baseline)


@reproduction(PAPER)
def reproduce(out_dir: Path, quick: bool) -> list[Row]:
    models = ("llama-3.1-8b",) if quick else ("llama-3.1-8b", "qwen2.5-14b")
    sweeps = {model: _sweep(model, quick) for model in models}
    for model, sweep in sweeps.items():
        _plot(out_dir / f"strata_{model}.png", model, sweep)
    return _rows(sweeps, quick)


# ----------------------------------------------------------------------------------------------
# Rows


# Why kvtier's ratio can differ from the paper's, per baseline (used where it is off by > 30%).
GAP_NOTES = {
    "hicache": (
        "kvtier's SGLang-HiCache is FCFS with layerwise per-page copies at ~22% of PCIe (Fig. 3); "
        "its other overheads are not modelled"
    ),
    "lmcache": (
        "kvtier's vLLM-LMCache loads whole 256-token chunks at full PCIe bandwidth (synchronously) "
        "and pays none of vLLM v0.8.5 + LMCache v0.2.1's CPU-side retrieval costs, so it is closer to "
        "Strata than the measured system"
    ),
    "strata_io": "kvtier's Strata-IO is HiCache's FCFS scheduler with whole-context layerwise kernels",
    "strata_sched": "kvtier's Strata-Schedule-Only pays HiCache's per-page copy cost on every load",
}
COMMON_NOTE = (
    "the cold-start misses (105 documents x ~1 s of prefill for Llama-8B, ~2 s for Qwen-14B) are "
    "computed by every system and bound Strata's peak (its GPU is busy > 99% at saturation)"
)
QUICK_NOTE = "quick: Llama-3.1-8B, 50 documents, 500 queries, one overload rate (not the paper's workload)"


def _note(text: str, baseline: str, ratio: float, paper: float, quick: bool) -> str:
    if quick:
        return f"{text}; {QUICK_NOTE}"
    if abs(ratio - paper) > 0.3 * paper:
        return f"{text}; outside 30%: {GAP_NOTES[baseline]}; {COMMON_NOTE}"
    return text


def _rows(sweeps: Mapping[str, Mapping[str, list[Result]]], quick: bool) -> list[Row]:
    paper_vs = {  # §5.2.1: "up to N x higher throughput at the same TTFT"
        "llama-3.1-8b": {"hicache": 3.2, "lmcache": 2.6},
        "qwen2.5-14b": {"hicache": 3.9, "lmcache": 2.1},
    }
    rows: list[Row] = []
    for model, sweep in sweeps.items():
        strata = curve(sweep["strata"])
        peaks = {name: max(t for t, _ in curve(rs)) for name, rs in sweep.items()}
        for baseline, paper in paper_vs[model].items():
            ratio, level = ratio_at_equal_ttft(strata, curve(sweep[baseline]))
            text = (
                f"at mean TTFT <= {level:.1f} s ({LABELS[baseline]}'s saturation TTFT); peak output "
                f"tokens/s: Strata {peaks['strata']:.0f}, {LABELS[baseline]} {peaks[baseline]:.0f}"
            )
            metric = f"{model} LooGLE: throughput at equal TTFT, Strata / {baseline}"
            rows.append(Row(PAPER, metric, paper, ratio, note=_note(text, baseline, ratio, paper, quick)))
    # Fig. 9 is Qwen-14B (§5.3); quick runs only Llama-8B and reports its ablation instead.
    model = "qwen2.5-14b" if "qwen2.5-14b" in sweeps else "llama-3.1-8b"
    sweep = sweeps[model]
    hicache = curve(sweep["hicache"])
    for name, paper in (("strata_io", 2.3), ("strata_sched", 1.8)):  # §5.3.1
        ratio = peak_ratio(curve(sweep[name]), hicache)
        text = f"{LABELS[name]} over SGLang-HiCache, peak output-token throughput of the rate sweep"
        metric = f"{model} Fig. 9: peak throughput, {name} / hicache"
        rows.append(Row(PAPER, metric, paper, ratio, note=_note(text, name, ratio, paper, quick)))
    return rows


# ----------------------------------------------------------------------------------------------
# Plot


def _plot(path: Path, model: str, sweep: Mapping[str, Sequence[Result]]) -> None:
    """Fig. 8 / Fig. 9 style: mean TTFT against output-token throughput, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    styles = {"strata": "o-", "hicache": "s-", "lmcache": "^-", "strata_io": "D--", "strata_sched": "v--"}
    for name, results in sweep.items():
        points = curve(results)
        ax.plot(
            [t for t, _ in points], [s for _, s in points], styles[name], label=LABELS[name], markersize=4
        )
    ax.set(
        xlabel="output token throughput (tokens/s)",
        ylabel="mean TTFT (s)",
        title=f"LooGLE, {model}, H200 (kvtier sim)",
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
