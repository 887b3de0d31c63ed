"""SuperInfer's headline experiments (§5.2-§5.3, §3.1, Table 1): Qwen2.5-32B on one GH200 serving
ShareGPT-like requests under TTFT 5 s / TBT 100 ms SLOs.

- Fig. 16: TTFT and TBT SLO attainment against request rate, SuperInfer (``rotasched`` with
  DuplexKV) vs vLLM (``fcfs``); the paper reports up to +74.7 points of TTFT attainment with
  comparable TBT, and up to 29.2% more throughput (Fig. 22).
- Fig. 1 (§3.1): the static Waiting-First / Swapped-First policies against FCFS (P99 TTFT, TBT).
- Figs. 18-20: the alpha / beta_F / beta_B sweeps (direction only: the paper's plots carry no
  table); Fig. 21: the B_xfer sweep; Fig. 17: "w/o DuplexKV" with B_xfer L = 300 and H = 2400.
- Table 1: the transfer-engine ladder (Naive, MS, MS+MK, DuplexKV), 8 GB each way of Qwen2.5-32B
  KV over the GH200 profile's C2C link, timed on kvtier's link model.

Workload: a ShareGPT-shaped parameterisation of ``multiturn`` (one turn per session; see
``experiments/superinfer/superinfer.yaml``). "TBT attainment" is the share of requests whose mean
time between tokens meets 100 ms (kvtier's ``tpot_attainment``); "P99 TBT" is the P99 over
requests of that mean. §5.1 does not say per request or per token, so the Fig. 16 rows are also
given with TBT read per token gap (``tbt_gap_attainment``: the share of all gaps within 100 ms).

B_xfer: the paper's 2400 blocks was set for a 144 GB GH200 (§5.1); the shared ``gh200`` profile is
the 96 GB part, whose KV pool is a third as large, so 2400 blocks rotate ~45% of it per iteration
instead of ~15%. Every experiment runs both with the paper's number and with it scaled by the
ratio of the two KV pools (:func:`xfer_scale`, computed from the profiles, not fitted); the sweeps
and ablations use the scaled values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvtier.sched.rotasched import PAPER_XFER_BLOCKS
from kvtier.sched.swap_copy import TABLE1_LADDER, SwapCopy, swap_engine
from kvtier.sim.config import SimConfig
from kvtier.sim.core import EventLoop
from kvtier.sim.cost import make_cost_model
from kvtier.sim.hardware import HardwareProfile, load_hardware
from kvtier.sim.models import load_model
from kvtier.sim.reproduce import Row, experiments_dir, reproduction
from kvtier.sim.resources import Direction, Link, Transfer
from kvtier.sim.run import RateRun, device_blocks, run

PAPER = "superinfer"
RATES = (4.0, 8.0, 12.0, 14.0, 16.0, 20.0)
QUICK_RATES = (20.0,)
HIGH_RATE = 16.0  # the sweeps' load: vLLM is memory-bound and loses about half its TTFT SLOs
PAPER_HBM_GB, PROFILE_HBM_GB = 144, 96  # §5.1's GH200 vs the shared profile's part
PAPER_XFER_L = 300  # §5.3 (Fig. 17 L); §5.1's 2400: PAPER_XFER_BLOCKS
TABLE1_TOKENS = 32768  # §5.3: 8 GB (32768 tokens) of Qwen2.5-32B KV per direction
# Table 1 E2E times (ms) and the ideal (half-duplex 384 GB/s DRAM: 192 GB/s each way at once).
TABLE1_E2E_MS = {"naive": 1556.15, "ms": 159.87, "ms_mk": 63.14, "duplexkv": 46.80}
TABLE1_IDEAL_MS = 41.66
TABLE1_NAMES = {"naive": "Naive", "ms": "MS", "ms_mk": "MS+MK", "duplexkv": "DuplexKV"}

Result = RateRun


def _config(name: str) -> SimConfig:
    return SimConfig.from_yaml(experiments_dir() / PAPER / f"{name}.yaml")


_CACHE: dict[tuple[str, float, int, tuple[tuple[str, Any], ...]], Result] = {}


def _run(base: SimConfig, rate: float, requests: int, **policy: Any) -> Result:
    """One run; repeated settings (the sweeps share their base point) are run once per process."""
    spec = {**base.policy, **policy}
    key = (base.name, rate, requests, tuple(sorted(spec.items())))
    if key not in _CACHE:
        workload = {**base.workload, "rate_per_s": rate, "num_sessions": requests}
        _CACHE[key] = {**run(base.with_overrides(policy=spec, workload=workload)), "rate_per_s": rate}
    return _CACHE[key]


def xfer_scale(base: SimConfig) -> float:
    """KV blocks of the shared GH200 profile over those of §5.1's 144 GB GH200 (same formula)."""
    hw = load_hardware(base.hardware)
    model = load_model(base.model)
    cost = make_cost_model("roofline", hw, model, tp=base.tp)
    paper_hw = dataclasses.replace(
        hw, hbm_capacity_bytes=hw.hbm_capacity_bytes * PAPER_HBM_GB // PROFILE_HBM_GB
    )
    return device_blocks(base, hw, model, cost) / device_blocks(base, paper_hw, model, cost)


