"""Decode fast-forward (:mod:`kvtier.sim.fast_forward`) changes nothing but the simulator's speed:
replays with it on and forced off (``Engine.decode_fast_forward``) give the same per-request
records to the bit, the same event count and clock, and the same metrics (every histogram bucket
and counter exactly; the float sums that several engines add to within rel 1e-12: steps run ahead
add theirs in another order), while the fast path plans most steps of a sized cluster without
asking the policy."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import pytest

from kvtier.bench.sim import config
from kvtier.sched.base import Policy, SchedulerDecision, SchedulerView
from kvtier.sched.fcfs import Fcfs
from kvtier.sched.hicache import HiCache
from kvtier.sim.config import SimConfig
from kvtier.sim.metrics import RequestRecord
from kvtier.sim.request import Request
from kvtier.sim.run import build, workload


def _state(value: Any, exact: bool = True) -> Any:
    """``value`` as nested plain data, floats exactly (``repr``) or as floats (``exact=False``:
    compared by :func:`assert_same`), for comparing whole records and metrics."""
    if isinstance(value, float):
        return repr(value) if exact else value
    if isinstance(value, dict):
        return {repr(k): _state(v, exact) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_state(v, exact) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _state(getattr(value, f.name), exact) for f in dataclasses.fields(value)}
    if hasattr(value, "__dict__"):
        return {k: _state(v, exact) for k, v in vars(value).items()}
    return value


def _close(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, float) and isinstance(b, float):
        assert a == b or math.isclose(a, b, rel_tol=1e-12) or (math.isnan(a) and math.isnan(b)), (where, a, b)
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _close(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def assert_same(fast: dict[str, Any], slow: dict[str, Any]) -> None:
    """Records, events and clock to the bit; the metrics' floats within rel 1e-12."""
    assert {k: v for k, v in fast.items() if k != "metrics"} == {
        k: v for k, v in slow.items() if k != "metrics"
    }
    _close(fast["metrics"], slow["metrics"], "metrics")


def replay(
    cfg: SimConfig, fast_forward: bool, requests: Iterator[Request] | None = None
) -> tuple[dict[str, Any], int]:
    """Every record in finish order, the whole metrics, events and clock; and how many steps the
    policies were asked to decide."""
    sim = build(cfg)
    records: list[Any] = []
    add = sim.metrics.add_request

    def record(r: RequestRecord) -> None:
        records.append(_state(r))
        add(r)

    sim.metrics.add_request = record  # type: ignore[method-assign]
    asked = [0]
    for engine in sim.cluster.engines:  # type: ignore[attr-defined]
        engine.decode_fast_forward = fast_forward
        schedule = engine.policy.schedule

        def counted(view: SchedulerView, schedule: Any = schedule) -> SchedulerDecision:
            asked[0] += 1
            decision: SchedulerDecision = schedule(view)
            return decision

        engine.policy.schedule = counted
    sim.cluster.feed(workload(cfg) if requests is None else requests)
    sim.loop.run(until_s=cfg.max_sim_s)
    state = {
        "records": records,
        "metrics": _state(sim.metrics, exact=False),
        "events": sim.loop.events_run,
        "now_s": repr(sim.loop.now_s),
    }
    return state, asked[0]


@pytest.mark.parametrize(
    ("policy", "requests", "engines"),
    [
        ("fcfs", 200, 1),
        ("hicache", 200, 1),
        ("fcfs", 400, 4),
        ("hicache", 400, 4),
        ("lmcache", 400, 4),
        ("lmcache_lp", 300, 4),
        ("lmcache_lp_async", 300, 4),
        ("strata", 300, 4),
        ("waiting_first", 150, 4),  # not opted in: never fast-forwarded, still equal
    ],
)
def test_fast_forward_changes_no_record_or_metric(policy: str, requests: int, engines: int) -> None:
    cfg = config(requests, policy, engines=engines)
    fast, asked_fast = replay(cfg, True)
    slow, asked_slow = replay(cfg, False)
    assert fast["records"] and len(fast["records"]) == requests
    assert_same(fast, slow)
    if policy == "waiting_first":
        assert asked_fast == asked_slow
    elif engines > 1:  # a sized cluster: most steps are steady decodes
        assert asked_fast < asked_slow / 2, (asked_fast, asked_slow)
    else:
        assert asked_fast < asked_slow


