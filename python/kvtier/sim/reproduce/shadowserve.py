"""ShadowServe's headline experiment (§6.2, Figs. 9-11, 14): Llama-8B on one L40S, NarrativeQA-like
documents fetched from a remote KV store over 10-40 Gbps, 4-128 output tokens; ShadowServe
(``shadowserve_async``) against CacheGen-Async (``cachegen_async``), vLLM (``fcfs``, recompute) in
the load-latency plot, and the "No AF" ablation (``shadowserve_async`` with ``fetch_mode: sync``).

Metrics as in §6.1-§6.2: *unloaded TTFT* is the mean TTFT at a rate where requests rarely overlap;
*loaded TPOT* and *maximum throughput* come from an overloaded run (all requests arrive within a
couple of seconds; the TPOT curves of Fig. 9 are flat once the system is saturated). Every request
fetches its whole prompt from the store (``preload_tier: remote``, §6.1 methodology).

The base config is ``experiments/shadowserve/narrativeqa_l40s.yaml``; the hardware is
``experiments/shadowserve/l40s-bf3.yaml`` with the storage NIC set to each bandwidth (copies are
written next to the plots). Each system is a policy and a fetch path (:data:`FETCH`): ShadowServe on
the BlueField-3 pipeline, CacheGen-Async decoding on the GPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from kvtier.sim.config import SimConfig
from kvtier.sim.reproduce import Row, experiments_dir, reproduction
from kvtier.sim.run import SimResult, run

PAPER = "shadowserve"
SS = "shadowserve_async"
CG = "cachegen_async"
VLLM = "fcfs"
BANDWIDTHS_GBPS = (10, 20, 30, 40)
OUTPUTS = (4, 8, 16, 32, 64, 128)
# Each system's fetch path (data-plane config, kvtier.sched.fetch_path): a system is (policy, data
# plane). The two control planes are the same batch interception (§6.1); vLLM fetches nothing.
FETCH = {SS: "bluefield3", CG: "cachegen_gpu", VLLM: "plain"}
OVERLOAD_RATE_PER_S = 100.0  # far above any configuration's capacity: a burst
UNLOADED_RATE_PER_S = 0.05  # a request lives ~1 s: arrivals 20 s apart rarely overlap

Result = SimResult


def _base() -> SimConfig:
    return SimConfig.from_yaml(experiments_dir() / PAPER / "narrativeqa_l40s.yaml")


def _hardware(out_dir: Path, gbps: int) -> str:
    """The testbed profile with the storage NIC rate-limited to ``gbps`` (§6.1's QoS limit)."""
    data = yaml.safe_load((experiments_dir() / PAPER / "l40s-bf3.yaml").read_text())
    data["name"] = f"L40S-BF3-{gbps}Gbps"
    data["storage_nic_bytes_per_s"] = gbps * 1e9 / 8
    data["sources"]["storage_nic_bytes_per_s"] = (
        f"ShadowServe §6.1-§6.2: the link to the KV store rate limited to {gbps} Gbps"
    )
    path = out_dir / f"l40s-bf3-{gbps}gbps.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def _run(
    base: SimConfig, hardware: str, policy: Mapping[str, Any], rate: float, requests: int, output: int
) -> Result:
    workload = {
        **base.workload,
        "rate_per_s": rate,
        "num_requests": requests,
        "output_tokens_min": output,
        "output_tokens_max": output,
    }
    fetch = {"engine": FETCH[str(policy["name"])]}
    return run(base.with_overrides(hardware=hardware, policy=dict(policy), workload=workload, fetch=fetch))


@reproduction(PAPER)
def reproduce(out_dir: Path, quick: bool) -> list[Row]:
    base = _base()
    outputs = (4, 16, 32) if quick else OUTPUTS
    burst = 24 if quick else 200  # the paper samples 200 requests per experiment (§6.1)
    unloaded_n = 4 if quick else 20
    hardware = {bw: _hardware(out_dir, bw) for bw in BANDWIDTHS_GBPS}
    loaded: dict[tuple[str, int, int], Result] = {}
    unloaded: dict[tuple[str, int], Result] = {}
    no_af: dict[int, Result] = {}
    for bw in BANDWIDTHS_GBPS:
        for name in (SS, CG):
            unloaded[name, bw] = _run(base, hardware[bw], {"name": name}, UNLOADED_RATE_PER_S, unloaded_n, 32)
            for out in outputs:
                loaded[name, bw, out] = _run(
                    base, hardware[bw], {"name": name}, OVERLOAD_RATE_PER_S, burst, out
                )
        sync = {"name": SS, "fetch_mode": "sync"}
        no_af[bw] = _run(base, hardware[bw], sync, OVERLOAD_RATE_PER_S, burst, 32)
    curves = {} if quick else _load_latency(base, hardware[20])
    _plot(out_dir, loaded, unloaded, outputs, curves)
    return _rows(loaded, unloaded, no_af, outputs)


