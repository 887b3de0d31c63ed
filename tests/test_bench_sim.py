"""``kvtier bench sim``'s scaling helpers (the replays themselves are measured, not tested)."""

from __future__ import annotations

import pytest

from kvtier.bench.sim import SCALING_POLICIES, config, scaling, scaling_exponent


def test_scaling_exponent_is_the_log_log_slope() -> None:
    assert scaling_exponent([(1000.0, 2.0), (4000.0, 8.0), (25_000.0, 50.0)]) == pytest.approx(1.0)
    assert scaling_exponent([(1000.0, 1.0), (2000.0, 4.0)]) == pytest.approx(2.0)
    assert scaling_exponent([(1000.0, 1.0)]) is None


def test_every_policy_has_a_config() -> None:
    for policy in SCALING_POLICIES:
        c = config(100, policy, copies=4)
        assert c.workload["copies"] == 4 and c.policy == {"name": policy}


def test_scaling_reports_every_run() -> None:
    out = scaling(("fcfs",), copies=(1, 2), max_requests=20)
    assert [row["requests"] for row in out["rows"]] == [20, 20]
    assert all(row["events_per_wall_s"] > 0 for row in out["rows"])
    assert out["scaling_exponent"] == {"fcfs": None}  # one size: no fit
