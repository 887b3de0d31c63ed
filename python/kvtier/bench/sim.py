"""``kvtier bench sim``: how fast the simulator replays the Mooncake synthetic trace (3,993 requests,
~15K-token inputs) on one H100 with the ``hicache`` baseline, and whether an infinite-capacity
replay reproduces the trace's block hit rate as computed directly from its ``hash_ids``.

:func:`scaling` replays the trace and back-to-back copies of it (fresh ``hash_ids`` per copy: 4
copies are ~16K requests, 25 ~100K) under every policy on one overloaded engine, and fits the wall
time's scaling exponent in the number of requests (issue 20: at most 1.1)."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import KvtierError
from kvtier.results import Result, json_text
from kvtier.sim import compiled
from kvtier.sim.config import SimConfig
from kvtier.sim.metrics import Summary
from kvtier.sim.run import peak_rss_bytes
from kvtier.sim.run import run as run_sim
from kvtier.sim.workload import mooncake_block_hit_rate
from kvtier.sim.workload.mooncake import default_trace_path

MOONCAKE = {"name": "mooncake"}
Workload = dict[str, str | int | float]  # a SimConfig's ``workload`` section


@dataclass(frozen=True)
class SimBench(Result):
    """What ``kvtier bench sim`` reports."""

    requests: int
    mooncake_synthetic_wall_s: float
    requests_per_wall_s: float
    events: int
    sim_time_s: float
    ttft_s: Summary
    hit_rate_tokens: dict[str, float]
    mooncake_synthetic_infinite_hit_rate: float
    mooncake_synthetic_direct_hit_rate: float
    infinite_minus_direct: float
    cpu_s: float
    peak_rss_bytes: int  # this process's, after both replays
    bench: str = "sim"


@dataclass(frozen=True)
class ScalingRow(Result):
    """One replay of :func:`scaling`, in a process of its own (its CPU time and peak RSS are its own)."""

    policy: str
    copies: int
    engines: int  # colocated engines (1: one overloaded H100); dualpath: its P/D GPUs, fixed
    requests: int
    unfinished_requests: int
    wall_s: float
    cpu_s: float
    events: int
    events_per_wall_s: float
    events_per_cpu_s: float
    peak_rss_bytes: int
    ttft_mean_s: float
    ttft_p90_s: float
    build: str = "python"  # the simulator it ran on: python, or compiled (kvtier.sim.compiled), as loaded


@dataclass(frozen=True)
class Scaling(Result):
    """What ``kvtier bench sim --scaling`` reports; exponents per policy and engine count."""

    rows: list[ScalingRow]
    scaling_exponent: dict[str, dict[str, float | None]]
    scaling_exponent_cpu: dict[str, dict[str, float | None]]
    peak_rss_bytes: int
    bench: str = "sim_scaling"


#: The sized cluster of :func:`scaling`: ``kvtier sim size`` on the bundled trace (hicache, TTFT
#: SLO 5 s for 90% of requests) answers 4 H100s (docs/simulator.md); copies keep the trace's rate,
#: so they need the same.
SIZED_ENGINES = 4
#: Policies whose own sized cluster is larger (``kvtier sim size`` on the copies, ``--policy P``,
#: TTFT SLO 5 s: docs/simulator.md, "Each policy's own sized cluster"): rotasched 5 H100s (4: 80%
#: within 5 s on three copies); fcfs, without lower tiers, 5 (4 serves three copies, not 25: 13%
#: within 5 s, TTFT p50 1,423 s). composed needs 4 (97% on three copies) since its B_xfer is the
#: node's (kvtier.sim.xfer); with 2400 blocks of 512 tokens it needed 5.
POLICY_SIZED_ENGINES = {"fcfs": 5, "rotasched": 5}
SIZED = 0  # in ``engines``: each policy's sized cluster (:func:`sized_engines`)
#: What the bench replays unless told otherwise (minutes on a quiet 2-core machine); the full
#: matrix is ``--policies`` of every policy with ``--copies 1,4,25``.
DEFAULT_POLICIES = ("fcfs", "hicache")
DEFAULT_COPIES = (1, 4)
DEFAULT_ENGINES = (1, SIZED)


def sized_engines(policy: str) -> int:
    """The colocated H100s that serve the bundled trace's copies under ``policy`` (TTFT SLO 5 s)."""
    return POLICY_SIZED_ENGINES.get(policy, SIZED_ENGINES)


