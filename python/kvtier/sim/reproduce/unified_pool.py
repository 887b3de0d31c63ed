"""Unified KV pooling (paper 003), §V-B Fig. 8/9 and §V-C Fig. 10 on LLaMA 3.1-8B.

``experiments/unified_pool/fig9_llama8b.yaml`` (and ``fig10_ablation.yaml``) on the §III-A server
(``experiments/unified_pool/server.yaml``): LMCache's long-doc QA benchmark at input lengths 1K-128K,
a warm-up round that writes every document's KV through to host and SSD, then the measured query
round. Each point is the query round's mean TTFT and blocked I/O per request, taken as the full
run minus the warm-up round alone (same config, ``query_round: false``; the warm-up runs identically
in both, as the query round starts when its last request has finished). Blocked I/O is the
engine's step-bound blocked I/O plus the time the GPU sat idle while asynchronous fetches ran
(§II-B1: "I/O for KV retrieval proceeds, with no overlapping GPU computation").

Rows: TTFT and blocked-I/O ratios of each baseline over unified pooling at 128K (§V-B), the
ablation's TTFT ratios at 128K (§V-C), and the §III-C check of the filesystem calibration.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvtier.sim.config import SimConfig
from kvtier.sim.hardware import load_hardware
from kvtier.sim.models import load_model
from kvtier.sim.pool import PoolSpec
from kvtier.sim.reproduce import PlaneProfile, Row, experiments_dir, reproduction
from kvtier.sim.run import SimResult, run
from kvtier.tiers import Tier

PAPER = "unified_pool"
SYSTEMS = ("lmcache", "lmcache_lp", "lmcache_lp_async", "unified_pool")
LABELS = {
    "lmcache": "LMCache",
    "lmcache_lp": "LMCache+LP",
    "lmcache_lp_async": "LMCache+LP+AsyncKV",
    "unified_pool": "Unified KV pooling",
    "unified_pool_orchestrator": "KV orchestrator only",
    "unified_pool_passthrough": "Passthrough only",
}
ABLATION = ("unified_pool_orchestrator", "unified_pool_passthrough")
# Each system as (policy, data-plane profile: the config's `pool` layout and SSD access path).
# Unified pooling schedules as LMCache+LP+AsyncKV; its design and ablations are the profile.
SERIAL_FS = PlaneProfile(layout="serial", passthrough=False)  # LMCache's path (§III-B)
PROFILES: dict[str, tuple[str, PlaneProfile]] = {
    "lmcache": ("lmcache", SERIAL_FS),
    "lmcache_lp": ("lmcache_lp", SERIAL_FS),
    "lmcache_lp_async": ("lmcache_lp_async", SERIAL_FS),
    "unified_pool": ("lmcache_lp_async", PlaneProfile(layout="pooled", passthrough=True)),
    "unified_pool_orchestrator": ("lmcache_lp_async", PlaneProfile(layout="pooled", passthrough=False)),
    "unified_pool_passthrough": ("lmcache_lp_async", PlaneProfile(layout="serial", passthrough=True)),
}
# Input lengths of Fig. 8/9 (1K-128K); 128K = 128,000 tokens fits Llama-3.1-8B's 131,072 context.
LENGTHS = (1_000, 2_000, 4_000, 8_000, 16_000, 32_000, 64_000, 128_000)
HEADLINE = 128_000
# §V-B1 / §V-B2 (LLaMA 3.1-8B, 128K): baseline over unified pooling.
PAPER_TTFT = {"lmcache": 2.9, "lmcache_lp": 2.6, "lmcache_lp_async": 2.1}
PAPER_BLOCKED = {"lmcache": 7.8, "lmcache_lp": 2.7, "lmcache_lp_async": 1.7}
# §V-C: the full design over each half, at 128K.
PAPER_ABLATION = {"unified_pool_orchestrator": 1.8, "unified_pool_passthrough": 2.3}
# §III-C: "reading offloaded KV caches from SSD takes ~11x longer than reading them from host-memory".
PAPER_SSD_OVER_HOST = 11.0


@dataclass(frozen=True)
class Point:
    """The query round of one system at one input length."""

    ttft_s: float  # mean TTFT of the query round
    blocked_io_s: float  # blocked I/O per query-round request
    hit_fraction: float  # prompt tokens of the query round served from host/SSD


def query_round(config: SimConfig, system: str, document_tokens: int) -> Point:
    """Runs warm-up + query and warm-up alone of ``system`` (a key of :data:`PROFILES`); the
    difference is the query round."""
    policy, profile = PROFILES[system]
    pool = {**(config.pool or {}), **profile}
    results: dict[bool, SimResult] = {}
    for with_query in (True, False):
        workload = {**config.workload, "document_tokens": document_tokens, "query_round": with_query}
        changes = {"policy": {"name": policy}, "pool": pool, "workload": workload}
        results[with_query] = run(config.with_overrides(**changes))
    full, warm = results[True], results[False]
    n = full["requests"] - warm["requests"]
    if n <= 0 or full["unfinished_requests"]:
        raise RuntimeError(f"{system} at {document_tokens} tokens: query round did not complete")

    def ttft_total(r: SimResult) -> float:
        return float(r["ttft_s"]["mean"]) * int(r["requests"])

    ttft = (ttft_total(full) - ttft_total(warm)) / n
    stalls = (full["blocked_io_s"] - warm["blocked_io_s"], full["fetch_stall_s"] - warm["fetch_stall_s"])
    blocked = sum(stalls) / n
    lower = sum(full["hit_rate_tokens"][t.label] for t in (Tier.HOST, Tier.SSD)) * full["prompt_tokens"]
    return Point(ttft, blocked, lower / (n * document_tokens))


def load_config(name: str) -> SimConfig:
    """An experiment config with its hardware path made absolute (runs from any directory)."""
    directory = experiments_dir() / PAPER
    config = SimConfig.from_yaml(directory / name)
    return config.with_overrides(hardware=str(directory / Path(config.hardware).name))


def ssd_over_host_read(config: SimConfig) -> float:
    """§III-C check: one 256-token chunk of the profiled model (Qwen3-30B-A3B) read from one SSD
    through the filesystem (device time + the per-object cost, staged through the memory module)
    over the same chunk read from host memory (one module), on the configured server."""
    hw = load_hardware(config.hardware)
    spec = PoolSpec.from_mapping(config.pool or {})
    chunk = config.block_tokens * load_model("qwen3-30b-a3b").kv_bytes_per_token_per_gpu(1)
    module_s = chunk / (hw.dram_bytes_per_s / spec.dram_modules)
    ssd_s = chunk / hw.ssd_read_bytes_per_s + spec.filesystem_object_overhead_s
    return max(ssd_s, module_s) / module_s


@reproduction(PAPER)
def reproduce(out_dir: Path, quick: bool) -> list[Row]:
    fig9 = load_config("fig9_llama8b.yaml")
    fig10 = load_config("fig10_ablation.yaml")
    lengths = (HEADLINE,) if quick else LENGTHS
    points: dict[str, dict[int, Point]] = {}
    for policy in SYSTEMS:
        points[policy] = {length: query_round(fig9, policy, length) for length in lengths}
    for policy in ABLATION:
        points[policy] = {length: query_round(fig10, policy, length) for length in lengths}
    _plot(points, lengths, out_dir)
    return _rows(points, fig9)


def _rows(points: dict[str, dict[int, Point]], config: SimConfig) -> list[Row]:
    pool = points["unified_pool"][HEADLINE]
    base = {p: points[p][HEADLINE] for p in SYSTEMS}
    hits = min(pt.hit_fraction for by_len in points.values() for pt in by_len.values())
    common = (
        f"kvtier at 128K: unified pool TTFT {pool.ttft_s:.2f} s, blocked I/O {pool.blocked_io_s:.2f} s/request "
        f"(paper 5.6 s, 0.6 s); every query served from host/SSD (>= {hits:.1%} of its prompt)."
    )
    gap_ttft = (
        " TTFT here is queueing behind the other in-flight request + the KV load + one computed token, "
        "so kvtier's TTFT ratios follow its blocked-I/O ratios. The paper's TTFTs hold time that is not "
        "blocked I/O (unified pool 5.6 s vs 0.6 s; LMCache 16.2 s vs 4.7 s) which it does not break down; "
        "it divides the paper's ratios down and kvtier has no counterpart to it: the benchmark's queries "
        "repeat their warm-up prompts (no query tokens to compute), and what the paper's queries compute "
        "instead is not given (docs/papers/unified_pool.md, 'What the paper's TTFT holds')."
    )
    gap_lp = (
        " Layerwise pipelining hides a load only behind the step's compute; a query whose whole document "
        "hits computes one token (a ~11 ms weight-bound step on H100 PCIe), so at 128K LP hides ~nothing "
        "in kvtier, while the paper's LP cuts LMCache's blocked I/O 4.7 -> 1.6 s, which needs >= 3 s of "
        "prefill compute per query that the paper's setup does not explain."
    )
    gap_async = (
        " With 2 requests in flight (the benchmark's default), equal requests move in lockstep (both "
        "fetch, then both decode), leaving async loading little queueing to hide a fetch behind."
    )
    rows: list[Row] = []
    for policy in ("lmcache", "lmcache_lp", "lmcache_lp_async"):
        note = common + gap_ttft + (gap_lp if policy != "lmcache" else "")
        note += gap_async if policy == "lmcache_lp_async" else ""
        rows.append(
            Row(
                PAPER,
                f"TTFT {LABELS[policy]} / unified pool, Llama-3.1-8B, 128K (Fig. 8(a))",
                PAPER_TTFT[policy],
                base[policy].ttft_s / pool.ttft_s,
                note=_note_if_off(PAPER_TTFT[policy], base[policy].ttft_s / pool.ttft_s, note),
            )
        )
    for policy in ("lmcache", "lmcache_lp", "lmcache_lp_async"):
        ratio = base[policy].blocked_io_s / pool.blocked_io_s
        note = (
            common
            + (gap_lp if policy != "lmcache" else "")
            + (gap_async if policy == "lmcache_lp_async" else "")
        )
        rows.append(
            Row(
                PAPER,
                f"blocked I/O {LABELS[policy]} / unified pool, Llama-3.1-8B, 128K (Fig. 9(a))",
                PAPER_BLOCKED[policy],
                ratio,
                note=_note_if_off(PAPER_BLOCKED[policy], ratio, note),
            )
        )
    for policy in ABLATION:
        ratio = points[policy][HEADLINE].ttft_s / pool.ttft_s
        note = (
            "Orchestrator only: the pool spreads each load over 2 modules + 2 SSDs, but every SSD part "
            "still pays 4.19 ms per 256-token object of bytes in the filesystem."
            if policy == "unified_pool_orchestrator"
            else "Passthrough only: LMCache's serial path without the filesystem; one SSD (31.5 GB/s) "
            "staged through one memory module (10.65 GB/s): the module bounds the load (16.8 GB in 1.6 s)."
        )
        note += gap_ttft
        rows.append(
            Row(
                PAPER,
                f"ablation TTFT {LABELS[policy]} / full design, 128K (Fig. 10)",
                PAPER_ABLATION[policy],
                ratio,
                note=_note_if_off(PAPER_ABLATION[policy], ratio, note),
            )
        )
    ratio = ssd_over_host_read(config)
    rows.append(
        Row(
            PAPER,
            "SSD / host-memory read time of a KV chunk through LMCache's path (§III-C, Fig. 7)",
            PAPER_SSD_OVER_HOST,
            ratio,
            note=(
                "Calibration check. The filesystem cost per object (4.19 ms) comes from §III-C's 84% with "
                "the device part at the paper's peak 31.5 GB/s per SSD; the paper's 11x as well would need "
                "the SSD's device time at 1.76x a module's (an SSD at ~6 GB/s), i.e. measured rates far below "
                "the peaks §III-A quotes. kvtier keeps the cited peaks, so its LMCache SSD path is ~5x faster "
                "relative to host memory than the paper's."
            ),
        )
    )
    return rows


def _note_if_off(paper: float, kvtier: float, note: str) -> str:
    within = abs(kvtier - paper) <= 0.3 * paper
    return ("Within 30%. " if within else "Not within 30%. ") + note


def _plot(points: dict[str, dict[int, Point]], lengths: tuple[int, ...], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [length // 1000 for length in lengths]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for policy in SYSTEMS:
        series = points[policy]
        axes[0].plot(xs, [series[n].ttft_s for n in lengths], marker="o", label=LABELS[policy])
        axes[1].plot(xs, [series[n].blocked_io_s for n in lengths], marker="o", label=LABELS[policy])
    for policy in (*ABLATION, "unified_pool"):
        series = points[policy]
        axes[2].plot(xs, [series[n].ttft_s for n in lengths], marker="o", label=LABELS[policy])
    titles = (
        "TTFT (Fig. 8(a), LLaMA 3.1-8B)",
        "Blocked I/O per request (Fig. 9(a))",
        "Ablation TTFT (Fig. 10)",
    )
    for ax, title, ylabel in zip(axes, titles, ("TTFT (s)", "blocked I/O (s)", "TTFT (s)"), strict=True):
        ax.set(xlabel="input length (K tokens)", ylabel=ylabel, title=title)
        if len(xs) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x}K" for x in xs])
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "unified_pool_fig9_fig10.png", dpi=120)
    plt.close(fig)