def _load_latency(base: SimConfig, hardware: str) -> dict[str, list[Result]]:
    """Fig. 9: mean TTFT and TPOT against throughput at 20 Gbps, 32 output tokens."""
    rates = {
        SS: (1.0, 2.0, 4.0, 5.0, 6.0, 7.0, 8.0),
        CG: (1.0, 2.0, 4.0, 5.0, 6.0, 7.0),
        VLLM: (0.2, 0.4, 0.6, 0.8),
    }
    labels = {SS: "ShadowServe", CG: "CacheGen-Async", VLLM: "vLLM"}
    return {
        labels[name]: [_run(base, hardware, {"name": name}, r, 200, 32) for r in rs]
        for name, rs in rates.items()
    }


# ----------------------------------------------------------------------------------------------
# Ratios and rows


def _tpot(r: Result) -> float:
    return float(r["tpot_s"]["mean"])


def _ttft(r: Result) -> float:
    return float(r["ttft_s"]["mean"])


def _throughput(r: Result) -> float:
    return float(r["throughput_requests_per_s"])


def tpot_ratio(loaded: Mapping[tuple[str, int, int], Result], bw: int, out: int) -> float:
    """Loaded TPOT, CacheGen-Async over ShadowServe (>1: ShadowServe lower)."""
    return _tpot(loaded[CG, bw, out]) / _tpot(loaded[SS, bw, out])


def throughput_ratio(loaded: Mapping[tuple[str, int, int], Result], bw: int, out: int) -> float:
    """Maximum throughput, ShadowServe over CacheGen-Async."""
    return _throughput(loaded[SS, bw, out]) / _throughput(loaded[CG, bw, out])


def ttft_ratio(unloaded: Mapping[tuple[str, int], Result], bw: int) -> float:
    """Unloaded TTFT, CacheGen-Async over ShadowServe."""
    return _ttft(unloaded[CG, bw]) / _ttft(unloaded[SS, bw])