# ----------------------------------------------------------------------------------------------
# Table 1: the transfer-engine ladder on the link model


def transfer_ladder(
    hw: HardwareProfile, kv_bytes_per_token: int, num_layers: int, block_tokens: int
) -> dict[str, dict[str, float]]:
    """Moves TABLE1_TOKENS of KV each way (D2H and H2D) with each engine's SwapCopy over the GH200
    host link: one copy stream at a time unless the engine is duplex (§5.3, Table 1)."""
    nbytes = TABLE1_TOKENS * kv_bytes_per_token
    block_bytes = block_tokens * kv_bytes_per_token
    out = {
        name: _ladder_rung(hw, swap_engine(name), nbytes, block_bytes, num_layers) for name in TABLE1_LADDER
    }
    spec = hw.host_link  # ideal: the half-duplex DRAM's total split evenly (192 GB/s each way)
    ideal_bw = spec.duplex_total_bytes_per_s / 2 or min(spec.h2d_bytes_per_s, spec.d2h_bytes_per_s)
    out["ideal"] = {"e2e_ms": nbytes / ideal_bw * 1e3}
    return out


def _ladder_rung(
    hw: HardwareProfile, copy: SwapCopy, nbytes: int, block_bytes: int, num_layers: int
) -> dict[str, float]:
    loop = EventLoop()
    link = Link.of(loop, "c2c", hw.host_link)
    spans: dict[Direction, tuple[float, float]] = {}
    segment = copy.segment_bytes(nbytes, block_bytes, num_layers)

    def start(direction: Direction, then: Direction | None) -> None:
        begun = loop.now_s

        def done(_t: Transfer) -> None:
            spans[direction] = (begun, loop.now_s)
            if then is not None:
                start(then, None)

        link.submit(nbytes, direction, done, segment, batched=copy.batched)

    if copy.duplex:
        start(Direction.OUT, None)
        start(Direction.IN, None)
    else:  # data races serialise the directions: swap-out, then swap-in
        start(Direction.OUT, Direction.IN)
    loop.run()
    out_s, in_s = (spans[d][1] - spans[d][0] for d in (Direction.OUT, Direction.IN))
    return {
        "d2h_gb_per_s": nbytes / out_s / 1e9,
        "h2d_gb_per_s": nbytes / in_s / 1e9,
        "e2e_ms": max(e for _, e in spans.values()) * 1e3,
    }


def _ladder_rows(base: SimConfig) -> tuple[list[Row], dict[str, dict[str, float]]]:
    hw = load_hardware(base.hardware)
    model = load_model(base.model)
    cost = make_cost_model("roofline", hw, model, tp=base.tp)
    ladder = transfer_ladder(hw, cost.kv_bytes_per_token, cost.num_layers, base.block_tokens)
    duplex = ladder["duplexkv"]["e2e_ms"]
    rows = []
    for name in ("naive", "ms", "ms_mk"):
        kv = ladder[name]["e2e_ms"] / duplex
        paper = TABLE1_E2E_MS[name] / TABLE1_E2E_MS["duplexkv"]
        note = (
            f"E2E {ladder[name]['e2e_ms']:.1f} ms (paper {TABLE1_E2E_MS[name]:.1f}); D2H/H2D "
            f"{ladder[name]['d2h_gb_per_s']:.0f}/{ladder[name]['h2d_gb_per_s']:.0f} GB/s, one direction at a time"
        )
        if name in ("naive", "ms"):
            note += (
                "; calibrated, not predicted: the gh200 profile's copy launch (5.8 us) and per-copy rates "
                "(90 D2H / 164 H2D GB/s, copies launched one per segment) are fitted to Naive's and MS's rows"
            )
        if name == "ms_mk":
            note += "; the lone-direction rates are this row's 239/270 GB/s: it checks DuplexKV's side"
        rows.append(Row(PAPER, f"Table 1: {TABLE1_NAMES[name]} E2E time / DuplexKV", paper, kv, note=note))
    rows.append(
        Row(
            PAPER,
            "Table 1: DuplexKV E2E time / ideal duplex",
            TABLE1_E2E_MS["duplexkv"] / TABLE1_IDEAL_MS,
            duplex / ladder["ideal"]["e2e_ms"],
            note=(
                f"E2E {duplex:.1f} ms vs ideal {ladder['ideal']['e2e_ms']:.1f} ms (192+192 GB/s): both "
                "ways share Grace DRAM's 384 GB/s (§3.3), 180 D2H / 204 H2D GB/s; D2H ends alone"
            ),
        )
    )
    return rows, ladder