#: The policies :func:`scaling` replays (``rotasched`` is SuperInfer's; ``dualpath`` runs on its own
#: P/D cluster, one node of prefill and one of decode GPUs).
SCALING_POLICIES = (
    "fcfs",
    "lmcache",
    "hicache",
    "strata",
    "shadowserve_async",
    "rotasched",
    "dualpath",
    "composed",
)


def config(
    max_requests: int | None = None, policy: str = "hicache", copies: int = 1, engines: int = 1
) -> SimConfig:
    """The bundled trace (``copies`` back to back) on ``engines`` H100s behind ``least_loaded``;
    dualpath on its own P/D cluster (``engines`` ignored)."""
    workload: Workload = dict(MOONCAKE)
    if max_requests is not None:
        workload["max_requests"] = max_requests
    if copies > 1:
        workload["copies"] = copies
    pd = 8 if policy.startswith("dualpath") else 0  # P/D: one node each (h100-sxm: 8 GPUs)
    return SimConfig(
        name=f"mooncake-h100-{policy}",
        hardware="h100-sxm",
        model="llama-3.1-8b",
        policy={"name": policy},
        block_tokens=512,
        workload=workload,
        engines=1 if pd else engines,
        prefill_engines=pd,
        decode_engines=pd,
    )


def infinite_config(max_requests: int | None = None) -> SimConfig:
    """Every tier unbounded: the prefix cache never evicts, so every earlier block can hit.

    Arrivals are spread out (``time_scale``) so no request is admitted while an earlier one that
    shares its prefix is still being prefilled: the replay then sees exactly the blocks of every
    earlier request, as the direct computation from ``hash_ids`` does.
    """
    workload: Workload = {**MOONCAKE, "time_scale": 1000.0}
    if max_requests is not None:
        workload["max_requests"] = max_requests
    return SimConfig(
        name="mooncake-infinite",
        hardware="h100-sxm",
        model="llama-3.1-8b",
        policy={"name": "fcfs"},
        block_tokens=512,
        device_blocks=10**7,
        host_capacity_bytes=0,
        workload=workload,
    )


def run(max_requests: int | None = None, show: bool = True) -> SimBench:
    cpu_start = time.process_time()
    result = run_sim(config(max_requests), show_progress=show, expected_requests=max_requests or 3993)
    cpu = time.process_time() - cpu_start
    infinite = run_sim(infinite_config(max_requests))
    direct = mooncake_block_hit_rate(default_trace_path(), max_requests=max_requests)
    return SimBench(
        requests=result["requests"],
        mooncake_synthetic_wall_s=result["wall_s"],
        requests_per_wall_s=result["requests"] / result["wall_s"],
        events=result["events"],
        sim_time_s=result["sim_time_s"],
        ttft_s=result["ttft_s"],
        hit_rate_tokens=result["hit_rate_tokens"],
        mooncake_synthetic_infinite_hit_rate=infinite["hit_rate_blocks"],
        mooncake_synthetic_direct_hit_rate=direct,
        infinite_minus_direct=infinite["hit_rate_blocks"] - direct,
        cpu_s=cpu,
        peak_rss_bytes=peak_rss_bytes(),
    )


def scaling(
    policies: Sequence[str] = DEFAULT_POLICIES,
    copies: Sequence[int] = DEFAULT_COPIES,
    max_requests: int | None = None,
    engines: Sequence[int] = DEFAULT_ENGINES,
    build: str = "auto",
) -> Scaling:
    """Each policy on ``copies`` back-to-back copies of the bundled trace (the first
    ``max_requests`` requests of each replay if given) on each of ``engines`` (1: one overloaded
    engine; :data:`SIZED`: the policy's sized cluster, :func:`sized_engines`), every replay in a fresh process
    (:func:`replay`); per policy and engine count the exponent ``k`` of ``wall_s ~ requests**k``
    fitted by least squares on log-log axes.

    ``cpu_s`` (the replay's own CPU seconds) and its exponent ``scaling_exponent_cpu`` are what to
    compare on a shared machine: other processes' load stretches wall time, not CPU time.

    ``build`` picks the simulator the replays run on (:func:`kvtier.sim.compiled.fresh_tree`: auto
    takes the mypyc build where it is fresh, and says so on stderr where it is not); each row names
    the one its process loaded.
    """
    tree = compiled.fresh_tree(build)
    if build == "auto" and tree is None:
        print(
            f"kvtier: replays run on the Python simulator ({compiled.stale_reason(compiled.default_dir())}); "
            "`kvtier sim compile` builds the compiled one",
            file=sys.stderr,
        )
    rows: list[ScalingRow] = []
    exponents: dict[str, dict[str, float | None]] = {}
    cpu_exponents: dict[str, dict[str, float | None]] = {}
    for policy in policies:
        # dualpath: its P/D cluster, one size
        sizes = [16] if policy.startswith("dualpath") else [n or sized_engines(policy) for n in engines]
        for n_engines in sizes:
            runs = [replay(policy, n, n_engines, max_requests, tree) for n in copies]
            rows.extend(runs)
            exponents.setdefault(policy, {})[str(n_engines)] = scaling_exponent(
                [(float(r.requests), r.wall_s) for r in runs]
            )
            cpu_exponents.setdefault(policy, {})[str(n_engines)] = scaling_exponent(
                [(float(r.requests), r.cpu_s) for r in runs]
            )
    peak = max((r.peak_rss_bytes for r in rows), default=0)
    return Scaling(rows, exponents, cpu_exponents, peak)