def _at(ratios: Mapping[tuple[int, int], float], pick: Any) -> str:
    bw, out = pick(ratios, key=ratios.__getitem__)
    return f"{bw} Gbps / {out} tokens"


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _span(values: Sequence[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def _rows(
    loaded: Mapping[tuple[str, int, int], Result],
    unloaded: Mapping[tuple[str, int], Result],
    no_af: Mapping[int, Result],
    outputs: Sequence[int],
) -> list[Row]:
    grid = [(bw, out) for bw in BANDWIDTHS_GBPS for out in outputs]
    tpot = {k: tpot_ratio(loaded, *k) for k in grid}
    thr = {k: throughput_ratio(loaded, *k) for k in grid}
    ttft = {bw: ttft_ratio(unloaded, bw) for bw in BANDWIDTHS_GBPS}
    short = [o for o in outputs if o <= 8]
    long_ = [o for o in outputs if o >= 16]
    thr_low = [thr[bw, o] for bw in (10, 20) for o in short]
    thr_high = [thr[bw, o] for bw in (30, 40) for o in short]
    thr_long = [thr[bw, o] for bw in BANDWIDTHS_GBPS for o in long_]
    tpot_128 = [tpot[bw, 128] for bw in BANDWIDTHS_GBPS if 128 in outputs]
    no_af_ratio = {
        bw: _tpot(no_af[bw]) / _tpot(loaded[SS, bw, 32]) for bw in BANDWIDTHS_GBPS if (SS, bw, 32) in loaded
    }
    interference_note = (
        "CacheGen's GPU decoding slows model compute by §2.2's 30% floor x the decoder's duty cycle "
        "(more decoding per second at higher bandwidth, §6.2.2); part of the gap is load: CacheGen "
        "finishes more fetches per second at 30-40 Gbps, so its decode batches are larger"
    )
    rows = [
        Row(
            PAPER,
            "loaded TPOT, CacheGen-Async / ShadowServe, max over 10-40 Gbps x outputs",
            2.19,
            max(tpot.values()),
            note=f"kvtier range {_span(list(tpot.values()))}, max at {_at(tpot, max)} (paper 1.06-2.19, "
            f"max at 4 tokens). {interference_note}. §2.2 gives 30% only as a lower bound and Fig. 3's "
            "CUDA-stream points are not in the text",
        ),
        Row(
            PAPER,
            "loaded TPOT, CacheGen-Async / ShadowServe, min over 10-40 Gbps x outputs",
            1.06,
            min(tpot.values()),
            note=f"min at {_at(tpot, min)}; with long outputs GPU memory, not fetching, is the "
            "bottleneck and fetches stall, so CacheGen's decoding rarely overlaps decode steps (§6.2.2)",
        ),
    ]
    if 16 in outputs:
        rows += [
            Row(
                PAPER,
                "loaded TPOT ratio at 16 output tokens, 10 Gbps (Fig. 11a: 36.5/32.1 ms)",
                36.5 / 32.1,
                tpot[10, 16],
                note=f"kvtier {_tpot(loaded[SS, 10, 16]) * 1e3:.1f} vs "
                f"{_tpot(loaded[CG, 10, 16]) * 1e3:.1f} ms; CacheGen's ~32 Gbps decoder is busy 10/32 of a "
                "10 Gbps fetch",
            ),
            Row(
                PAPER,
                "loaded TPOT ratio at 16 output tokens, 40 Gbps (Fig. 11a: 61.8/38.5 ms)",
                61.8 / 38.5,
                tpot[40, 16],
                note=f"kvtier {_tpot(loaded[SS, 40, 16]) * 1e3:.1f} vs "
                f"{_tpot(loaded[CG, 40, 16]) * 1e3:.1f} ms",
            ),
        ]
    if 128 in outputs:
        rows.append(
            Row(
                PAPER,
                "loaded TPOT ratio at 128 output tokens, mean over 10-40 Gbps",
                None,
                _mean(tpot_128),
                paper_range=(1.06, 1.09),
                note=f"kvtier range {_span(tpot_128)}",
            )
        )
    rows += [
        Row(
            PAPER,
            "unloaded TTFT, CacheGen-Async / ShadowServe, 10 Gbps",
            1.38,
            ttft[10],
            note="both network bound, so the ratio is the bitstream-size ratio diluted by the fixed "
            "last-token step; the paper's 1.38 at 10 Gbps vs 1.20 at 20 Gbps implies fixed costs "
            "we do not model (its ~500 ms TTFT is ~3x what 14K tokens x 24 KiB at 20 Gbps take)",
        ),
        Row(
            PAPER,
            "unloaded TTFT, CacheGen-Async / ShadowServe, 20 Gbps (§6.2.1: 600.5/502.2 ms)",
            600.5 / 502.2,
            ttft[20],
            note="calibrated, not predicted: CacheGen's compression ratio is "
            "derived from these two TTFTs (the paper gives no ratio for it)",
        ),
        Row(
            PAPER,
            "unloaded TTFT, CacheGen-Async / ShadowServe, 30 Gbps (ShadowServe 11% higher)",
            1 / 1.11,
            ttft[30],
            note="ShadowServe's SmartNIC network stage tops out at 20.6 Gbps (§6.3)",
        ),
        Row(
            PAPER,
            "unloaded TTFT, CacheGen-Async / ShadowServe, 40 Gbps (ShadowServe 24% higher)",
            1 / 1.24,
            ttft[40],
            note="CacheGen-Async is held by its ~32 Gbps GPU decoder (§6.2.2)",
        ),
    ]
    if thr_low:
        rows += [
            Row(
                PAPER,
                "max throughput, ShadowServe / CacheGen-Async, <=20 Gbps, 4-8 output tokens, mean",
                None,
                _mean(thr_low),
                paper_range=(1.16, 1.35),
                note=f"kvtier range {_span(thr_low)}: fetch bound, so the ratio is the fetch-time ratio",
            ),
            Row(
                PAPER,
                "max throughput, ShadowServe / CacheGen-Async, 30-40 Gbps, 4-8 output tokens",
                None,
                _mean(thr_high),
                paper_range=(0.83, 0.91),
                note=f"kvtier range {_span(thr_high)}",
            ),
        ]
    rows += [
        Row(
            PAPER,
            "max throughput, ShadowServe / CacheGen-Async, >=16 output tokens, mean",
            None,
            _mean(thr_long),
            paper_range=(1.01, 1.34),
            note=f"kvtier range {_span(thr_long)}, min at {_at({k: thr[k] for k in thr if k[1] >= 16}, min)}: "
            "at 30-40 Gbps kvtier stays fetch bound (ShadowServe's 20.6 Gbps SmartNIC ceiling) up to 16 "
            "tokens, where the paper is already TPOT bound; its ~0.5 s fetches imply more KV per request "
            "than 14K tokens (docs/papers/shadowserve.md)",
        ),
    ]
    if 32 in outputs:
        rows += [
            Row(
                PAPER,
                "Fig. 9 (20 Gbps, 32 tokens): loaded TPOT, CacheGen-Async / ShadowServe (52.0/41.8 ms)",
                52.0 / 41.8,
                tpot[20, 32],
            ),
            Row(
                PAPER,
                "Fig. 9 (20 Gbps, 32 tokens): max throughput, ShadowServe / CacheGen-Async (1.78/1.51)",
                1.78 / 1.51,
                thr[20, 32],
            ),
        ]
    if no_af_ratio:
        rows += [
            Row(
                PAPER,
                "No AF ablation (Fig. 14, 32 tokens): loaded TPOT, synchronous / async fetch, 10 Gbps",
                2.03,
                no_af_ratio[10],
                note="the paper gives 1.39-2.03x, larger at lower bandwidth (2.03 at 10 Gbps is our "
                "reading). In kvtier a blocking fetch holds every decode of its (mixed) batch for the fetch "
                "of every prompt admitted with it; how the paper's No AF interleaves blocked prefill "
                "batches with decode batches is not described",
            ),
            Row(
                PAPER,
                "No AF ablation (Fig. 14, 32 tokens): loaded TPOT, synchronous / async fetch, 40 Gbps",
                1.39,
                no_af_ratio[40],
            ),
        ]
    return [_flag(r) for r in rows]


def _flag(row: Row) -> Row:
    """Adds to a row's note when kvtier is outside ±30% of the paper (the reasons are in the note)."""
    if row.within_30_percent is False and "outside" not in row.note:
        note = f"outside ±30%: {row.note}" if row.note else "outside ±30%"
        return Row(row.paper, row.metric, row.paper_ratio, row.kvtier_ratio, row.paper_range, note)
    return row


# ----------------------------------------------------------------------------------------------
# Plots in the style of Figs. 9-11


def _plot(
    out_dir: Path,
    loaded: Mapping[tuple[str, int, int], Result],
    unloaded: Mapping[tuple[str, int], Result],
    outputs: Sequence[int],
    curves: Mapping[str, Sequence[Result]],
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bws = BANDWIDTHS_GBPS
    # Fig. 10: ShadowServe's gain over CacheGen-Async per bandwidth (rows) and output length (columns).
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), layout="constrained")
    panels = [
        (
            "(a) max throughput, SS / CA",
            [[throughput_ratio(loaded, b, o) for o in outputs] for b in bws],
            outputs,
        ),
        ("(b) loaded TPOT, CA / SS", [[tpot_ratio(loaded, b, o) for o in outputs] for b in bws], outputs),
        ("(c) unloaded TTFT, CA / SS", [[ttft_ratio(unloaded, b)] for b in bws], ("any",)),
    ]
    for ax, (title, values, cols) in zip(axes, panels, strict=True):
        image = ax.imshow(values, cmap="RdYlGn", vmin=0.5, vmax=1.5, aspect="auto", origin="lower")
        for i, row in enumerate(values):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(cols)), [str(c) for c in cols])
        ax.set_yticks(range(len(bws)), [str(b) for b in bws])
        ax.set(xlabel="output length (tokens)", ylabel="bandwidth (Gbps)", title=title)
    fig.colorbar(image, ax=axes, shrink=0.8, label="ShadowServe's gain (x)")
    fig.savefig(out_dir / "fig10_gain_over_cachegen_async.png", dpi=120)
    plt.close(fig)

    # Fig. 11: absolute loaded TPOT (16 output tokens, or the nearest run) and unloaded TTFT.
    out = 16 if 16 in outputs else outputs[0]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for name, label, marker in ((SS, "ShadowServe", "o"), (CG, "CacheGen-Async", "s")):
        axes[0].plot(bws, [_tpot(loaded[name, b, out]) * 1e3 for b in bws], marker=marker, label=label)
        axes[1].plot(bws, [_ttft(unloaded[name, b]) * 1e3 for b in bws], marker=marker, label=label)
    axes[0].set(
        xlabel="bandwidth (Gbps)", ylabel="loaded TPOT (ms)", title=f"(a) loaded TPOT, {out} output tokens"
    )
    axes[1].set(xlabel="bandwidth (Gbps)", ylabel="unloaded TTFT (ms)", title="(b) unloaded TTFT")
    for ax in axes:
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "fig11_absolute.png", dpi=120)
    plt.close(fig)

    if curves:  # Fig. 9: load-latency curves at 20 Gbps, 32 output tokens
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
        for label, results in curves.items():
            thr = [_throughput(r) for r in results]
            axes[0].plot(thr, [_ttft(r) for r in results], marker="o", label=label)
            axes[1].plot(thr, [_tpot(r) * 1e3 for r in results], marker="o", label=label)
        axes[0].set(xlabel="throughput (req/s)", ylabel="mean TTFT (s)", yscale="log", title="(a) TTFT")
        axes[1].set(xlabel="throughput (req/s)", ylabel="mean TPOT (ms)", title="(b) TPOT")
        for ax in axes:
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "fig9_load_latency_20gbps.png", dpi=120)
        plt.close(fig)