# ----------------------------------------------------------------------------------------------
# Rows


def _ttft(r: Result) -> float:
    return float(r["slo"]["ttft_attainment"])


def _tbt(r: Result) -> float:
    return float(r["slo"]["tpot_attainment"])


def _p99_ttft(r: Result) -> float:
    return float(r["ttft_s"]["p99"])


def _p99_tbt(r: Result) -> float:
    return float(r["tpot_s"]["p99"])


def _tbt_gap(r: Result) -> float:
    """TBT attainment read per token gap: the share of all token gaps within 100 ms (§5.1 counts
    requests, so this is a sensitivity reading, reported beside the per-request one)."""
    return float(r["slo"]["tbt_gap_attainment"])


def _blocked(r: Result) -> float:
    """Share of the run the GPU waited on swap copies (the cross-iteration pipeline stretched)."""
    return float(r["blocked_io_s"]) / max(float(r["makespan_s"]), 1e-12)


def _headline_rows(series: Mapping[str, Sequence[Result]], label: str, quick: bool) -> list[Row]:
    vllm, si = series["vLLM"], series[label]
    gains = [(_ttft(s) - _ttft(v)) * 100 for s, v in zip(si, vllm, strict=True)]
    best = max(range(len(gains)), key=lambda i: gains[i])
    rate = si[best]["rate_per_s"]
    tbt_ratio = _tbt(si[best]) / max(_tbt(vllm[best]), 1e-9)
    comparable = [i for i in range(len(gains)) if _tbt(si[i]) >= _tbt(vllm[i]) - 0.10]
    best_ok = max(comparable, key=lambda i: gains[i]) if comparable else best
    sizing = "quick run: few requests, little contention; " if quick else ""
    curve = ", ".join(
        f"{s['rate_per_s']:g} RPS: TTFT {_ttft(s):.0%}/{_ttft(v):.0%}, TBT {_tbt(s):.0%}/{_tbt(v):.0%}"
        for s, v in zip(si, vllm, strict=True)
    )
    gap_ok = [i for i in range(len(gains)) if _tbt_gap(si[i]) >= _tbt_gap(vllm[i]) - 0.10]
    best_gap_ok = max(gap_ok, key=lambda i: gains[i]) if gap_ok else best
    gap_curve = ", ".join(
        f"{s['rate_per_s']:g} RPS: {_tbt_gap(s):.0%}/{_tbt_gap(v):.0%}" for s, v in zip(si, vllm, strict=True)
    )
    why_tbt = (
        "with 2400 blocks on the 96 GB profile every contended iteration rotates ~45% of the KV pool "
        "(~15% on the paper's 144 GB GH200): a request swapped in decodes ~2-3 tokens before LVF rotates "
        "it out again, the victims skip the iteration that preempts them and the swap-ins outlast the "
        f"compute (GPU waiting on copies {_blocked(si[best]):.0%} of the run)"
        if "2400" in label
        else "at rates far past capacity (vLLM serves ~8 RPS of these requests) admitting every arrival "
        "grows the rotary population (~600 requests time-share 256 batch slots at 20 RPS): TTFT holds, "
        "each request's mean TBT pays; near the knee TBT stays comparable"
    )
    return [
        Row(
            PAPER,
            f"Fig. 16: TTFT SLO attainment gain over vLLM, max over rates, points ({label})",
            74.7,
            gains[best],
            note=f"{sizing}at {rate:g} RPS; {label}/vLLM per rate: {curve}",
        ),
        Row(
            PAPER,
            f"Fig. 16: TBT SLO attainment, SuperInfer / vLLM at that rate ({label})",
            1.0,
            tbt_ratio,
            note=f"{sizing}{_tbt(si[best]):.1%} vs {_tbt(vllm[best]):.1%} at {rate:g} RPS; {why_tbt}",
        ),
        Row(
            PAPER,
            f"Fig. 16: TTFT gain at rates where TBT stays within 10 points of vLLM, points ({label})",
            74.7,
            gains[best_ok],
            note=(
                f"{sizing}at {si[best_ok]['rate_per_s']:g} RPS (TBT {_tbt(si[best_ok]):.1%} vs "
                f"{_tbt(vllm[best_ok]):.1%}); the paper's vLLM collapses on TTFT at rates it still "
                "serves; here vLLM's TTFT falls where the GPU is near saturation, so fewer points are "
                "available without giving up TBT"
            ),
        ),
        Row(
            PAPER,
            f"Fig. 16, TBT read per token gap: SuperInfer / vLLM at the max-gain rate ({label})",
            1.0,
            _tbt_gap(si[best]) / max(_tbt_gap(vllm[best]), 1e-9),
            note=(
                f"{sizing}share of token gaps within 100 ms, {label}/vLLM per rate: {gap_curve}; §5.1 "
                "counts requests, so this is a sensitivity reading: time-slicing moves TBT into a few "
                "long gaps per request, which the per-request mean sums and the per-gap share does not"
            ),
        ),
        Row(
            PAPER,
            f"Fig. 16, TBT read per token gap: TTFT gain where TBT stays within 10 points, points ({label})",
            74.7,
            gains[best_gap_ok],
            note=(
                f"{sizing}at {si[best_gap_ok]['rate_per_s']:g} RPS (per-gap TBT "
                f"{_tbt_gap(si[best_gap_ok]):.1%} vs {_tbt_gap(vllm[best_gap_ok]):.1%})"
            ),
        ),
    ]


