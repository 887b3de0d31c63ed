"""A speedup of the simulator must not change a single decision (issue 20): every per-engine policy
replays the bench's Mooncake trace to exactly the per-request records (arrival, first token, finish,
hits per tier, worst gap, matched blocks; in finish order) that the code before the change printed."""

from __future__ import annotations

import json

import pytest

import sim_records

FIXTURE = json.loads(sim_records.FIXTURE.read_text())


def test_the_fixture_covers_every_policy() -> None:
    assert sorted(FIXTURE) == sorted(sim_records.POLICIES)


@pytest.mark.parametrize("policy", sim_records.POLICIES)
def test_replay_matches_the_records_saved_before_the_speedup(policy: str) -> None:
    got = sim_records.fingerprint(policy)
    want = FIXTURE[policy]
    assert got["first"] == want["first"]
    assert (got["requests"], got["steps"], got["preemptions"], got["events"]) == (
        want["requests"],
        want["steps"],
        want["preemptions"],
        want["events"],
    )
    assert got["digest"] == want["digest"]


def test_the_digest_sees_a_one_ulp_change() -> None:
    a = [[0.0, 1.0, 2.0, [0, 0, 0, 0], 0.1, 3]]
    b = [[0.0, 1.0, 2.0000000000000004, [0, 0, 0, 0], 0.1, 3]]
    assert sim_records.digest(a) != sim_records.digest(b)
