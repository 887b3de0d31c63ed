"""A replay whose events run out with requests unfinished stalled, and raises (kvtier.sim.stall):
it is never returned as a result. A replay cut by ``max_sim_s`` is not a stall."""

from __future__ import annotations

import pytest

from kvtier import report
from kvtier.errors import SimError
from kvtier.sched.base import Policy, SchedulerDecision, SchedulerView, policy_names, register
from kvtier.sched.batching import blocks_for
from kvtier.sim.config import SimConfig
from kvtier.sim.core import EventKind, EventLoop
from kvtier.sim.request import Request
from kvtier.sim.run import build, replay, run

BT = 16


class _Hoarder(Policy):
    """Admits while blocks last and decodes only while every running request could take a new
    block; otherwise plans nothing. It never preempts, so once the device is full its running
    requests wait for blocks that nothing frees."""

    name = "test-hoarder"

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        decision = SchedulerDecision()
        free = view.free_device_blocks
        if free < len(view.running):
            return decision
        decision.decode.extend(r.req_id for r in view.running)
        free -= len(view.running)
        for w in view.waiting:
            need = blocks_for(w.prompt_tokens, view.block_tokens) + 1
            if need > free:
                break
            decision.prefill.append((w.req_id, w.prompt_tokens))
            free -= need
        return decision


def _config(max_sim_s: float | None = None) -> SimConfig:
    if _Hoarder.name not in policy_names():
        register(_Hoarder)
    return SimConfig(
        name="stall-test",
        hardware="h100-sxm",
        model="llama-3.1-8b",
        policy={"name": _Hoarder.name},
        block_tokens=BT,
        device_blocks=10,
        max_sim_s=max_sim_s,
    )


def _requests() -> list[Request]:
    # Two 3-block prompts with 100 tokens to generate each: either alone fits the 10 device blocks
    # (148 tokens), both together never do.
    return [Request(i, 0.0, 3 * BT, 100, tuple(range(i * 100, i * 100 + 3))) for i in range(2)]


def test_a_replay_whose_running_requests_wait_for_blocks_forever_raises() -> None:
    sim = build(_config())
    sim.cluster.feed(iter(_requests()))
    with pytest.raises(SimError) as err:
        replay(sim)
    message = str(err.value)
    assert "stalled" in message and "2 requests unfinished" in message
    assert "engine 'e0', policy 'test-hoarder': 2 running, 0 waiting, 0 swapped" in message
    assert "of 10 device blocks free" in message and "host blocks free" in message
    assert f"after {sim.metrics.steps} steps" in message
    assert sim.cluster.unfinished_requests() == 2  # what a silent end would have returned


def test_a_replay_cut_by_its_horizon_is_not_a_stall() -> None:
    sim = build(_config(max_sim_s=0.001))
    sim.cluster.feed(iter(_requests()))
    replay(sim, 0.001)  # events left past the horizon: unfinished requests are the cut's
    assert sim.cluster.unfinished_requests() == 2


def test_a_replay_that_finishes_is_not_a_stall() -> None:
    sim = build(_config().with_overrides(device_blocks=24))
    sim.cluster.feed(iter(_requests()))
    replay(sim)
    assert sim.cluster.unfinished_requests() == 0 and sim.metrics.requests == 2


@pytest.mark.parametrize("policy", ["rotasched", "composed"])
def test_a_rotasched_replay_whose_running_requests_all_just_landed_finishes(policy: str) -> None:
    # Three requests on 8 blocks: the last two are admitted together and, once every earlier one is
    # gone, are the whole running batch in the iteration after (VLT 0, which Algorithm 1 never
    # preempts) with claims the free blocks do not cover. It stalled (no arrival left to move the
    # clock) until RotaSched fell back on passive preemption (RotaSched.unstall); composed, which
    # rotates through RotaSched, too.
    config = SimConfig(
        name="rotasched-stall",
        hardware="h100-sxm",
        model="llama-3.1-8b",
        policy={"name": policy, "xfer_blocks": 2},
        block_tokens=BT,
        device_blocks=8,
    )
    sim = build(config)
    shapes = [(0.311, 61, 66), (0.343, 62, 5), (0.383, 47, 8)]  # arrival, prompt, output
    sim.cluster.feed(
        iter(
            Request(i, t, p, n, tuple(range(i * 100, i * 100 + -(-p // BT))))
            for i, (t, p, n) in enumerate(shapes)
        )
    )
    replay(sim)
    assert sim.cluster.unfinished_requests() == 0 and sim.metrics.requests == 3


def test_cancelled_events_do_not_count_as_left() -> None:
    loop = EventLoop()
    assert loop.exhausted()
    event = loop.after(5.0, EventKind.WAKE, lambda: None)
    assert not loop.exhausted()
    event.cancel()
    assert loop.exhausted()
    loop.after(1.0, EventKind.WAKE, lambda: None)
    loop.run(until_s=0.5)
    assert not loop.exhausted()


def test_a_horizon_cut_states_its_unfinished_requests_in_the_summary() -> None:
    config = SimConfig(
        name="cut-test",
        hardware="h100-sxm",
        model="llama-3.1-8b",
        policy={"name": "fcfs"},
        block_tokens=512,
        workload={"name": "mooncake", "max_requests": 40},
        max_sim_s=5.0,
    )
    result = run(config)
    unfinished = result["unfinished_requests"]
    assert unfinished > 0
    summary = report.sim_summary(result).splitlines()
    assert summary[1] == (
        f"  {unfinished} requests unfinished at the max_sim_s cut (5 s): the metrics are the finished requests'"
    )
    finished = run(config.with_overrides(max_sim_s=None))
    assert finished["unfinished_requests"] == 0
    assert "unfinished" not in report.sim_summary(finished)
