"""The composed policy (kvtier.sched.composed): on hand-built views its decision keeps each piece's
own decision (Strata's deferral and batch, RotaSched's rotation, ShadowServe's interception, the
unified pool's placement), each piece can be switched off, and a short simulation runs it."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvtier.errors import ConfigError
from kvtier.sched import make_policy, policy_names
from kvtier.sched.base import LoadMode, Phase, RequestView, SchedulerDecision, SchedulerView
from kvtier.sched.composed import Composed, stages_from_pieces
from kvtier.sched.data_plane import default_engine, policy_spec
from kvtier.sched.load_path import LOAD_ENGINES
from kvtier.sched.rotasched import RotaSched
from kvtier.sched.strata import Strata
from kvtier.sched.swap_copy import SWAP_ENGINES
from kvtier.sched.view_fill import sub_view
from kvtier.sim.config import SimConfig, resolve_deprecated
from kvtier.sim.run import run
from kvtier.tiers import Tier

BT = 32
DOC = 4096  # a context of 128 blocks

ONLY_BALANCE = {"stages": ["balance"]}


class Cost:
    """Llama-8B-like estimates (as tests/test_sched_strata.py)."""

    def prefill_s(self, new_tokens: int, context_tokens: int) -> float:
        return 1e-3 + 3e-5 * new_tokens + 1e-9 * new_tokens * context_tokens

    def load_s(self, tokens: int, tier: Tier, mode: LoadMode) -> float:
        segment_tokens = LOAD_ENGINES["gpu_kernel"].segment_tokens(mode, tokens)  # composed's balance stage
        per_token = 2.6e-6 if segment_tokens is None or segment_tokens >= 256 else 1.2e-5
        return tokens * per_token


def keys(doc: int, blocks: int = DOC // BT) -> tuple[int, ...]:
    return tuple(doc * 10_000 + i for i in range(blocks))


def waiting(
    rid: int,
    doc: int,
    cached: tuple[int, int, int, int] = (0, 0, 0, 0),
    arrival: float | None = None,
    **kw: int,
) -> RequestView:
    return RequestView(
        rid,
        float(rid) if arrival is None else arrival,
        Phase.WAITING,
        DOC + 32,
        0,
        0,
        cached_tokens=cached,
        block_keys=(*keys(doc), 1_000_000 + rid),
        **kw,
    )


def running(rid: int, arrival: float = 0.0, prompt: int = 64, generated: int = 5) -> RequestView:
    return RequestView(rid, arrival, Phase.RUNNING, prompt, prompt, generated)


def view(
    waiting: tuple[RequestView, ...] = (),
    running: tuple[RequestView, ...] = (),
    swapped: tuple[RequestView, ...] = (),
    free: int = 100_000,
    now: float = 0.0,
    max_batch_tokens: int = 8192,
) -> SchedulerView:
    return SchedulerView(
        now_s=now,
        waiting=waiting,
        running=running,
        fetching=(),
        swapped=swapped,
        free_device_blocks=free,
        free_host_blocks=None,
        block_tokens=BT,
        max_batch_tokens=max_batch_tokens,
        max_running=256,
        num_layers=32,
        cost=Cost(),
        swap_copy=SWAP_ENGINES["duplexkv"],  # the engine's swap path the rotation stage was built for
    )


def prefilled(d: SchedulerDecision) -> list[int]:
    return [rid for rid, _ in d.prefill]


# ------------------------------------------------------------------------------------------------
# Registry and configuration


def test_composed_is_registered_and_rejects_bad_parameters() -> None:
    assert "composed" in policy_names()
    p = make_policy("composed", stages=["async_fetch", "balance"], xfer_blocks=7)
    assert isinstance(p, Composed) and p.stages == ("async_fetch", "balance")
    assert p.params()["xfer_blocks"] == 7 and p.params()["stages"] == ["async_fetch", "balance"]
    assert Composed().stages == ("rotation", "async_fetch", "balance")
    for bad in (
        ["balance", "rotation"],
        ["balance", "balance"],
        ["pool"],
        ["balance", "async_load"],
        "balance",
    ):
        with pytest.raises(ConfigError, match="stage"):
            make_policy("composed", stages=bad)
    with pytest.raises(ConfigError):
        make_policy("composed", strata={"io": "dma"})  # Strata's own validation
    with pytest.raises(ConfigError):
        make_policy("composed", rotasched={"no_such": 1})
    with pytest.raises(ConfigError):
        make_policy("composed", fetch_min_tokens=-1)


def test_old_booleans_warn_and_mean_the_same_stages() -> None:
    cases = {
        (True, True, True, True): ("rotation", "async_fetch", "balance"),
        (False, True, True, True): ("async_fetch", "balance"),
        (True, True, False, True): ("rotation", "async_fetch", "async_load"),
        (False, False, False, False): (),
        (False, False, True, False): ("balance",),
    }
    for (rotation, async_fetch, balance, pool), stages in cases.items():
        assert stages_from_pieces(rotation, async_fetch, balance, pool) == stages
    with pytest.warns(DeprecationWarning, match=r"stages: \['rotation', 'async_fetch', 'async_load'\]"):
        assert Composed(balance=False).stages == ("rotation", "async_fetch", "async_load")
    with pytest.raises(ConfigError, match="not both"):
        Composed(stages=["balance"], rotation=False)


def test_pool_layout_is_config_and_the_old_spelling_fills_it() -> None:
    # The layout is data-plane config: the policy carries none. A composed config in the old
    # spelling (no stages, `pool` on by default) fills the unified pool's layout where the run's
    # `pool` section leaves it out (one release, with a warning); the new spelling fills nothing.
    assert not hasattr(Composed(), "pool_layout") and not hasattr(Composed(), "place")
    base = SimConfig(policy={"name": "composed"}, pool={"dram_modules": 2})
    with pytest.warns(DeprecationWarning, match="pool.layout"):
        assert resolve_deprecated(base).pool == {"dram_modules": 2, "layout": "pooled", "passthrough": True}
    off = base.with_overrides(policy={"name": "composed", "pool": False})
    assert resolve_deprecated(off).pool == {"dram_modules": 2}
    with pytest.warns(DeprecationWarning):
        explicit = resolve_deprecated(base.with_overrides(pool={"layout": "serial"}))
    assert explicit.pool == {"layout": "serial", "passthrough": True}
    new = base.with_overrides(policy={"name": "composed", "stages": ["balance"]})
    assert resolve_deprecated(new) is new


def test_rotation_piece_brings_duplexkv_swaps() -> None:
    # The swap engine a config naming none gets (the sim config's `swap` section overrides it).
    assert default_engine({"name": "composed"}, "swap") == "duplexkv"
    assert default_engine(policy_spec(Composed()), "swap") == "duplexkv"
    assert default_engine({"name": "composed", "rotation": True, "balance": False}, "swap") == "duplexkv"
    # Without rotation the composition never swaps: the engine's plain swap.
    assert default_engine(policy_spec(Composed(stages=["balance"])), "swap") == "plain"
    assert default_engine({"name": "composed", "rotation": False}, "swap") == "plain"
    assert default_engine({"name": "composed"}, "fetch") == "bluefield3"  # async_fetch's SmartNIC


# ------------------------------------------------------------------------------------------------
# Strata's pieces survive composition


def test_with_only_balance_on_the_decision_is_strata_s() -> None:
    decoding = running(9, prompt=100)
    cases = [
        view((waiting(0, 1, (0, DOC, 0, 0)),), running=(decoding,)),  # loading-bound: async
        view((waiting(0, 1, (0, DOC, 0, 0)), waiting(1, 2, (0, DOC, 0, 0)), waiting(2, 3))),  # Fig. 7
        view((waiting(0, 1, in_flight_tokens=128),)),  # delay hit: deferred
        view(
            (waiting(5, 7, (0, 0, DOC, 0)),), running=(RequestView(9, 0.0, Phase.RUNNING, 20_000, 1000, 0),)
        ),
    ]
    for v in cases:
        assert Composed(**ONLY_BALANCE).schedule(v) == Strata().schedule(v)


def test_delay_hit_is_still_deferred_with_every_piece_on() -> None:
    # No HBM contention: LVF falls back to FCFS and lets both in; Strata then defers the second,
    # whose context the first is already computing (in flight beyond the 100-token threshold).
    first = waiting(0, 1)
    second = waiting(1, 2, in_flight_tokens=DOC)
    d = Composed().schedule(view((first, second)))
    assert prefilled(d) == [0]
    assert prefilled(
        Composed(stages=["rotation", "async_fetch", "async_load"]).schedule(view((first, second)))
    ) == [0, 1]


def test_strata_batch_formation_holds_back_a_second_load_with_every_piece_on() -> None:
    # Fig. 7: two host hits and a miss, budget for two: Strata pairs a hit with the miss.
    v = view(
        (waiting(0, 1, (0, DOC, 0, 0)), waiting(1, 2, (0, DOC, 0, 0)), waiting(2, 3)),
        max_batch_tokens=32 + DOC + 32,
    )
    composed = Composed().schedule(v)
    assert prefilled(composed) == [0, 2] and [o.req_id for o in composed.loads] == [0]
    fcfs = Composed(stages=["rotation", "async_fetch"]).schedule(v)  # both hits load in one step
    assert prefilled(fcfs) == [0, 1, 2] and [o.req_id for o in fcfs.loads] == [0, 1]


# ------------------------------------------------------------------------------------------------
# RotaSched's rotation survives composition


def _contended(now: float, free: int = 1) -> SchedulerView:
    """HBM nearly full: two running requests (3 blocks each), a rotary one (3) and a waiting one (2)."""
    old = running(1, arrival=0.0)
    new = running(2, arrival=1.0)
    rotary = RequestView(4, 0.5, Phase.SWAPPED, 64, 64, 5)
    late = RequestView(3, 2.0, Phase.WAITING, 64, 0, 0, block_keys=(31, 32))
    return view((late,), running=(old, new), swapped=(rotary,), free=free, now=now)


def test_rotation_swaps_like_rotasched_with_every_piece_on() -> None:
    rota = RotaSched(alpha=1.0, beta_b=0.0, beta_f=0.0, xfer_blocks=3)
    comp = Composed(xfer_blocks=3, rotasched={"alpha": 1.0, "beta_b": 0.0, "beta_f": 0.0})
    # First sights: request 1 runs from t=0, request 2 from t=1; request 4's last token was at t=0.
    for policy in (rota, comp):
        first = _contended(0.0)
        policy.schedule(dataclasses.replace(first, running=first.running[:1], waiting=()))
        policy.schedule(dataclasses.replace(_contended(1.0), swapped=(), waiting=()))
    expected = rota.schedule(_contended(3.0))
    got = comp.schedule(_contended(3.0))
    assert expected.swap_out == [1]  # the longest-running request rotates out
    assert expected.swap_in == [4]  # the most lagging rotary request rotates in
    assert (got.swap_out, got.swap_in) == (expected.swap_out, expected.swap_in)
    assert 1 not in got.decode and 2 in got.decode  # the rotated-out request does not decode
    # Without rotation nothing is swapped: the engine's passive preemption is left to act.
    plain = Composed(stages=["async_fetch", "balance"]).schedule(_contended(3.0))
    assert plain.swap_out == [] and plain.swap_in == []


def test_rotation_holds_back_admission_when_hbm_is_contended() -> None:
    # LVF prioritises only waiting requests with VLT >= 0 that fit B_HBM + B_xfer; with B_xfer = 0
    # and no free block nobody is admitted, whatever Strata would have batched.
    v = _contended(3.0)
    assert Composed(xfer_blocks=0).schedule(dataclasses.replace(v, free_device_blocks=0)).prefill == []
    assert prefilled(
        Composed(stages=["balance"]).schedule(dataclasses.replace(v, free_device_blocks=10))
    ) == [3]


# ------------------------------------------------------------------------------------------------
# ShadowServe's interception survives composition


def test_remote_hits_are_intercepted_into_the_fetching_queue() -> None:
    remote = waiting(0, 1, (0, 0, 0, DOC))
    host = waiting(1, 2, (0, DOC, 0, 0))
    d = Composed().schedule(view((remote, host)))
    fetch = next(o for o in d.loads if o.req_id == 0)
    assert fetch.mode is LoadMode.ASYNC and fetch.target is Tier.DEVICE
    assert fetch.compressed  # through the engine's fetch path (the SmartNIC pipeline by default)
    assert fetch.tokens == DOC
    assert 0 not in prefilled(d)  # stripped from the batch
    assert 1 in prefilled(d)  # the host hit is Strata's
    # A second intercepted fetch queues behind the first (serial FIFO classes, §4.1).
    d2 = Composed().schedule(view((remote, waiting(2, 3, (0, 0, 0, DOC)))))
    assert [o.priority for o in d2.loads if o.req_id in (0, 2)] == [1, 2]
    # Without async_fetch Strata prefetches the remote prefix to host while the request queues.
    chunk = RequestView(9, 0.0, Phase.RUNNING, 20_000, 1000, 0)  # takes the whole token budget
    off = Composed(stages=["rotation", "balance"]).schedule(view((remote,), running=(chunk,)))
    assert [(o.req_id, o.target) for o in off.loads if o.req_id == 0] == [(0, Tier.HOST)]


def test_small_remote_hits_are_not_intercepted() -> None:
    tiny = waiting(0, 1, (0, 0, 0, 64))  # 64 <= 100 tokens: not worth a fetch
    d = Composed().schedule(view((tiny,)))
    assert all(o.mode is not LoadMode.ASYNC or o.target is not Tier.DEVICE for o in d.loads)
    assert prefilled(d) == [0]


# ------------------------------------------------------------------------------------------------
# The unified pool's async loading when Strata is off


def test_without_balance_the_pool_fetches_hits_while_they_queue() -> None:
    hit = waiting(0, 1, (0, DOC, 0, 0))
    d = Composed(stages=["async_load"]).schedule(view((hit,)))
    assert [(o.req_id, o.mode) for o in d.loads] == [(0, LoadMode.ASYNC)]
    assert d.prefill == []  # it prefills once its KV landed
    fcfs = Composed(stages=[]).schedule(view((hit,)))
    assert [(o.req_id, o.mode) for o in fcfs.loads] == [(0, LoadMode.LAYERWISE)]


# ------------------------------------------------------------------------------------------------
# End to end


def _agentic(policy: dict[str, object]) -> dict[str, object]:
    config = SimConfig(
        name="composed-e2e",
        hardware="h100-sxm",
        model="llama-3.1-8b",
        policy=policy,
        block_tokens=64,
        host_capacity_bytes="64GiB",
        remote_capacity_bytes="inf",
        device_blocks=3000,  # 192K tokens of HBM: the trajectories contend for it
        workload={"name": "agentic", "dataset": "32k", "num_trajectories": 6, "rate_per_s": 2.0},
        slo={"ttft_s": 5.0, "tpot_s": 0.1},
    )
    return run(config)


def test_composed_serves_an_agentic_burst_and_balance_alone_matches_strata() -> None:
    full = _agentic({"name": "composed", "xfer_blocks": 600})
    assert full["unfinished_requests"] == 0 and full["requests"] > 6
    assert full["hit_rate_tokens"]["total"] > 0.5  # steps reuse their trajectory's context
    strata = _agentic({"name": "strata"})
    alone = _agentic({"name": "composed", **ONLY_BALANCE})
    for key in ("requests", "ttft_s", "tpot_s", "hit_rate_tokens", "preemptions", "steps"):
        assert alone[key] == strata[key], key


def test_sub_view_is_dataclasses_replace() -> None:
    """The composed policy's sub-views (``sub_view``): every field as ``dataclasses.replace`` sets
    it, for each field changed alone and several at once; an unknown field raises."""
    r = RequestView(7, 1.5, Phase.WAITING, 64, 0, 0)
    view = SchedulerView(2.0, (r,), (), (), (), 12, 30, 16, 512, 8, 4, _SubViewCost(), 128)
    changes: dict[str, Any] = {
        "waiting": (),
        "running": (r,),
        "swapped": (r,),
        "free_device_blocks": 3,
        "max_running": 2,
        "max_batch_tokens": 77,
        "free_host_blocks": None,
        "layerwise_prefill": True,
    }
    for name, value in changes.items():
        assert sub_view(view, **{name: value}) == dataclasses.replace(view, **{name: value})
    assert sub_view(view, **changes) == dataclasses.replace(view, **changes)
    assert sub_view(view) == view and sub_view(view) is not view
    with pytest.raises(TypeError, match="no field"):
        sub_view(view, free_blocks=3)


class _SubViewCost:
    def prefill_s(self, new_tokens: int, context_tokens: int) -> float:
        return 0.0

    def load_s(self, tokens: int, tier: object, mode: object) -> float:
        return 0.0
