"""The decision executor (kvtier.sched.executor): one order and one validation for both step loops.

A recording backend checks the order and the errors without an engine; the reference engine checks
that a host prefetch (``LoadOrder(target=Tier.HOST)``, Strata §4.3.3) is carried out, not dropped, and
that an order it cannot carry out raises.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvtier.engine import LLM, EngineConfig, Model, SamplingParams, Tokenizer, llm_store_config
from kvtier.engine.errors import EngineError
from kvtier.sched import LoadMode, LoadOrder, Phase, Policy, SchedulerDecision, SchedulerView
from kvtier.sched.batching import admit_fcfs, schedule_running
from kvtier.sched.executor import execute
from kvtier.store import Store
from kvtier.tiers import Tier


class _Rejected(Exception):
    pass


@dataclass(eq=False)
class _Req:
    req_id: int
    phase: Phase
    epoch: int = 0
    prefill_done: bool = False


class _NamedPolicy(Policy):
    name = "test-executor"

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        return SchedulerDecision()


@dataclass
class _Backend:
    """Records each order; ``preempt`` and ``swap_out`` move the request off the device."""

    requests: dict[int, _Req]
    calls: list[tuple[str, int]] = field(default_factory=list)
    policy: Policy = field(default_factory=_NamedPolicy)

    def error(self, message: str) -> Exception:
        return _Rejected(message)

    def find(self, req_id: int) -> _Req | None:
        return self.requests.get(req_id)

    def preempt(self, r: _Req) -> None:
        self.calls.append(("preempt", r.req_id))
        r.phase, r.epoch = Phase.WAITING, r.epoch + 1

    def swap_out(self, r: _Req) -> None:
        self.calls.append(("swap_out", r.req_id))
        r.phase, r.epoch = Phase.SWAPPED, r.epoch + 1

    def swap_in(self, r: _Req) -> None:
        self.calls.append(("swap_in", r.req_id))

    def end_swaps(self) -> None:
        self.calls.append(("end_swaps", -1))

    def plan_prefill(self, plan: list[int], r: _Req, tokens: int, load: LoadOrder | None) -> None:
        self.calls.append(("prefill+load" if load else "prefill", r.req_id))
        plan.append(r.req_id)

    def plan_decode(self, plan: list[int], r: _Req) -> None:
        self.calls.append(("decode", r.req_id))
        plan.append(r.req_id)

    def start_load(self, r: _Req, load: LoadOrder) -> None:
        self.calls.append(("start_load", r.req_id))

    def prefetch(self, r: _Req, load: LoadOrder) -> None:
        self.calls.append(("prefetch", r.req_id))


def _backend() -> _Backend:
    return _Backend(
        {
            0: _Req(0, Phase.RUNNING, prefill_done=True),
            1: _Req(1, Phase.RUNNING, prefill_done=True),
            2: _Req(2, Phase.SWAPPED),
            3: _Req(3, Phase.WAITING),
            4: _Req(4, Phase.WAITING),
            5: _Req(5, Phase.WAITING),
            6: _Req(6, Phase.RUNNING, prefill_done=True),
        }
    )


def test_orders_run_in_one_order_and_work_for_a_request_that_left_is_dropped() -> None:
    backend, plan = _backend(), list[int]()
    decision = SchedulerDecision(
        prefill=[(3, 8), (4, 8)],
        decode=[0, 6, 1],
        loads=[
            LoadOrder(5, 16, LoadMode.ASYNC, target=Tier.HOST),
            LoadOrder(4, 16, LoadMode.ASYNC),
            LoadOrder(6, 16, LoadMode.ASYNC),
        ],
        preempt=[1],
        swap_out=[6],
        swap_in=[2],
    )
    execute(decision, backend, plan)
    assert backend.calls == [
        ("preempt", 1),
        ("swap_out", 6),
        ("swap_in", 2),
        ("end_swaps", -1),
        ("prefill", 3),
        ("prefill+load", 4),
        ("decode", 0),  # 6 and 1 left the device in this step: their decodes are dropped
        ("prefetch", 5),
        ("start_load", 6),  # its load had no prefill to ride on; the backend decides what it can do
    ]
    assert plan == [3, 4, 0]


@pytest.mark.parametrize(
    ("decision", "message"),
    [
        (SchedulerDecision(decode=[99]), "decode unknown request 99"),
        (SchedulerDecision(loads=[LoadOrder(99, 16, LoadMode.SYNC)]), "load unknown request 99"),
        (SchedulerDecision(preempt=[2]), "preempts request 2 in phase swapped"),
        (SchedulerDecision(swap_out=[3]), "swaps out request 3 in phase waiting"),
        (SchedulerDecision(swap_in=[0]), "swaps in request 0 in phase running"),
        (SchedulerDecision(decode=[3]), r"decodes request 3 \(waiting\) before its prefill is done"),
        (SchedulerDecision(prefill=[(3, 8)], decode=[3]), "plans a request twice"),
        (SchedulerDecision(loads=[LoadOrder(3, 16, LoadMode.SYNC, target=Tier.SSD)]), "load target 'ssd'"),
        (
            SchedulerDecision(loads=[LoadOrder(3, 16, LoadMode.SYNC), LoadOrder(3, 8, LoadMode.SYNC)]),
            "two loads for request 3",
        ),
        (
            SchedulerDecision(prefill=[(3, 8)], loads=[LoadOrder(3, 16, LoadMode.ASYNC, target=Tier.HOST)]),
            "prefills request 3 and prefetches it",
        ),
        (
            SchedulerDecision(loads=[LoadOrder(0, 16, LoadMode.ASYNC, target=Tier.HOST)]),
            "prefetches request 0 in phase running",
        ),
    ],
)
def test_an_order_the_executor_cannot_apply_raises(decision: SchedulerDecision, message: str) -> None:
    backend = _backend()
    with pytest.raises(_Rejected, match=message):
        execute(decision, backend, [])


def test_validation_comes_before_anything_moves() -> None:
    backend = _backend()
    decision = SchedulerDecision(preempt=[0], loads=[LoadOrder(3, 16, LoadMode.SYNC, target="nowhere")])
    with pytest.raises(_Rejected):
        execute(decision, backend, [])
    assert backend.calls == [] and backend.requests[0].phase is Phase.RUNNING


# ------------------------------------------------------------------------------------------------
# The reference engine as a backend

PROMPT = "Name three rivers in Europe and say which country each one flows through, in one sentence each."
BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4
OBJECT_BYTES = -(-(64 + BLOCK_BYTES) // 4096) * 4096
PARAMS = SamplingParams(max_tokens=6)


class _PrefetchFirst(Policy):
    """Step 1: prefetches every waiting request's stored prefix to host, and schedules nothing;
    then FCFS with a synchronous load of whatever is cached below the device."""

    name = "test-prefetch-first"

    def __init__(self, load: str = "device") -> None:
        self.steps = 0
        self.load = load

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        self.steps += 1
        if self.steps == 1:
            stored = [r for r in view.waiting if r.cached_tokens[Tier.SSD] + r.cached_tokens[Tier.REMOTE]]
            return SchedulerDecision(
                loads=[
                    LoadOrder(
                        r.req_id,
                        r.cached_tokens[Tier.SSD] + r.cached_tokens[Tier.REMOTE],
                        LoadMode.ASYNC,
                        2,
                        Tier.HOST,
                    )
                    for r in stored
                ]
            )
        decision = SchedulerDecision()
        budget = schedule_running(view, decision)
        admit_fcfs(view, decision, budget, LoadMode.SYNC)
        if self.load == "running":  # a load for a request already on the device
            decision.loads += [LoadOrder(r.req_id, 16, LoadMode.SYNC) for r in view.running[:1]]
        return decision


@pytest.fixture(scope="module")
def parts(smollm2: tuple[Model, Tokenizer]) -> tuple[Model, Tokenizer]:
    return smollm2


@pytest.fixture(scope="module")
def prompt(parts: tuple[Model, Tokenizer]) -> list[int]:
    return parts[1].encode_instruct(PROMPT)


def test_the_reference_engine_carries_out_a_host_prefetch(parts, prompt, tmp_path: Path) -> None:
    """Once dropped silently by the engine (the simulator executed it): the SSD-only prefix is in
    the store's DRAM after the prefetch step, and the request then loads it from there."""
    model, tokenizer = parts
    ssd = {"directory": str(tmp_path), "capacity_bytes": "128MiB", "probe_bytes": 0}
    writer = Store(
        llm_store_config(dram={"capacity_bytes": 64 * OBJECT_BYTES}, ssd={**ssd, "write_through": True})
    )
    [recompute] = LLM(model=model, tokenizer=tokenizer, store=writer).generate([prompt], PARAMS)
    writer.flush()
    del writer
    gc.collect()
    store = Store(llm_store_config(dram={"capacity_bytes": 64 * OBJECT_BYTES}, ssd=ssd))  # DRAM starts empty
    cap = (len(prompt) - 1) // 16
    keys = store.namespace.block_keys(prompt)[:cap]
    assert set(store.lookup(keys).tiers) == {"ssd"}
    config = EngineConfig(offload="write_through")
    llm = LLM(model=model, tokenizer=tokenizer, config=config, store=store, policy=_PrefetchFirst())
    rid = llm.engine.add_request(prompt, PARAMS, tokenizer.stop_token_ids)
    assert llm.engine.step() == 0  # the prefetch step computes nothing
    assert store.lookup(keys).tiers == ("dram",) * cap, "the prefetch was not carried out"
    assert llm.engine.stats.prefetched_blocks == cap
    [out] = [o for o in llm.engine.run() if o.request_id == rid]
    assert out.token_ids == recompute.token_ids
    assert out.cached_tokens["host"] == cap * 16 and out.cached_tokens["ssd"] == 0


def test_the_reference_engine_refuses_what_it_cannot_do(parts, prompt) -> None:
    model, tokenizer = parts
    store = Store(llm_store_config(dram={"capacity_bytes": 64 * OBJECT_BYTES}))
    LLM(model=model, tokenizer=tokenizer, store=store).generate([prompt], PARAMS)
    # A load for a running request: the engine loads from the store only at admission.
    config = EngineConfig(offload="write_through")
    llm = LLM(model=model, tokenizer=tokenizer, config=config, store=store, policy=_PrefetchFirst("running"))
    with pytest.raises(EngineError, match=r"loads a prefix for request \d+ \(running\)"):
        llm.generate([prompt, prompt], PARAMS)
    # A prefetch with no store below the device.
    engine = LLM(model=model, tokenizer=tokenizer, config=EngineConfig()).engine
    rid = engine.add_request(prompt, PARAMS)
    decision = SchedulerDecision(loads=[LoadOrder(rid, 64, LoadMode.ASYNC, target=Tier.HOST)])
    with pytest.raises(EngineError, match="no store"):
        execute(decision, engine, [])
