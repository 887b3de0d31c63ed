"""Plots of simulation results (matplotlib, Agg backend: files, no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvtier.sim.run import RateRun


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def latency_vs_rate(series: Mapping[str, Sequence[RateRun]], path: Path) -> Path:
    """TTFT (p50, p99) and TPOT (p50) against request rate, one line per series (policy)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for label, results in series.items():
        rates = [r["rate_per_s"] for r in results]
        axes[0].plot(rates, [r["ttft_s"]["p50"] for r in results], marker="o", label=f"{label} p50")
        axes[0].plot(
            rates, [r["ttft_s"]["p99"] for r in results], marker="x", linestyle="--", label=f"{label} p99"
        )
        axes[1].plot(rates, [r["tpot_s"]["p50"] * 1e3 for r in results], marker="o", label=label)
    axes[0].set(xlabel="request rate (req/s)", ylabel="TTFT (s)", title="TTFT vs rate", yscale="log")
    axes[1].set(xlabel="request rate (req/s)", ylabel="TPOT p50 (ms)", title="TPOT vs rate")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def throughput_vs_ttft(series: Mapping[str, Sequence[RateRun]], path: Path) -> Path:
    """Throughput (total tokens/s) against mean TTFT: the Strata-style trade-off curve."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 4))
    for label, results in series.items():
        ax.plot(
            [r["ttft_s"]["mean"] for r in results],
            [r["throughput_total_tokens_per_s"] for r in results],
            marker="o",
            label=label,
        )
    ax.set(xlabel="mean TTFT (s)", ylabel="throughput (tokens/s)", title="throughput vs TTFT", xscale="log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