def test_a_closed_loop_client_is_not_run_ahead() -> None:
    """A client capped at 16 requests in flight sends the next when one finishes, on any engine: no
    engine may run ahead of another's finishes (``Cluster._isolated``)."""
    cfg = config(300, "fcfs", engines=4).with_overrides(max_outstanding_requests=16)
    fast, asked_fast = replay(cfg, True)
    slow, asked_slow = replay(cfg, False)
    assert len(fast["records"]) == 300
    assert_same(fast, slow)
    assert asked_fast < asked_slow


def test_only_policies_that_opt_in_are_fast_forwarded() -> None:
    assert Policy.steady_decode is not Fcfs.steady_decode
    assert HiCache.steady_decode is not Policy.steady_decode

    class Reordering(Fcfs):  # a new schedule does not inherit fcfs's opt-in
        def schedule(self, view: SchedulerView) -> SchedulerDecision:
            decision = super().schedule(view)
            decision.decode.reverse()
            return decision

    assert Reordering.steady_decode is Policy.steady_decode

    class Same(Fcfs):  # nor is it lost where schedule stays fcfs's
        pass

    assert Same.steady_decode is Fcfs.steady_decode


def _two_requests(arrival_s: float) -> Iterator[Request]:
    """A long decode (one request, alone) and a second request arriving in the middle of it."""
    yield Request(0, 0.0, 600, 900, (1, 2))
    yield Request(1, arrival_s, 300, 5, (3,))


@pytest.mark.parametrize("arrival_s", [0.5, 1.0, 2.0, 3.3])
def test_an_arrival_in_a_decode_run_is_admitted_at_the_next_step(arrival_s: float) -> None:
    cfg = config(2, "fcfs")
    fast, asked_fast = replay(cfg, True, _two_requests(arrival_s))
    slow, asked_slow = replay(cfg, False, _two_requests(arrival_s))
    assert_same(fast, slow)
    assert asked_fast < asked_slow / 10  # the lone decode ran fast, before and after the arrival
    second = next(r for r in fast["records"] if r["output_tokens"] == 5)
    ttft_s = float(second["first_token_s"]) - float(second["arrival_s"])
    assert 0 < ttft_s < 0.2  # admitted at the first step after it arrived, not after the long one


def test_a_decode_that_needs_a_new_block_takes_it() -> None:
    """Four device blocks: the long request grows from two blocks to three (its 1,025th token) in a
    decode run; the second (two blocks) must then wait for it to finish, as without the run."""
    cfg = config(2, "fcfs").with_overrides(device_blocks=4)

    def requests() -> Iterator[Request]:
        yield Request(0, 0.0, 600, 900, (1, 2))
        yield Request(1, 5.0, 700, 5, (3, 4))

    fast, asked_fast = replay(cfg, True, requests())
    slow, asked_slow = replay(cfg, False, requests())
    assert_same(fast, slow)
    assert asked_fast < asked_slow / 2  # fast until the second arrives (then it waits: slow)
    first, second = fast["records"]
    assert float(second["first_token_s"]) >= float(first["finish_s"])  # it waited for the blocks


def test_every_planned_decode_holds_the_block_of_its_token() -> None:
    """Steps run ahead leave the step that crosses into a new block to the slow path, which
    allocates it: every decode a step ends holds the block its token goes in (one block short at
    the crossing fails here, though the records may not show it)."""
    cfg = config(2, "fcfs").with_overrides(device_blocks=4)
    sim = build(cfg)
    engine = sim.cluster.engines[0]  # type: ignore[attr-defined]
    end_step = engine.end_step
    ended = [0]

    def checked(step: Any) -> None:
        for (r, epoch), context in zip(step.decodes, step.decode_contexts, strict=True):
            held = r.locked_blocks + r.private_blocks + r.reserved_blocks
            assert epoch != r.epoch or context + 1 <= held * engine.block_tokens, (context, held)
        ended[0] += 1
        end_step(step)

    engine.end_step = checked

    def requests() -> Iterator[Request]:
        yield Request(0, 0.0, 600, 900, (1, 2))
        yield Request(1, 5.0, 700, 5, (3, 4))

    sim.cluster.feed(requests())  # type: ignore[attr-defined]
    sim.loop.run()
    assert sim.metrics.requests == 2
    assert ended[0] < sim.loop.events_run / 4  # most steps ran ahead, without an event


def test_steps_run_ahead_on_a_sized_cluster() -> None:
    """On four engines most steady decode steps end inside one loop, not as events."""
    cfg = config(400, "hicache", engines=4)
    sim = build(cfg)
    sim.cluster.feed(workload(cfg))  # type: ignore[attr-defined]
    sim.loop.run(until_s=cfg.max_sim_s)
    assert sim.metrics.requests == 400
    assert sim.loop._seq < sim.loop.events_run / 2  # events scheduled, against events counted