def _direction_row(metric: str, holds: bool, note: str) -> Row:
    return Row(PAPER, metric, 1.0, 1.0 if holds else 0.0, note=f"1 = the paper's direction holds; {note}")


def _sweep_rows(sweeps: Mapping[str, Mapping[float, Result]], quick: bool) -> list[Row]:
    sizing = "quick run; " if quick else ""
    alpha, beta_f, beta_b, xfer = sweeps["alpha"], sweeps["beta_f"], sweeps["beta_b"], sweeps["xfer"]
    a_lo, a_hi = alpha[min(alpha)], alpha[max(alpha)]
    f_lo, f_hi = beta_f[min(beta_f)], beta_f[max(beta_f)]
    b_lo, b_hi = beta_b[0.0], beta_b[max(beta_b)]
    x_lo, x_hi = xfer[min(xfer)], xfer[max(xfer)]

    def fmt(sweep: Mapping[float, Result], name: str) -> str:
        return "; ".join(
            f"{name}={k:g}: TTFT {_ttft(r):.0%} (P99 {_p99_ttft(r):.2f} s), TBT {_tbt(r):.0%} "
            f"(P99 {_p99_tbt(r) * 1e3:.0f} ms)"
            for k, r in sorted(sweep.items())
        )

    return [
        _direction_row(
            "Fig. 18: larger alpha gives better TBT, worse TTFT (beta_B = beta_F = 0)",
            _tbt(a_hi) >= _tbt(a_lo) and _p99_ttft(a_hi) >= _p99_ttft(a_lo),
            f"{sizing}TTFT as P99 (attainment saturates); {fmt(alpha, 'alpha')}",
        ),
        _direction_row(
            "Fig. 19: larger beta_F gives worse P99 TTFT (alpha = 1, beta_B = 0)",
            _p99_ttft(f_hi) > _p99_ttft(f_lo),
            f"{sizing}{fmt(beta_f, 'beta_F')}",
        ),
        _direction_row(
            "Fig. 20: larger beta_B gives worse P99 TBT (alpha = 1, beta_F = 0)",
            _p99_tbt(b_hi) > _p99_tbt(b_lo),
            f"{sizing}{fmt(beta_b, 'beta_B')}",
        ),
        _direction_row(
            "Fig. 21: larger B_xfer gives lower P99 TTFT",
            _p99_ttft(x_hi) <= _p99_ttft(x_lo),
            f"{sizing}{fmt(xfer, 'B_xfer')}",
        ),
        _direction_row(
            "Fig. 21: larger B_xfer gives lower P99 TBT",
            _p99_tbt(x_hi) <= _p99_tbt(x_lo),
            f"{sizing}the paper's TBT gain comes from rotary requests no longer queueing behind a small "
            "budget (HOL blocking in the swapped queue, §3.2); here a small budget mostly means fewer "
            "rotations, so running requests are left alone and TBT is best at the smallest B_xfer; "
            "a larger budget buys TTFT with more rotated (waiting) requests. P99 of the token gaps: "
            + ", ".join(f"B_xfer={k:g}: {r['tbt_s']['p99'] * 1e3:.0f} ms" for k, r in sorted(xfer.items()))
            + (
                " (read per token gap, the largest budget's P99 is below the smallest's)"
                if x_hi["tbt_s"]["p99"] <= x_lo["tbt_s"]["p99"]
                else ""
            ),
        ),
    ]


