"""Beyond the papers (issue 4): the composed policy (:mod:`kvtier.sched.composed`) against each
paper's policy alone, on the Mooncake synthetic trace and on a multi-turn agentic workload.

No paper has this experiment, so its :class:`Row` s carry ``paper_ratio=None`` (the report prints
``-`` and "n/a" for the ±30% check). Every policy runs on the same node, model and workload
(``experiments/composed/{mooncake,agentic}.yaml``); only ``policy`` changes, and the data plane
(DuplexKV swaps for the systems that rotate, :data:`ROTATION_SWAP`):
unified pooling and the composed policy run on the pooled layout (``pool: {layout: pooled,
passthrough: true}``), the others on the config's serial path. Per workload and load:
TTFT and TBT SLO attainment, output-token throughput, mean and P99 TTFT. At the higher load the
composed policy is also run with each piece switched off (its contribution). A bar chart per
workload goes to ``out_dir/composed.png``.

Rows: for each workload and load, the composed policy's TTFT attainment, TBT attainment and
throughput over the best single-paper policy's (ratio > 1: composition helps), the note naming that
policy and every policy's numbers; then the ablation rows (composed / composed without the piece).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TypedDict

from kvtier.sched.data_plane import default_offload, offload_mode
from kvtier.sim.config import SimConfig
from kvtier.sim.reproduce import PlaneProfile, PolicySpec, Row, experiments_dir, reproduction
from kvtier.sim.run import SimResult, run
from kvtier.sim.run import workload as requests_of
from kvtier.sim.xfer import xfer_blocks

PAPER = "composed"
Result = SimResult


class LoadPoint(TypedDict, total=False):
    """A load point: the workload keys it overrides (Mooncake's replay speed, agentic's count)."""

    max_requests: int
    time_scale: float
    num_trajectories: int


# Each paper's policy alone (and the two baselines), as the paper's module names it. ShadowServe
# writes computed KV to the store here (STORE_WRITES): its paper assumes a store other servers fill.
SINGLE: dict[str, PolicySpec] = {
    "fcfs": {"name": "fcfs"},
    "lmcache": {"name": "lmcache"},
    "strata": {"name": "strata"},
    "rotasched": {"name": "rotasched"},
    "unified_pool": {"name": "lmcache_lp_async"},  # on the pooled data plane (POOLED below)
    "shadowserve": {"name": "shadowserve_async"},
}
STORE_WRITES: dict[str, str] = {"mode": "write_through"}  # the `offload` section of ShadowServe alone
BASELINES = ("fcfs", "lmcache")
# The pieces whose contribution is measured: a stage, or (pool) the pooled data plane.
PIECES = ("rotation", "async_fetch", "balance", "pool")
FULL = ("rotation", "async_fetch", "balance")
# The compositions compared: all four pieces, and all but rotation (see the module doc).
COMPOSED: dict[str, PolicySpec] = {
    "composed": {"name": "composed", "stages": list(FULL)},
    "composed-no-rotation": {"name": "composed", "stages": ["async_fetch", "balance"]},
}
# Composed without one piece: the stages left (balance off: the unified pool's async loading
# admits), and the data plane (pool off: LMCache's serial path).
WITHOUT: dict[str, tuple[PolicySpec, bool]] = {
    "async_fetch": ({"name": "composed", "stages": ["rotation", "balance"]}, True),
    "balance": ({"name": "composed", "stages": ["rotation", "async_fetch", "async_load"]}, True),
    "pool": ({"name": "composed", "stages": list(FULL)}, False),
}
# Systems on the unified pool's data plane (the rest on LMCache's serial path).
POOLED = ("unified_pool", *COMPOSED)
POOLED_PLANE = PlaneProfile(layout="pooled", passthrough=True)
SERIAL_PLANE = PlaneProfile(layout="serial", passthrough=False)
# The swap path of the systems that rotate (RotaSched, composed's rotation stage): DuplexKV
# (SuperInfer §4.3); the rest swap on the engine's plain path. The fetch path is the experiments'
# (ShadowServe's SmartNIC), used only by the loads that fetch compressed (ShadowServe, async_fetch).
ROTATION_SWAP, PLAIN_SWAP = {"engine": "duplexkv"}, {"engine": "plain"}


def _workloads(quick: bool) -> dict[str, tuple[str, list[LoadPoint]]]:
    """Per workload: its experiment file and the workload overrides of each load point (light to
    heavy). Mooncake's load is its replay speed (time_scale 2.5 = 0.4x the trace's rate); the
    agentic workload's is the number of trajectories started at 1 a second."""
    if quick:
        return {
            "mooncake": ("mooncake", [{"max_requests": 40, "time_scale": 2.5}]),
            "agentic": ("agentic", [{"num_trajectories": 3}]),
        }
    return {
        "mooncake": ("mooncake", [{"time_scale": 3.0}, {"time_scale": 2.5}]),
        "agentic": ("agentic", [{"num_trajectories": 24}, {"num_trajectories": 36}]),
    }


