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

import kvtier.sim.engine as engine_module
from kvtier.bench.sim import config
from kvtier.sched import make_policy
from kvtier.sched.base import LoadMode, Phase, Policy, RequestView, SchedulerDecision, SchedulerView
from kvtier.sched.claims import running_claims
from kvtier.sched.fcfs import Fcfs
from kvtier.sched.hicache import HiCache
from kvtier.sched.swap_copy import SWAP_ENGINES
from kvtier.sim.config import SimConfig
from kvtier.sim.fast_forward import next_step
from kvtier.sim.metrics import RequestRecord
from kvtier.sim.request import Request
from kvtier.sim.run import build, workload
from kvtier.tiers import Tier


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


def _recording(sim: Any) -> list[Any]:
    """The list every finished request's record is appended to (as :func:`_state`), in finish order."""
    records: list[Any] = []
    add = sim.metrics.add_request

    def record(r: RequestRecord) -> None:
        records.append(_state(r))
        add(r)

    sim.metrics.add_request = record
    return records


def replay(
    cfg: SimConfig, fast_forward: bool, requests: Iterator[Request] | None = None
) -> tuple[dict[str, Any], int]:
    """Every record in finish order, the whole metrics, events and clock; and how many steps the
    policies were asked to decide."""
    sim = build(cfg)
    records = _recording(sim)
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
        ("waiting_first", 300, 4),
        ("swapped_first", 300, 4),
        ("shadowserve_async", 300, 4),
        ("cachegen_async", 300, 4),
        ("rotasched", 300, 5),
        ("composed", 300, 5),
        ("waiting_first+duplexkv", 300, 4),  # eager rotation under a static swap policy
    ],
)
def test_fast_forward_changes_no_record_or_metric(policy: str, requests: int, engines: int) -> None:
    if policy.endswith("+duplexkv"):
        cfg = config(requests, policy.split("+")[0], engines=engines).with_overrides(
            swap={"engine": "duplexkv"}
        )
    else:
        cfg = config(requests, policy, engines=engines)
    fast, asked_fast = replay(cfg, True)
    slow, asked_slow = replay(cfg, False)
    assert fast["records"] and len(fast["records"]) == requests
    assert_same(fast, slow)
    if engines > 1:  # a sized cluster: most steps are steady decodes
        assert asked_fast < asked_slow / 2, (asked_fast, asked_slow)
    else:
        assert asked_fast < asked_slow


@pytest.mark.parametrize("policy", ["shadowserve_async", "cachegen_async"])
def test_batch_interception_with_every_prompt_fetched_changes_nothing(policy: str) -> None:
    """Every prompt's KV in the remote store (ShadowServe's §6.1 setting): requests are intercepted
    and fetched while others decode; the steps between are still planned without the policy."""
    cfg = config(200, policy, engines=4).with_overrides(preload_tier="remote", remote_capacity_bytes="inf")
    fast, asked_fast = replay(cfg, True)
    slow, asked_slow = replay(cfg, False)
    assert len(fast["records"]) == 200
    assert_same(fast, slow)
    assert asked_fast < asked_slow / 2, (asked_fast, asked_slow)


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


class _NoCost:
    def prefill_s(self, new_tokens: int, context_tokens: int) -> float:
        return 0.0

    def load_s(self, tokens: int, tier: Tier, mode: LoadMode) -> float:
        return 0.0


def _decoding(generated: int, free: int, prompts: tuple[int, ...] = (32, 48)) -> SchedulerView:
    """Requests past their prefill, decoding, on 16-token blocks; nothing else on the engine."""
    running = tuple(RequestView(i, 0.0, Phase.RUNNING, p, p, generated) for i, p in enumerate(prompts))
    return SchedulerView(
        now_s=1.0,
        waiting=(),
        running=running,
        fetching=(),
        swapped=(),
        free_device_blocks=free,
        free_host_blocks=None,
        block_tokens=16,
        max_batch_tokens=4096,
        max_running=256,
        num_layers=32,
        cost=_NoCost(),
        swap_copy=SWAP_ENGINES["vllm"],
    )


