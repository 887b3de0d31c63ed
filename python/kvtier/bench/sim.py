"""``kvtier bench sim``: how fast the simulator replays the Mooncake synthetic trace (3,993 requests,
~15K-token inputs) on one H100 with the ``hicache`` baseline, and whether an infinite-capacity
replay reproduces the trace's block hit rate as computed directly from its ``hash_ids``.

:func:`scaling` replays the trace and back-to-back copies of it (fresh ``hash_ids`` per copy: 4
copies are ~16K requests, 25 ~100K) under every policy on one overloaded engine, and fits the wall
time's scaling exponent in the number of requests (issue 20: at most 1.1)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.errors import KvtierError
from kvtier.results import Result
from kvtier.sim.config import SimConfig
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
    ttft_s: dict[str, float]
    hit_rate_tokens: dict[str, float]
    mooncake_synthetic_infinite_hit_rate: float
    mooncake_synthetic_direct_hit_rate: float
    infinite_minus_direct: float
    bench: str = "sim"


@dataclass(frozen=True)
class ScalingRow(Result):
    """One replay of :func:`scaling`."""

    policy: str
    copies: int
    requests: int
    wall_s: float
    cpu_s: float
    events: int
    events_per_wall_s: float


@dataclass(frozen=True)
class Scaling(Result):
    """What ``kvtier bench sim --scaling`` reports."""

    rows: list[ScalingRow]
    scaling_exponent: dict[str, float | None]
    scaling_exponent_cpu: dict[str, float | None]
    bench: str = "sim_scaling"


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


def config(max_requests: int | None = None, policy: str = "hicache", copies: int = 1) -> SimConfig:
    workload: Workload = dict(MOONCAKE)
    if max_requests is not None:
        workload["max_requests"] = max_requests
    if copies > 1:
        workload["copies"] = copies
    engines = 8 if policy.startswith("dualpath") else 0  # P/D: one node each (h100-sxm: 8 GPUs)
    return SimConfig(
        name=f"mooncake-h100-{policy}",
        hardware="h100-sxm",
        model="llama-3.1-8b",
        policy={"name": policy},
        block_tokens=512,
        workload=workload,
        prefill_engines=engines,
        decode_engines=engines,
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
    result = run_sim(config(max_requests), show_progress=show, expected_requests=max_requests or 3993)
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
    )


def scaling(
    policies: Sequence[str] = SCALING_POLICIES,
    copies: Sequence[int] = (1, 4, 25),
    max_requests: int | None = None,
) -> Scaling:
    """Wall seconds and events per wall second of each policy on ``copies`` back-to-back copies of
    the bundled trace (the first ``max_requests`` requests of each replay if given), and per policy
    the exponent ``k`` of ``wall_s ~ requests**k`` fitted by least squares on log-log axes.

    ``cpu_s`` (this process's CPU seconds over the replay) and its exponent ``scaling_exponent_cpu``
    are what to compare on a shared machine: other processes' load stretches wall time, not CPU time.
    """
    rows: list[ScalingRow] = []
    exponents: dict[str, float | None] = {}
    cpu_exponents: dict[str, float | None] = {}
    for policy in policies:
        points: list[tuple[float, float]] = []
        cpu_points: list[tuple[float, float]] = []
        for n_copies in copies:
            cpu_start = time.process_time()
            result = run_sim(config(max_requests, policy, n_copies))
            cpu = time.process_time() - cpu_start
            wall = result["wall_s"]
            events_per_wall_s = result["events"] / wall if wall > 0 else math.inf
            rows.append(
                ScalingRow(
                    policy, n_copies, result["requests"], wall, cpu, result["events"], events_per_wall_s
                )
            )
            points.append((float(result["requests"]), wall))
            cpu_points.append((float(result["requests"]), cpu))
        exponents[policy] = scaling_exponent(points)
        cpu_exponents[policy] = scaling_exponent(cpu_points)
    return Scaling(rows, exponents, cpu_exponents)


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
            f"  wall {r.mooncake_synthetic_wall_s:.1f} s ({r.requests_per_wall_s:.0f} requests/s, "
            f"{r.events} events, {r.sim_time_s:.0f} s simulated)",
            f"  TTFT mean {r.ttft_s['mean']:.3f} s p99 {r.ttft_s['p99']:.3f} s; token hit rate "
            f"{r.hit_rate_tokens['total']:.1%}",
            f"  infinite-capacity block hit rate {r.mooncake_synthetic_infinite_hit_rate:.4%} vs direct "
            f"from hash_ids {r.mooncake_synthetic_direct_hit_rate:.4%}",
        ]
    )


def scaling_summary(r: Scaling) -> str:
    lines = ["sim scaling: copies of the Mooncake synthetic trace (fresh hash ids per copy), one H100"]
    for row in r.rows:
        lines.append(
            f"  {row.policy:12s} {row.requests:7d} requests  {row.wall_s:8.1f} s wall  "
            f"{row.cpu_s:8.1f} s CPU  {row.events_per_wall_s:8.0f} events/s"
        )
    for policy, k in r.scaling_exponent.items():
        k_cpu = r.scaling_exponent_cpu[policy]
        lines.append(
            f"  {policy:12s} scaling exponent {'-' if k is None else f'{k:.3f}'} (wall), "
            f"{'-' if k_cpu is None else f'{k_cpu:.3f}'} (CPU)"
        )
    return "\n".join(lines)


def scaling_from_flags(policies: str | None, copies: str, max_requests: int | None) -> Scaling:
    """:func:`scaling` from ``kvtier bench sim --scaling``'s flags (comma-separated lists)."""
    names = policies.split(",") if policies else list(SCALING_POLICIES)
    unknown = [p for p in names if p not in SCALING_POLICIES]
    if unknown:
        raise KvtierError(f"--policies names {unknown}; expected some of {list(SCALING_POLICIES)}")
    parts = copies.split(",")
    if not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise KvtierError(f"--copies is {copies!r}; expected comma-separated whole numbers such as 1,4,25")
    return scaling(names, [int(p) for p in parts], max_requests)