def _config(name: str) -> SimConfig:
    return SimConfig.from_yaml(experiments_dir() / PAPER / f"{name}.yaml")


def _policy(base: SimConfig, spec: PolicySpec) -> PolicySpec:
    """``spec`` with the experiment's SLOs where the policy takes them, so RotaSched alone and the
    composed policy see the same numbers (both get the node's B_xfer from the simulator:
    :func:`kvtier.sim.xfer.xfer_blocks`)."""
    if spec["name"] not in ("rotasched", "composed"):
        return spec.copy()
    out = spec.copy()  # the spec's own keys win over the shared ones
    if "ttft_slo_s" in base.policy and "ttft_slo_s" not in spec:
        out["ttft_slo_s"] = base.policy["ttft_slo_s"]
    if "tbt_slo_s" in base.policy and "tbt_slo_s" not in spec:
        out["tbt_slo_s"] = base.policy["tbt_slo_s"]
    return out


def _run(base: SimConfig, spec: PolicySpec, load: LoadPoint, pooled: bool) -> Result:
    pool = {**(base.pool or {}), **(POOLED_PLANE if pooled else SERIAL_PLANE)}
    rotates = spec["name"] == "rotasched" or "rotation" in spec.get("stages", ())
    swap = ROTATION_SWAP if rotates else PLAIN_SWAP
    config = base.with_overrides(
        policy=_policy(base, spec),
        workload={**base.workload, **load},
        pool=pool,
        swap=swap,
        offload=_offload(base, spec),
    )
    return run(config)


def _offload(base: SimConfig, spec: PolicySpec) -> dict[str, str]:
    """The ``offload`` section a system runs with: ShadowServe alone writes computed KV to the store
    (:data:`STORE_WRITES`); the others keep the experiment's mode, else their paper's engine's
    (:func:`kvtier.sched.data_plane.default_offload`, the table the engines default to)."""
    if spec["name"] == "shadowserve_async":
        return STORE_WRITES
    return {"mode": offload_mode(base.offload) or default_offload(spec)}


def _metrics(r: Result) -> dict[str, float]:
    return {
        "ttft_slo": float(r["slo"]["ttft_attainment"]),
        "tbt_slo": float(r["slo"]["tpot_attainment"]),
        "throughput": float(r["throughput_output_tokens_per_s"]),
        "ttft_mean": float(r["ttft_s"]["mean"]),
        "ttft_p99": float(r["ttft_s"]["p99"]),
    }


def _fmt(name: str, m: Mapping[str, float]) -> str:
    return (
        f"{name}: TTFT {m['ttft_slo']:.0%}, TBT {m['tbt_slo']:.0%}, {m['throughput']:.0f} tok/s, "
        f"TTFT mean {m['ttft_mean']:.2f} s / P99 {m['ttft_p99']:.2f} s"
    )


def _load_label(base: SimConfig, load: LoadPoint) -> str:
    """The offered load: requests and their arrival rate (Mooncake), trajectories and their start
    rate (agentic: later steps are closed-loop)."""
    config = base.with_overrides(workload={**base.workload, **load})
    spec = config.workload
    if spec["name"] == "mooncake":
        arrivals = [r.arrival_s for r in requests_of(config)]
        rate = len(arrivals) / max(arrivals[-1], 1e-9)
        return f"{len(arrivals)} requests at {rate:.2f}/s, time_scale {spec['time_scale']:g}"
    return f"{spec['num_trajectories']} trajectories started at {spec['rate_per_s']:g}/s"