@pytest.mark.parametrize("policy", ["waiting_first", "swapped_first", "rotasched", "composed"])
def test_a_swapping_policys_steady_view_decodes_every_running_request_in_every_later_one(
    policy: str,
) -> None:
    """Where ``steady_decode`` says yes, the policy decodes every running request in that view and in
    each later one with more tokens generated and fewer free blocks by what this step may take (its
    claims). Its claims count blocks from tokens, so a later step can claim one per request; with
    only the waiting/fetching/swapped check (``steady_fcfs``) this fails (free 0, claims 0 now)."""
    p = make_policy(policy)
    steady = 0
    for generated in range(1, 40):
        for free in range(6):
            view = _decoding(generated, free)
            if not p.steady_decode(view):
                continue
            steady += 1
            left = free - running_claims(view)
            for later in range(generated, generated + 40):
                decision = p.schedule(_decoding(later, left))
                assert decision.decode == [0, 1], (generated, free, later)
                assert not (decision.prefill or decision.swap_out or decision.swap_in or decision.preempt)
    assert steady > 100
    # Claiming nothing now, with one block free: the plain decode now, but not once both cross.
    assert p.schedule(_decoding(15, 1)).decode == [0, 1] and not p.steady_decode(_decoding(15, 1))
    assert p.schedule(_decoding(16, 1)).decode != [0, 1]


def _swapping() -> Iterator[Request]:
    """Two long decodes, then a long prompt, on a 14-block device (512-token blocks): requests swap
    out and back in, with steady decode runs between."""
    spec = [(0.0, 1024, 3000), (0.05, 1024, 3000), (12.0, 5120, 50), (30.0, 512, 1500)]
    for i, (arrival_s, prompt, output) in enumerate(spec):
        yield Request(i, arrival_s, prompt, output, tuple(range(100 * i, 100 * i + -(-prompt // 512))))


@pytest.mark.parametrize("policy", ["waiting_first", "swapped_first"])
def test_a_static_swap_policy_decides_the_plain_decode_at_every_fast_step(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At every step the fast-forward plans, the policy asked on the view the slow path would build
    decodes every running request in order and orders nothing else, on an engine short of blocks
    (swaps out and in); and the replay equals the one without the fast-forward."""
    cfg = config(4, policy).with_overrides(device_blocks=14)
    slow, _ = replay(cfg, False, _swapping())
    sim = build(cfg)
    planned, swaps = [0], [0, 0]
    engine = sim.cluster.engines[0]  # type: ignore[attr-defined]
    engine.isolated = None  # one step a time: each is checked here
    schedule = engine.policy.schedule

    def counted(view: SchedulerView) -> SchedulerDecision:
        decision: SchedulerDecision = schedule(view)
        swaps[0] += len(decision.swap_out)
        swaps[1] += len(decision.swap_in)
        return decision

    engine.policy.schedule = counted

    def checked(engine: Any) -> bool:
        view = engine.view() if engine.decode_run is not None else None
        if not next_step(engine):
            return False
        assert view is not None
        decision = schedule(view)
        assert decision.decode == [r.req_id for r in view.running]
        assert not (
            decision.prefill or decision.loads or decision.swap_out or decision.swap_in or decision.preempt
        )
        planned[0] += 1
        return True

    monkeypatch.setattr(engine_module, "next_step", checked)
    records = _recording(sim)
    sim.cluster.feed(_swapping())  # type: ignore[attr-defined]
    sim.loop.run(until_s=cfg.max_sim_s)
    assert records == slow["records"] and sim.loop.events_run == slow["events"]
    assert planned[0] > 2000 and swaps[0] > 0 and swaps[1] > 0, (planned, swaps)
