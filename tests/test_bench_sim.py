"""``kvtier bench sim``'s scaling helpers (the replays themselves are measured, not tested)."""

from __future__ import annotations

import pytest

from kvtier.bench.sim import (
    SCALING_POLICIES,
    SIZED,
    SIZED_ENGINES,
    SimBench,
    config,
    scaling,
    scaling_exponent,
    scaling_from_flags,
    sized_engines,
)
from kvtier.errors import KvtierError


def test_scaling_exponent_is_the_log_log_slope() -> None:
    assert scaling_exponent([(1000.0, 2.0), (4000.0, 8.0), (25_000.0, 50.0)]) == pytest.approx(1.0)
    assert scaling_exponent([(1000.0, 1.0), (2000.0, 4.0)]) == pytest.approx(2.0)
    assert scaling_exponent([(1000.0, 1.0)]) is None


def test_every_policy_has_a_config() -> None:
    for policy in SCALING_POLICIES:
        c = config(100, policy, copies=4, engines=4)
        assert c.workload["copies"] == 4 and c.policy == {"name": policy}
        assert (c.engines, c.prefill_engines) == ((1, 8) if policy == "dualpath" else (4, 0))


def test_scaling_reports_every_run() -> None:
    out = scaling(("fcfs",), copies=(1, 2), max_requests=20, engines=(1,)).as_dict()  # as --json prints it
    assert [row["requests"] for row in out["rows"]] == [20, 20]
    assert all(row["events_per_wall_s"] > 0 for row in out["rows"])
    assert all(row["cpu_s"] > 0 for row in out["rows"])
    one_size = {"fcfs": {"1": None}}  # one request count: no fit
    assert out["scaling_exponent"] == out["scaling_exponent_cpu"] == one_size


def test_cli_scaling_prints_each_run_and_the_exponent() -> None:
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "kvtier.cli", "bench", "sim", "--scaling", "--copies", "1,2"]
    args = ["--policies", "fcfs", "--engines", "4", "--json"]
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert [(row["policy"], row["copies"]) for row in r["rows"]] == [("fcfs", 1), ("fcfs", 2)]
    assert r["rows"][1]["requests"] == 2 * r["rows"][0]["requests"] == 2 * 3993
    assert (
        r["scaling_exponent"]["fcfs"]["4"] is not None and r["scaling_exponent_cpu"]["fcfs"]["4"] is not None
    )
    bad = subprocess.run([*cmd[:-1], "1.5"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--copies" in bad.stderr


def test_the_json_keys_are_unchanged() -> None:
    out = scaling(("fcfs",), copies=(1,), max_requests=5, engines=(1,)).as_dict()
    assert (
        set(out) == {"bench", "rows", "scaling_exponent", "scaling_exponent_cpu", "peak_rss_bytes"}
        and out["bench"] == "sim_scaling"
    )
    row_keys = {"policy", "copies", "requests", "wall_s", "cpu_s", "events", "events_per_wall_s"}
    row_keys |= {
        "engines",
        "unfinished_requests",
        "events_per_cpu_s",
        "peak_rss_bytes",
        "ttft_mean_s",
        "ttft_p90_s",
        "build",  # python or compiled (tests/test_sim_compiled.py)
    }
    assert [set(row) for row in out["rows"]] == [row_keys]
    bench = SimBench(
        3993, 1.0, 3993.0, 10, 5.0, {"mean": 0.1}, {"total": 0.5}, 0.4, 0.4, 0.0, 1.0, 2**20
    ).as_dict()
    assert set(bench) == {
        "bench", "requests", "mooncake_synthetic_wall_s", "requests_per_wall_s", "events", "sim_time_s",
        "ttft_s", "hit_rate_tokens", "mooncake_synthetic_infinite_hit_rate", "mooncake_synthetic_direct_hit_rate",
        "infinite_minus_direct", "cpu_s", "peak_rss_bytes",
    }  # fmt: skip
    assert bench["bench"] == "sim" and bench["ttft_s"] == {"mean": 0.1}


def test_the_sized_cluster_is_each_policys_own() -> None:
    """``--engines 1,sized`` (the default): one overloaded H100 and the cluster ``kvtier sim size``
    answered for the policy (rotasched and fcfs need 5 where the others need 4)."""
    assert sized_engines("rotasched") == sized_engines("fcfs") == 5
    assert sized_engines("hicache") == sized_engines("composed") == SIZED_ENGINES == 4
    out = scaling(("hicache", "rotasched"), copies=(1,), max_requests=5, engines=(1, SIZED)).as_dict()
    assert [(row["policy"], row["engines"]) for row in out["rows"]] == [
        ("hicache", 1),
        ("hicache", 4),
        ("rotasched", 1),
        ("rotasched", 5),
    ]
    assert set(out["scaling_exponent"]["rotasched"]) == {"1", "5"}
    with pytest.raises(KvtierError, match=r"--engines is '1,big'.*or sized"):
        scaling_from_flags("fcfs", "1", 5, "1,big")
    with pytest.raises(KvtierError, match="--copies"):
        scaling_from_flags("fcfs", "sized", 5, None)