def _ablation_rows(ab: Mapping[str, Result], wf_sf: Mapping[str, Result], quick: bool) -> list[Row]:
    sizing = "quick run; " if quick else ""
    v, low, high, full = ab["vLLM"], ab["w/o DuplexKV (L)"], ab["w/o DuplexKV (H)"], ab["SuperInfer"]
    fmt = "; ".join(f"{k}: TTFT {_ttft(r):.0%}, TBT {_tbt(r):.0%}" for k, r in ab.items())
    fcfs, wf, sf = wf_sf["FCFS"], wf_sf["Waiting-First"], wf_sf["Swapped-First"]
    fig1 = "; ".join(
        f"{k}: P99 TTFT {_p99_ttft(r):.2f} s, P99 TBT {_p99_tbt(r) * 1e3:.0f} ms" for k, r in wf_sf.items()
    )
    return [
        _direction_row(
            "Fig. 17: w/o DuplexKV (H) loses TBT; SuperInfer beats w/o DuplexKV (L) on TTFT",
            _tbt(high) < _tbt(full) and _ttft(full) >= _ttft(low),
            f"{sizing}{fmt}; L is not TBT-comparable to vLLM here: its 64 KB copies, one direction at "
            "a time, take ~80 ms per rotating iteration (~30 ms of compute), which the pipeline waits for",
        ),
        Row(
            PAPER,
            "Fig. 22: throughput, SuperInfer / vLLM at high load",
            None,
            full["throughput_output_tokens_per_s"] / max(v["throughput_output_tokens_per_s"], 1e-9),
            paper_range=(1.0, 1.292),
            note=f"{sizing}output tokens/s at {HIGH_RATE:g} RPS: vLLM recomputes preempted requests",
        ),
        _direction_row(
            "Fig. 1: Waiting-First lowers P99 TTFT and raises P99 TBT vs FCFS; Swapped-First keeps TBT",
            _p99_ttft(wf) < _p99_ttft(fcfs) and _p99_tbt(wf) > _p99_tbt(fcfs) and _p99_tbt(sf) < _p99_tbt(wf),
            f"{sizing}at {HIGH_RATE:g} RPS, vLLM's swap path: {fig1}",
        ),
    ]


# ----------------------------------------------------------------------------------------------
# Plots


