"""``kvtier bench sim``: how fast the simulator replays the Mooncake synthetic trace (3,993 requests,
~15K-token inputs) on one H100 with the ``hicache`` baseline, and whether an infinite-capacity
replay reproduces the trace's block hit rate as computed directly from its ``hash_ids``."""

from __future__ import annotations

from typing import Any

from kvtier.sim.config import SimConfig
from kvtier.sim.run import run as run_sim
from kvtier.sim.workload import mooncake_block_hit_rate
from kvtier.sim.workload.mooncake import default_trace_path

MOONCAKE = {"name": "mooncake"}


def config(max_requests: int | None = None) -> SimConfig:
    workload: dict[str, Any] = dict(MOONCAKE)
    if max_requests is not None:
        workload["max_requests"] = max_requests
    return SimConfig(
        name="mooncake-h100-hicache",
        hardware="h100-sxm",
        model="llama-3.1-8b",
        policy={"name": "hicache"},
        block_tokens=512,
        workload=workload,
    )


def infinite_config(max_requests: int | None = None) -> SimConfig:
    """Every tier unbounded: the prefix cache never evicts, so every earlier block can hit.

    Arrivals are spread out (``time_scale``) so no request is admitted while an earlier one that
    shares its prefix is still being prefilled: the replay then sees exactly the blocks of every
    earlier request, as the direct computation from ``hash_ids`` does.
    """
    workload: dict[str, Any] = {**MOONCAKE, "time_scale": 1000.0}
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


def run(max_requests: int | None = None, show: bool = True) -> dict[str, Any]:
    result = run_sim(config(max_requests), show_progress=show, expected_requests=max_requests or 3993)
    infinite = run_sim(infinite_config(max_requests))
    direct = mooncake_block_hit_rate(default_trace_path(), max_requests=max_requests)
    return {
        "bench": "sim",
        "requests": result["requests"],
        "mooncake_synthetic_wall_s": result["wall_s"],
        "requests_per_wall_s": result["requests"] / result["wall_s"],
        "events": result["events"],
        "sim_time_s": result["sim_time_s"],
        "ttft_s": result["ttft_s"],
        "hit_rate_tokens": result["hit_rate_tokens"],
        "mooncake_synthetic_infinite_hit_rate": infinite["hit_rate_blocks"],
        "mooncake_synthetic_direct_hit_rate": direct,
        "infinite_minus_direct": infinite["hit_rate_blocks"] - direct,
    }


def summary(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"sim bench: Mooncake synthetic trace, {r['requests']} requests, Llama-3.1-8B on one H100, hicache",
            f"  wall {r['mooncake_synthetic_wall_s']:.1f} s ({r['requests_per_wall_s']:.0f} requests/s, "
            f"{r['events']} events, {r['sim_time_s']:.0f} s simulated)",
            f"  TTFT mean {r['ttft_s']['mean']:.3f} s p99 {r['ttft_s']['p99']:.3f} s; token hit rate "
            f"{r['hit_rate_tokens']['total']:.1%}",
            f"  infinite-capacity block hit rate {r['mooncake_synthetic_infinite_hit_rate']:.4%} vs direct "
            f"from hash_ids {r['mooncake_synthetic_direct_hit_rate']:.4%}",
        ]
    )