def _compare_rows(workload: str, label: str, table: Mapping[str, dict[str, float]]) -> list[Row]:
    """Each composition vs the best single-paper policy (baselines excluded) on each metric."""
    papers = [p for p in table if p not in BASELINES and p not in COMPOSED]
    rows = []
    everyone = "; ".join(_fmt(p, table[p]) for p in table)
    for name in COMPOSED:
        for metric, what in (
            ("ttft_slo", "TTFT SLO attainment"),
            ("tbt_slo", "TBT SLO attainment"),
            ("throughput", "output throughput"),
        ):
            best = max(papers, key=lambda p: table[p][metric])
            ratio = table[name][metric] / max(table[best][metric], 1e-9)
            first = name == "composed" and metric == "ttft_slo"
            rows.append(
                Row(
                    PAPER,
                    f"{workload} ({label}): {what}, {name} / best single paper ({best})",
                    None,
                    ratio,
                    note=everyone if first else "",
                )
            )
    return rows


def _ablation_rows(workload: str, label: str, full: dict[str, float], off: Mapping[str, Result]) -> list[Row]:
    rows = []
    for piece, r in off.items():
        m = _metrics(r)
        rows.append(
            Row(
                PAPER,
                f"{workload} ({label}): TTFT SLO attainment, composed / composed without {piece}",
                None,
                full["ttft_slo"] / max(m["ttft_slo"], 1e-9),
                note=f"without {piece}: " + _fmt("", m)[2:] + "; full: " + _fmt("", full)[2:],
            )
        )
    return rows


def _plot(path: Path, tables: Mapping[str, Sequence[tuple[str, Mapping[str, dict[str, float]]]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(tables)
    metrics = (
        ("ttft_slo", "TTFT SLO attainment"),
        ("tbt_slo", "TBT SLO attainment"),
        ("throughput", "tok/s"),
    )
    fig, axes = plt.subplots(len(workloads), len(metrics), figsize=(15, 4 * len(workloads)), squeeze=False)
    for row, workload in enumerate(workloads):
        loads = tables[workload]
        names = list(loads[0][1])
        width = 0.8 / max(len(loads), 1)
        for col, (metric, title) in enumerate(metrics):
            ax = axes[row][col]
            for i, (label, table) in enumerate(loads):
                xs = [j + i * width for j in range(len(names))]
                ax.bar(xs, [table[n][metric] for n in names], width, label=label)
            ax.set_xticks([j + width * (len(loads) - 1) / 2 for j in range(len(names))])
            ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
            ax.set_title(f"{workload}: {title}")
            if metric != "throughput":
                ax.set_ylim(0, 1.25)  # room for the legend above the 100% bars
            if col == 0:
                ax.legend(fontsize=7, loc="upper center", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@reproduction(PAPER)
def reproduce(out_dir: Path, quick: bool) -> list[Row]:
    rows: list[Row] = []
    tables: dict[str, list[tuple[str, dict[str, dict[str, float]]]]] = {}
    for workload, (config_name, loads) in _workloads(quick).items():
        base = _config(config_name)
        tables[workload] = []
        for index, load in enumerate(loads):
            specs = {**SINGLE, **COMPOSED}
            results = {name: _run(base, spec, load, name in POOLED) for name, spec in specs.items()}
            table = {name: _metrics(r) for name, r in results.items()}
            label = _load_label(base, load)
            tables[workload].append((label, table))
            rows.extend(_compare_rows(workload, label, table))
            if index == len(loads) - 1:  # each piece's contribution at the heaviest load
                off = {p: _run(base, spec, load, pooled) for p, (spec, pooled) in WITHOUT.items()}
                off["rotation"] = results["composed-no-rotation"]
                rows.extend(_ablation_rows(workload, label, table["composed"], off))
                rows.append(_xfer_row(workload, label, base, table["composed"], load))
    _plot(out_dir / "composed.png", tables)
    return rows


def _xfer_row(workload: str, label: str, base: SimConfig, full: dict[str, float], load: LoadPoint) -> Row:
    """The rotation piece's sensitivity to B_xfer: the time-equal budget vs the token-equal one."""
    time_equal, token_equal = xfer_blocks(base)
    m = _metrics(_run(base, PolicySpec(**COMPOSED["composed"], xfer_blocks=token_equal), load, pooled=True))
    return Row(
        PAPER,
        f"{workload} ({label}): TTFT SLO attainment, composed B_xfer {time_equal} / {token_equal} blocks",
        None,
        full["ttft_slo"] / max(m["ttft_slo"], 1e-9),
        note=(
            f"B_xfer {time_equal} blocks moves over PCIe in the time §5.1's 2400 blocks take over C2C "
            f"(~50 ms); {token_equal} blocks is §5.1's 38,400 tokens. "
            + _fmt(f"B_xfer {token_equal}", m)
            + "; "
            + _fmt(f"B_xfer {time_equal}", full)
        ),
    )