def _plot_rates(path: Path, series: Mapping[str, Sequence[Result]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for label, results in series.items():
        rates = [r["rate_per_s"] for r in results]
        axes[0].plot(rates, [_ttft(r) * 100 for r in results], marker="o", label=label)
        axes[1].plot(rates, [_tbt(r) * 100 for r in results], marker="o", label=label)
    axes[0].set(xlabel="request rate (RPS)", ylabel="TTFT SLO attainment (%)", title="TTFT (SLO 5 s)")
    axes[1].set(xlabel="request rate (RPS)", ylabel="TBT SLO attainment (%)", title="TBT (SLO 100 ms)")
    for ax in axes:
        ax.set_ylim(-5, 105)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Qwen2.5-32B, ShareGPT-like, GH200 (kvtier sim; cf. SuperInfer Fig. 16)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_sweeps(
    path: Path, sweeps: Mapping[str, Mapping[float, Result]], ladder: Mapping[str, Mapping[str, float]]
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(20, 3.8))
    for ax, (name, label) in zip(
        axes,
        (("alpha", "alpha"), ("beta_f", "beta_F"), ("beta_b", "beta_B"), ("xfer", "B_xfer")),
        strict=False,
    ):
        sweep = sweeps[name]
        keys = sorted(sweep)
        ax.plot(keys, [_p99_ttft(sweep[k]) for k in keys], marker="o", label="P99 TTFT (s)")
        twin = ax.twinx()
        twin.plot(
            keys, [_p99_tbt(sweep[k]) * 1e3 for k in keys], marker="x", color="C1", label="P99 TBT (ms)"
        )
        ax.set(xlabel=label, ylabel="P99 TTFT (s)")
        twin.set_ylabel("P99 TBT (ms)")
        if name == "alpha":
            handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
            ax.legend(handles=handles, fontsize=7)
        ax.grid(True, alpha=0.3)
    names = list(TABLE1_LADDER)
    axes[4].bar(
        [TABLE1_NAMES[n] for n in names], [ladder[n]["e2e_ms"] for n in names], label="kvtier", alpha=0.7
    )
    axes[4].scatter(
        [TABLE1_NAMES[n] for n in names], [TABLE1_E2E_MS[n] for n in names], color="k", label="paper"
    )
    axes[4].set(yscale="log", ylabel="E2E ms (8 GB each way)", title="Table 1")
    axes[4].legend(fontsize=7)
    fig.suptitle(f"SuperInfer sweeps at {HIGH_RATE:g} RPS (Figs. 18-21) and the Table 1 ladder")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------


@reproduction(PAPER)
def reproduce(out_dir: Path, quick: bool) -> list[Row]:
    superinfer, vllm = _config("superinfer"), _config("vllm")
    wf, sf, no_dkv = _config("waiting_first"), _config("swapped_first"), _config("no_duplexkv")
    scale = xfer_scale(superinfer)
    xfer_scaled = round(PAPER_XFER_BLOCKS * scale)
    paper_label, scaled_label = "SuperInfer B_xfer 2400", f"SuperInfer B_xfer {xfer_scaled}"
    rates = QUICK_RATES if quick else RATES
    requests = 500 if quick else int(superinfer.workload["num_sessions"])
    high = QUICK_RATES[-1] if quick else HIGH_RATE

    series: dict[str, list[Result]] = {
        "vLLM": [_run(vllm, r, requests) for r in rates],
        paper_label: [_run(superinfer, r, requests) for r in rates],
        scaled_label: [_run(superinfer, r, requests, xfer_blocks=xfer_scaled) for r in rates],
    }
    if not quick:
        series["Waiting-First"] = [_run(wf, r, requests) for r in rates]
        series["Swapped-First"] = [_run(sf, r, requests) for r in rates]
    _plot_rates(out_dir / "superinfer_slo_vs_rate.png", series)

    at_high = {
        label: next(r for r in results if r["rate_per_s"] == high) for label, results in series.items()
    }
    base = {"xfer_blocks": xfer_scaled}
    alphas, beta_fs, beta_bs = (
        ((1.0, 6.0), (0.0, 2.0), (0.0, 10.0))
        if quick
        else ((1.0, 3.0, 6.0), (0.0, 1.0, 2.0), (-5.0, 0.0, 10.0))
    )
    xfers = (PAPER_XFER_L, PAPER_XFER_BLOCKS) if quick else (PAPER_XFER_L, 600, 1200, PAPER_XFER_BLOCKS)
    sweeps = {
        "alpha": {
            a: _run(superinfer, high, requests, **base, alpha=a, beta_f=0.0, beta_b=0.0) for a in alphas
        },
        "beta_f": {
            f: _run(superinfer, high, requests, **base, alpha=1.0, beta_f=f, beta_b=0.0) for f in beta_fs
        },
        "beta_b": {
            b: _run(superinfer, high, requests, **base, alpha=1.0, beta_f=0.0, beta_b=b) for b in beta_bs
        },
        "xfer": {
            float(round(x * scale)): _run(superinfer, high, requests, xfer_blocks=round(x * scale))
            for x in xfers
        },
    }
    ablation = {
        "vLLM": at_high["vLLM"],
        "w/o DuplexKV (L)": _run(no_dkv, high, requests, xfer_blocks=round(PAPER_XFER_L * scale)),
        "w/o DuplexKV (H)": _run(no_dkv, high, requests, xfer_blocks=xfer_scaled),
        "SuperInfer": at_high[scaled_label],
    }
    wf_sf = {
        "FCFS": at_high["vLLM"],
        "Waiting-First": _run(wf, high, requests),
        "Swapped-First": _run(sf, high, requests),
    }
    ladder_rows, ladder = _ladder_rows(superinfer)
    _plot_sweeps(out_dir / "superinfer_sweeps.png", sweeps, ladder)
    return [
        *_headline_rows(series, paper_label, quick),
        *_headline_rows(series, scaled_label, quick),
        *_ablation_rows(ablation, wf_sf, quick),
        *_sweep_rows(sweeps, quick),
        *ladder_rows,
    ]
