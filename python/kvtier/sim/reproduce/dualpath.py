"""DualPath's headline experiments (§7.3-§7.5): DS 660B (DeepSeek-V3.2) on 2P4D Hopper nodes.

* **Offline** (§7.3, Fig. 7; §7.5, Fig. 12): an agentic RL-rollout batch of ``AGENTS`` agents with
  Table 2's 64K-MAL trajectories, all starting at once; the metric is the job completion time (JCT:
  the last agent's last turn). Systems in the ablation's order, each adding one part:
  Basic → +Layerwise (layerwise prefill) → +Dual-Path (both read paths, engines and read sides in
  turn) → DualPath (the §6 scheduler), and Oracle (no KV I/O at all, the bound).
* **Online** (§7.4, Fig. 10): agents arrive as a Poisson process (APS, agents per second) and
  replay their trajectory. Past capacity a closed-loop agent system does not blow up at once: each
  surplus agent adds one queued request, so TTFT creeps up by seconds per minute and a short run
  still looks healthy. So each run's TTFT is read the way §7.4 decides steady state, by sliding
  150 s windows: the last full window's mean TTFT, *projected* 30 minutes ahead with its trend
  against the window 300 s earlier (no credit for a falling trend). A rate meets the SLO when the
  projection is <= 4 s. Each system is swept over one geometric APS grid (x1.5) up to its first
  miss, then once more at the midpoint of the last pass and the first miss; its capacity is where
  the projection crosses 4 s (linear within the narrowed bracket). The ratio is DualPath's over
  Basic's.
* **Load balance** (§7.5, Fig. 13): max/mean read bytes over the six storage NICs, +Dual-Path's
  round-robin read sides against the §6 scheduler (over the whole run; the paper uses short windows
  in the job's first 5%).

* **DS 27B online** (§7.4, Fig. 10's other model): the same sweep for the 27B downscaled model
  (App. A.2, profile ``ds-27b``) on 1P1D, its default deployment (§7.2). Full runs only.

Configs: ``experiments/dualpath/offline_ds660b_2p4d.yaml``, ``online_ds660b_2p4d.yaml`` and
``online_ds27b_1p1d.yaml``. ``quick`` runs 96 agents offline (Basic, DualPath, Oracle) and two APS
points per system on a 300 s horizon, DS 660B only.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvtier.sim.config import SimConfig
from kvtier.sim.reproduce import PolicySpec, Row, experiments_dir, reproduction
from kvtier.sim.run import RateRun, SimResult, run

PAPER = "dualpath"
OFFLINE = "offline_ds660b_2p4d.yaml"
ONLINE = "online_ds660b_2p4d.yaml"
ONLINE_DS27B = "online_ds27b_1p1d.yaml"
# Each system as (policy, data plane): the ablation steps are config differences. +Layerwise is
# Basic on layerwise prefill (`io`), +Dual-Path adds the DE read path, DualPath the §6.1 scheduler;
# the Oracle is DualPath with every KV transfer bypassed.
POLICIES: dict[str, PolicySpec] = {
    "basic": {"name": "dualpath_basic"},
    "layerwise": {"name": "dualpath_basic"},
    "dual_path": {"name": "dualpath_basic", "read_paths": "dual"},
    "dualpath": {"name": "dualpath"},
    "oracle": {"name": "dualpath"},
}
IO: dict[str, dict[str, bool] | None] = {
    "basic": None,  # dualpath_basic's paper's: io: {engine: blocking}
    "layerwise": {"layerwise": True},
    "dual_path": {"layerwise": True},
    "dualpath": None,
    "oracle": {"bypass": True},
}
LABELS = {
    "basic": "Basic",
    "layerwise": "+Layerwise",
    "dual_path": "+Dual-Path",
    "dualpath": "DualPath",
    "oracle": "Oracle",
}
ABLATION = ("basic", "layerwise", "dual_path", "dualpath")  # Fig. 12, left to right
AGENTS = 1024  # Fig. 12's smaller batch (§7.5: 1024 and 2048 agents)
QUICK_AGENTS = 96
APS_GRID = (0.45, 0.675, 1.0125, 1.51875, 2.278125)  # x1.5 steps, the same for every system
QUICK_APS_GRID = (0.6, 1.2)
QUICK_HORIZON_S = 300.0
TTFT_SLO_S = 4.0  # §7.4
WINDOW_S = 150.0  # §7.4: "TTFT variation within a 150-second sliding window"
PROJECT_S = 1800.0  # §7.4: "... compared to that 30 minutes prior"

Result = SimResult


class OnlineRun(RateRun):
    """One online run: its results, and its TTFT in the last full window and projected ahead."""

    ttft_last_window_s: float
    ttft_projected_s: float


def _config(name: str) -> SimConfig:
    return SimConfig.from_yaml(experiments_dir() / PAPER / name)


def offline(quick: bool) -> dict[str, Result]:
    base = _config(OFFLINE)
    agents = QUICK_AGENTS if quick else AGENTS
    systems = ("basic", "dualpath", "oracle") if quick else (*ABLATION, "oracle")
    workload = {**base.workload, "num_trajectories": agents}
    return {s: run(base.with_overrides(policy=POLICIES[s], io=IO[s], workload=workload)) for s in systems}


def online(quick: bool, config: str = ONLINE) -> dict[str, list[OnlineRun]]:
    """Basic and DualPath over the APS grid, each up to the first rate that misses the SLO."""
    base = _config(config)
    if quick:
        base = base.with_overrides(max_sim_s=QUICK_HORIZON_S)
    horizon = float(base.max_sim_s or 0.0)
    out: dict[str, list[OnlineRun]] = {}
    for system in ("basic", "dualpath"):

        def at(aps: float, system: str = system) -> OnlineRun:
            workload = {**base.workload, "rate_per_s": aps}
            result = run(base.with_overrides(policy=POLICIES[system], io=IO[system], workload=workload))
            last, projected = projected_ttft_s(result, horizon)
            return {**result, "rate_per_s": aps, "ttft_last_window_s": last, "ttft_projected_s": projected}

        results: list[OnlineRun] = []
        for aps in QUICK_APS_GRID if quick else APS_GRID:
            results.append(at(aps))
            if results[-1]["ttft_projected_s"] > TTFT_SLO_S:
                break
        if not quick and len(results) >= 2 and results[-1]["ttft_projected_s"] > TTFT_SLO_S:
            mid = (results[-2]["rate_per_s"] + results[-1]["rate_per_s"]) / 2
            results.insert(-1, at(mid))  # capacity_aps interpolates up to the first miss in order
        out[system] = results
    return out


def projected_ttft_s(result: Result, horizon_s: float) -> tuple[float, float]:
    """(last full window's mean TTFT, that mean projected PROJECT_S ahead on its rising trend)."""
    full = [w for w in result["ttft_windows"] if w[0] + WINDOW_S <= horizon_s + 1e-9]
    if not full:
        return float("inf"), float("inf")
    last = full[-1]
    earlier = full[-3] if len(full) >= 3 else full[0]
    slope = (last[1] - earlier[1]) / (last[0] - earlier[0]) if last[0] > earlier[0] else 0.0
    return float(last[1]), float(last[1] + max(0.0, slope) * PROJECT_S)


def capacity_aps(results: Sequence[OnlineRun], slo_s: float = TTFT_SLO_S) -> float:
    """The APS where the projected TTFT crosses ``slo_s`` (linear between grid points); the last
    rate if it never does, 0 if the first already misses."""
    best = 0.0
    for i, r in enumerate(results):
        ttft, aps = float(r["ttft_projected_s"]), float(r["rate_per_s"])
        if ttft <= slo_s:
            best = aps
            continue
        if i > 0:
            prev = results[i - 1]
            t0, a0 = float(prev["ttft_projected_s"]), float(prev["rate_per_s"])
            best = a0 + (aps - a0) * (slo_s - t0) / (ttft - t0)
        break
    return best


@reproduction(PAPER)
def reproduce(out_dir: Path, quick: bool) -> list[Row]:
    off = offline(quick)
    on = online(quick)
    _plot(out_dir / "dualpath_ds660b.png", off, on, quick)
    rows = _rows(off, on, quick)
    if not quick:
        extra = (
            "; DS 27B is the authors' internal model: App. A.2's shapes, the fields it leaves out from "
            "DeepSeek-V3.2 (profile ds-27b)"
        )
        rows.append(_online_row(online(False, ONLINE_DS27B), "DS 27B 1P1D", 1.67, APS_GRID[0], extra))
    return rows


# ----------------------------------------------------------------------------------------------
# Rows

QUICK_NOTE = (
    f"quick: {QUICK_AGENTS} agents offline and a {QUICK_HORIZON_S:.0f} s online horizon at two APS "
    "points: too few agents to load the cluster, not the paper's scale"
)


def _jct(result: Result) -> float:
    return float(result["makespan_s"])


def _rows(off: Mapping[str, Result], on: Mapping[str, Sequence[OnlineRun]], quick: bool) -> list[Row]:
    agents = QUICK_AGENTS if quick else AGENTS
    jct = {s: _jct(r) for s, r in off.items()}
    suffix = f"; {QUICK_NOTE}" if quick else ""
    rows = []
    ratio = jct["basic"] / jct["dualpath"]
    pe_busy = off["dualpath"]["pe_busy_fraction"]
    note = (
        f"JCT Basic {jct['basic']:.0f} s, DualPath {jct['dualpath']:.0f} s, Oracle {jct['oracle']:.0f} s; "
        f"Basic is bound by the two prefill nodes' storage NICs, DualPath reads through all six and "
        f"its PEs are busy {pe_busy:.0%} of the time (prefill compute is the next bound)"
    )
    metric = f"DS 660B 2P4D offline, 64K MAL, {agents} agents: JCT Basic / DualPath (Fig. 7, up to)"
    rows.append(Row(PAPER, metric, 1.87, ratio, note=note + suffix))
    metric = f"DS 660B 2P4D offline, {agents} agents: JCT DualPath / Oracle (Fig. 7: close to Oracle)"
    note = "the paper gives no number here (DualPath 'demonstrates [near-Oracle] performance')"
    rows.append(Row(PAPER, metric, None, jct["dualpath"] / jct["oracle"], note=note + suffix))
    grid_first = (QUICK_APS_GRID if quick else APS_GRID)[0]
    extra = (
        "; our trajectories average ~100 turns (Table 2: 157), so absolute APS is higher than the "
        "paper's 0.2-0.45" + suffix
    )
    rows.append(_online_row(on, "DS 660B 2P4D", 2.25, grid_first, extra))
    if not quick:
        rows.extend(_ablation_rows(off, jct))
    return rows


def _online_row(
    on: Mapping[str, Sequence[OnlineRun]], setup: str, paper: float, grid_first: float, extra: str
) -> Row:
    """Fig. 10's capacity ratio for one model and deployment, with the sweep in the note."""
    caps = {s: capacity_aps(rs) for s, rs in on.items()}
    # Basic missing the SLO at the lowest rate: bound its capacity by that rate (a lower-bound ratio).
    ratio = caps["dualpath"] / (caps["basic"] if caps["basic"] > 0 else grid_first)
    grid = "; ".join(
        f"{LABELS[s]} "
        + ", ".join(
            f"{r['rate_per_s']:.2f}: {r['ttft_last_window_s']:.1f}->{r['ttft_projected_s']:.1f} s" for r in rs
        )
        for s, rs in on.items()
    )
    capped = "".join(
        f" ({LABELS[s]} met the SLO at every grid rate: its capacity is a lower bound)"
        for s, rs in on.items()
        if all(r["ttft_projected_s"] <= TTFT_SLO_S for r in rs)
    )
    note = (
        f"capacity at projected TTFT <= 4 s: Basic {caps['basic']:.2f}, DualPath {caps['dualpath']:.2f} "
        f"APS{capped} (APS: last-window TTFT -> projected {grid})"
    )
    metric = f"{setup} online: APS at TTFT <= 4 s, DualPath / Basic (Fig. 10)"
    return Row(PAPER, metric, paper, ratio, note=note + extra)


def _ablation_rows(off: Mapping[str, Result], jct: Mapping[str, float]) -> list[Row]:
    order = [jct[s] for s in ABLATION]
    holds = all(a >= b for a, b in itertools.pairwise(order))
    listed = ", ".join(f"{LABELS[s]} {jct[s]:.0f} s" for s in ABLATION)
    rows = [
        Row(
            PAPER,
            "Fig. 12 ablation: JCT falls at every step Basic > +Layerwise > +Dual-Path > DualPath",
            1.0,
            1.0 if holds else 0.0,
            note=f"1 = the paper's order holds; {listed}",
        )
    ]
    layerwise_note = (
        "the paper's share of each step is not in our copy of the text; here +Layerwise gains little: "
        "Basic is storage-NIC bound, so hiding the H2D behind compute and lifting the HBM bound on "
        "the batch barely shorten the job, while +Dual-Path triples the read bandwidth"
    )
    notes = {
        "layerwise": layerwise_note,
        "dual_path": "the paper's main step ('delivers the primary performance gains')",
        "dualpath": "the paper's best: load-balanced read sides and engines",
    }
    for s in ABLATION[1:]:
        metric = f"Fig. 12 ablation: JCT Basic / {LABELS[s]}"
        rows.append(Row(PAPER, metric, None, jct["basic"] / jct[s], note=notes[s]))
    rr = float(off["dual_path"]["storage_nic_read_max_over_mean"])
    ours = float(off["dualpath"]["storage_nic_read_max_over_mean"])
    note = (
        f"max/mean read bytes over the 6 storage NICs: round robin {rr:.2f}, DualPath {ours:.2f} "
        "(paper 1.53 -> 1.18, in short windows over the job's first 5%; here over the whole job)"
    )
    metric = "Fig. 13: storage NIC imbalance, round robin / DualPath scheduler (1.53/1.18)"
    rows.append(Row(PAPER, metric, 1.53 / 1.18, rr / ours, note=note))
    return rows


# ----------------------------------------------------------------------------------------------
# Plot


def _plot(path: Path, off: Mapping[str, Result], on: Mapping[str, Sequence[OnlineRun]], quick: bool) -> None:
    """Fig. 7/12 style JCT bars and Fig. 10 style TTFT against APS, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    systems = [s for s in (*ABLATION, "oracle") if s in off]
    colors = {"basic": "#999999", "layerwise": "#c6dbef", "dual_path": "#6baed6", "dualpath": "#08519c"}
    bars = left.bar(
        [LABELS[s] for s in systems],
        [_jct(off[s]) for s in systems],
        color=[colors.get(s, "#fdae6b") for s in systems],
    )
    left.bar_label(bars, fmt="%.0f", fontsize=8)
    agents = QUICK_AGENTS if quick else AGENTS
    left.set(ylabel="JCT (s)", title=f"offline, 64K MAL, {agents} agents")
    left.tick_params(axis="x", labelsize=8)
    for system, results in on.items():
        xs = [float(r["rate_per_s"]) for r in results]
        line = right.plot(xs, [r["ttft_last_window_s"] for r in results], "o-", label=LABELS[system])
        color = line[0].get_color()
        projected = [min(r["ttft_projected_s"], 4 * TTFT_SLO_S) for r in results]
        right.plot(xs, projected, "x--", color=color, label=f"{LABELS[system]}, projected 30 min")
    right.axhline(TTFT_SLO_S, color="red", linestyle=":", linewidth=1, label="TTFT SLO 4 s")
    right.set(xlabel="agents per second (APS)", ylabel="mean TTFT (s)", title="online")
    right.grid(True, alpha=0.3)
    right.legend(fontsize=8)
    fig.suptitle("DualPath: DS 660B (DeepSeek-V3.2), 2P4D Hopper (kvtier sim)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