def replay(
    policy: str, copies: int, engines: int, max_requests: int | None = None, tree: Path | None = None
) -> ScalingRow:
    """One replay in a child process (``python -m kvtier.bench.sim``), so that its peak RSS and CPU
    seconds are its own; its progress bar goes to this process's stderr. It imports kvtier from
    ``tree`` (a compiled copy, :mod:`kvtier.sim.compiled`) or, None, from this kvtier's folder."""
    args = [policy, str(copies), str(engines), str(max_requests or 0)]
    env = compiled.child_env(tree)
    done = subprocess.run(
        [sys.executable, "-m", "kvtier.bench.sim", *args],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise KvtierError(f"sim replay {args} failed (exit {done.returncode}); its error is above")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    return ScalingRow.from_json(row, f"sim replay {args}'s row")


def _replay_here(policy: str, copies: int, engines: int, max_requests: int | None) -> ScalingRow:
    cpu_start = time.process_time()
    expected = max_requests or 3993 * copies
    label = f"{policy} x{copies} on {engines}"
    result = run_sim(config(max_requests, policy, copies, engines), True, expected, label)
    cpu = time.process_time() - cpu_start
    wall, events = result["wall_s"], result["events"]
    return ScalingRow(
        policy=policy,
        copies=copies,
        engines=engines,
        requests=result["requests"],
        unfinished_requests=result["unfinished_requests"],
        wall_s=wall,
        cpu_s=cpu,
        events=events,
        events_per_wall_s=events / wall if wall > 0 else math.inf,
        events_per_cpu_s=events / cpu if cpu > 0 else math.inf,
        peak_rss_bytes=peak_rss_bytes(),
        ttft_mean_s=result["ttft_s"]["mean"],
        ttft_p90_s=result["ttft_s"]["p90"],
        build=compiled.running_build(),
    )


def scaling_exponent(points: Sequence[tuple[float, float]]) -> float | None:
    """Slope of ``log(wall_s)`` against ``log(requests)`` (least squares); None under two sizes."""
    xy = [(math.log(n), math.log(w)) for n, w in points if n > 0 and w > 0]
    if len({x for x, _ in xy}) < 2:
        return None
    mx = sum(x for x, _ in xy) / len(xy)
    my = sum(y for _, y in xy) / len(xy)
    return sum((x - mx) * (y - my) for x, y in xy) / sum((x - mx) ** 2 for x, _ in xy)


def summary(r: SimBench) -> str:
    return "\n".join(
        [
            f"sim bench: Mooncake synthetic trace, {r.requests} requests, Llama-3.1-8B on one H100, hicache",
            f"  wall {r.mooncake_synthetic_wall_s:.1f} s, CPU {r.cpu_s:.1f} s ({r.requests_per_wall_s:.0f} requests/s, "
            f"{r.events} events, {r.sim_time_s:.0f} s simulated)",
            f"  TTFT mean {r.ttft_s['mean']:.3f} s p99 {r.ttft_s['p99']:.3f} s; token hit rate "
            f"{r.hit_rate_tokens['total']:.1%}",
            f"  infinite-capacity block hit rate {r.mooncake_synthetic_infinite_hit_rate:.4%} vs direct "
            f"from hash_ids {r.mooncake_synthetic_direct_hit_rate:.4%}; peak RSS {r.peak_rss_bytes / 2**20:.0f} MiB",
        ]
    )


def scaling_summary(r: Scaling) -> str:
    lines = ["sim scaling: copies of the Mooncake synthetic trace (fresh hash ids per copy) on H100s"]
    for row in r.rows:
        lines.append(
            f"  {row.policy:12s} {row.requests:7d} requests on {row.engines:2d}  {row.wall_s:8.1f} s wall  "
            f"{row.cpu_s:8.1f} s CPU  {row.events_per_cpu_s:6.0f} events/CPU s  "
            f"{row.peak_rss_bytes / 2**20:6.0f} MiB  TTFT mean {row.ttft_mean_s:8.2f} s  ({row.build})"
        )
    for policy, by_engines in r.scaling_exponent.items():
        for engines, k in by_engines.items():
            k_cpu = r.scaling_exponent_cpu[policy][engines]
            lines.append(
                f"  {policy:12s} on {engines:>2s} scaling exponent {'-' if k is None else f'{k:.3f}'} (wall), "
                f"{'-' if k_cpu is None else f'{k_cpu:.3f}'} (CPU)"
            )
    lines.append(f"  peak RSS {r.peak_rss_bytes / 2**20:.0f} MiB")
    return "\n".join(lines)


def scaling_from_flags(
    policies: str | None,
    copies: str,
    max_requests: int | None,
    engines: str | None = None,
    build: str = "auto",
) -> Scaling:
    """:func:`scaling` from ``kvtier bench sim --scaling``'s flags (comma-separated lists)."""
    names = policies.split(",") if policies else list(DEFAULT_POLICIES)
    if names == ["all"]:
        names = list(SCALING_POLICIES)
    unknown = [p for p in names if p not in SCALING_POLICIES]
    if unknown:
        raise KvtierError(f"--policies names {unknown}; expected some of {list(SCALING_POLICIES)} or all")
    counts = _counts(engines or "1,sized", "--engines", sized=True)
    return scaling(names, _counts(copies, "--copies"), max_requests, counts, build)


def _counts(text: str, flag: str, sized: bool = False) -> list[int]:
    """Comma-separated whole numbers >= 1; with ``sized``, the word ``sized`` too (:data:`SIZED`)."""
    parts = [p.strip() for p in text.split(",")]
    if not all((p.isdigit() and int(p) > 0) or (sized and p == "sized") for p in parts):
        also = " (or sized: each policy's sized cluster)" if sized else ""
        raise KvtierError(
            f"{flag} is {text!r}; expected comma-separated whole numbers >= 1 such as 1,4,25{also}"
        )
    return [SIZED if p == "sized" else int(p) for p in parts]


def add_command(bench_sub: Any, positive: Callable[[str], int], emit: Callable[..., None]) -> None:
    """`kvtier bench sim` (called where the CLI registers its bench subcommands)."""
    cmd = bench_sub.add_parser("sim", help="simulator speed: Mooncake trace replay wall time; hit-rate check")
    cmd.add_argument("--max-requests", type=positive, default=None, help="replay only the first N requests")
    cmd.add_argument(
        "--scaling", action="store_true", help="every policy on trace copies: wall s, events/s, exponent"
    )
    cmd.add_argument("--copies", default=None, help="--scaling: copies of the trace (default 1,4; 25: 100K)")
    cmd.add_argument("--policies", default=None, help="--scaling: policies or all (default fcfs,hicache)")
    cmd.add_argument(
        "--engines",
        default=None,
        help="--scaling: engine counts or sized (default 1,sized: overloaded, each policy's sized cluster)",
    )
    compiled.add_build_argument(cmd, "auto")  # --scaling's replays
    cmd.add_argument("--json", action="store_true", help="print one JSON object")

    def main(args: argparse.Namespace) -> None:
        for flag in ("copies", "policies", "engines"):  # the plain bench would ignore them
            if getattr(args, flag) is not None and not args.scaling:
                raise KvtierError(
                    f"--{flag} applies to --scaling; the plain bench replays the trace once on one H100"
                )
        if args.scaling:
            flags = (args.policies, args.copies or "1,4", args.max_requests, args.engines, args.build)
            emit(scaling_from_flags(*flags), args.json, scaling_summary)
            return
        emit(run(max_requests=args.max_requests), args.json, summary)  # its bar: stderr, terminals only

    cmd.set_defaults(func=main)


if __name__ == "__main__":  # one replay of :func:`replay`, its row as a JSON line on stdout
    _policy, _copies, _engines, _max = sys.argv[1:5]
    _row = _replay_here(_policy, int(_copies), int(_engines), int(_max) or None)
    print(json_text(_row))
